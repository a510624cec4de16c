"""MLflow (`runtime.loggers: [mlflow]`): one MLflow run per chatgen run, in the experiment
runtime.project_name, at MLFLOW_TRACKING_URI; unset, a local file store <output_dir>/mlruns
(`mlflow ui --backend-store-uri file:...`), which MLflow 3 keeps in maintenance mode:
MLFLOW_ALLOW_FILE_STORE=true is set for it. The config goes in as parameters (dotted keys); a
resumed run adds the keys it did not log before (MLflow never changes a logged parameter) and
logs its metrics at their episode. MLflow names allow letters, digits, _ - . : / and space only:
eval/pass@4 is logged as eval/pass_at_4."""

import math
import os
import re
import time

from mlflow.entities import Metric, Param
from mlflow.tracking import MlflowClient
from mlflow.utils.validation import (
    MAX_METRICS_PER_BATCH,
    MAX_PARAM_VAL_LENGTH,
    MAX_PARAMS_TAGS_PER_BATCH,
)

from chatgen.rlhf.trackers import flatten


def mlflow_name(key: str) -> str:
    """`key` in the characters MLflow accepts in metric and parameter names."""
    return re.sub(r"[^\w\-.:/ ]", "_", key.replace("@", "_at_"))


class Tracker:
    def __init__(self, out_dir, project: str, name: str, params: dict, run_id: str | None):
        """Start (or with run_id, continue) the MLflow run; params: the masked resolved config."""
        uri = os.environ.get("MLFLOW_TRACKING_URI") or (out_dir / "mlruns").resolve().as_uri()
        if uri.startswith("file:"):  # refused unless asked (its sqlite store needs full mlflow)
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        if run_id:
            logged = self.client.get_run(run_id).data.params
            self.client.update_run(run_id, status="RUNNING")
        else:
            experiment = self.client.get_experiment_by_name(project)
            experiment_id = (
                experiment.experiment_id if experiment else self.client.create_experiment(project)
            )
            run_id, logged = self.client.create_run(experiment_id, run_name=name).info.run_id, {}
        self.run_id = run_id
        flat = {mlflow_name(k): str(v)[:MAX_PARAM_VAL_LENGTH] for k, v in flatten(params).items()}
        new = [Param(k, v) for k, v in flat.items() if k not in logged]
        for start in range(0, len(new), MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(run_id, params=new[start : start + MAX_PARAMS_TAGS_PER_BATCH])

    def log(self, episode: int, metrics: dict) -> None:
        now = int(time.time() * 1000)
        rows = [
            Metric(mlflow_name(k), v, now, episode) for k, v in metrics.items() if math.isfinite(v)
        ]
        for start in range(0, len(rows), MAX_METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=rows[start : start + MAX_METRICS_PER_BATCH])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)
