"""Experiment trackers beside metrics.jsonl: `runtime.loggers: [jsonl, tensorboard, wandb, mlflow]`.

    trackers = start_trackers(cfg, Path("outputs/run"), resume=False)  # wandb, mlflow: one each
    for t in trackers: t.log(episode, {"reward/mean": 0.4})  # MetricsLogger.log, each episode
    for t in trackers: t.close()

Each tracker is one small file here (wandb_tracker, mlflow_tracker); its library is imported only
when runtime.loggers names it (jsonl and tensorboard are MetricsLogger's own). The resolved config
is logged as the run's parameters, the value of every key named like a credential masked. The
tracker's run id is kept in `<output_dir>/trackers.json`, so `chatgen train --resume` continues the
same run. docs/data_and_rewards.md.
"""

import importlib
import json

from chatgen.config.loader import MASK, mask_secrets  # noqa: F401 (MASK: what a masked value reads)
from chatgen.core.checkpoint_io import write_private_text
from chatgen.rlhf.config import to_dict

IDS_NAME = "trackers.json"
MODULES = {
    "wandb": "chatgen.rlhf.trackers.wandb_tracker",
    "mlflow": "chatgen.rlhf.trackers.mlflow_tracker",
}


def flatten(tree: dict, prefix: str = "") -> dict:
    """{"runtime.seed": 1234, ...}: one dotted key per leaf of nested dicts (lists are leaves)."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def start_trackers(cfg, out_dir, resume: bool) -> list:
    """The trackers runtime.loggers names, each started on `cfg`'s masked resolved config;
    resume: continue the run ids `<out_dir>/trackers.json` recorded."""
    rt, ids_path = cfg.runtime, out_dir / IDS_NAME
    ids = json.loads(ids_path.read_text()) if resume and ids_path.exists() else {}
    params = mask_secrets(to_dict(cfg))
    name = rt.experiment_name or out_dir.resolve().name
    trackers = []
    try:
        for logger in [n for n in rt.loggers if n in MODULES]:
            module = importlib.import_module(MODULES[logger])
            trackers.append(module.Tracker(out_dir, rt.project_name, name, params, ids.get(logger)))
            ids[logger] = trackers[-1].run_id
    except BaseException:
        for tracker in trackers:
            tracker.close()
        raise
    if trackers:
        write_private_text(ids_path, json.dumps(ids, indent=1) + "\n")
    return trackers
