"""Weights & Biases (`runtime.loggers: [wandb]`): one wandb run per chatgen run, its files under
<output_dir>/wandb. WANDB_MODE=offline keeps it on disk (`wandb sync` uploads it later);
WANDB_API_KEY or `wandb login` for online. Metrics are plotted against `episode` (a metric of its
own, not wandb's step), so a resumed run that redoes episodes after a crash logs them again
instead of being refused as steps that went back."""

import math
import sys

import wandb

from chatgen.rlhf.config import mask_overrides


class Tracker:
    def __init__(self, out_dir, project: str, name: str, params: dict, run_id: str | None):
        """Start (or with run_id, continue) the wandb run; params: the masked resolved config."""
        # wandb records the command line (its metadata's `args`, read from sys.argv whenever it
        # writes them): an override holding a secret is masked there as everywhere else
        sys.argv[1:] = mask_overrides(sys.argv[1:])
        self.run = wandb.init(
            project=project,
            name=name,
            dir=str(out_dir),
            config=params,
            id=run_id,
            resume="allow" if run_id else None,
            allow_val_change=True,
        )
        self.run.define_metric("episode")
        self.run.define_metric("*", step_metric="episode")
        self.run_id = self.run.id

    def log(self, episode: int, metrics: dict) -> None:
        self.run.log({"episode": episode, **{k: v for k, v in metrics.items() if math.isfinite(v)}})

    def close(self) -> None:
        self.run.finish()
