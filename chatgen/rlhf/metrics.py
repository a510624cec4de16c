"""What a run reports: per-phase timers, a progress bar per phase, JSONL + TensorBoard metrics, a PNG plot.

    timer = PhaseTimer()
    with timer("generate"):
        ...
    logger = MetricsLogger("outputs/run", phases=["generate", "train"], num_episodes=50)
    logger.log(episode, {"reward/mean": 0.4, **timer.pop()})
    logger.close()   # writes outputs/run/metrics.png (reward and KL to the reference per episode)

Files under the run directory: metrics.jsonl (one object per episode, {"episode": k, ...}),
tensorboard/ (`tensorboard --logdir outputs/run/tensorboard`), metrics.png. Resuming from episode k keeps
the records up to k and drops the later ones (they are about to be redone).
"""
import json
import logging
import math
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from tqdm.auto import tqdm

from chatgen.core.checkpoint_io import atomic_file

logger = logging.getLogger(__name__)


class PhaseTimer:
    """Wall-clock seconds per named phase; `pop()` returns {"time/<phase>": s, ...} and resets."""

    def __init__(self):
        self.seconds = {}

    @contextmanager
    def __call__(self, phase: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start

    def pop(self) -> dict:
        out = {f"time/{k}": v for k, v in self.seconds.items()}
        self.seconds = {}
        return out


def read_jsonl_metrics(path) -> list[dict]:
    """The episode records of a metrics.jsonl. A line that is not a whole record (what a kill or a full disk in the
    middle of an append leaves) is dropped with a warning naming the file and line: the metrics of one episode
    are lost, the run is not."""
    path = Path(path)
    if not path.exists():
        return []
    records = []
    for lineno, line in enumerate(path.read_bytes().split(b"\n"), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:  # torn JSON, or a torn UTF-8 sequence
            record = None
        if isinstance(record, dict) and isinstance(record.get("episode"), int):
            records.append(record)
        else:
            logger.warning("%s:%d: not a whole metrics record (an append cut short by a kill or a full disk?): "
                           "dropped: %r", path, lineno, line[:80])
    return records


class MetricsLogger:
    """Writes each episode's metrics to JSONL and TensorBoard and moves one progress bar per phase.

    The bars show on a terminal; when stdout is not one (a log file, CI) each episode prints one line instead.
    `start_episode` is the first episode this process will run (1 for a fresh run, k+1 after resuming from k).
    """

    def __init__(self, out_dir, phases, num_episodes: int, start_episode: int = 1, tensorboard: bool = True):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = self.out_dir / "metrics.jsonl"
        kept = [r for r in read_jsonl_metrics(self.jsonl) if r["episode"] < start_episode]
        with atomic_file(self.jsonl) as tmp:  # a kill here leaves the old file, never half of the new one
            tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        self.writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            # purge_step drops events at or after start_episode that a crashed run left behind
            self.writer = SummaryWriter(str(self.out_dir / "tensorboard"), purge_step=start_episode)
        self.interactive = sys.stderr.isatty()
        self.bars = {}
        if self.interactive:
            width = max(map(len, phases))
            for i, phase in enumerate(phases):
                self.bars[phase] = tqdm(total=num_episodes, initial=start_episode - 1, position=i,
                                        desc=phase.ljust(width), unit="ep", dynamic_ncols=True, leave=True)

    def log(self, episode: int, metrics: dict) -> None:
        record = {"episode": episode, **{k: float(v) for k, v in metrics.items()}}
        line = (json.dumps(record) + "\n").encode()
        with open(self.jsonl, "a+b") as f:  # "a+": every write appends, reads go anywhere
            end = f.seek(0, os.SEEK_END)
            if end:
                f.seek(end - 1)
                if f.read(1) != b"\n":  # the last append was cut short (a kill, a full disk): its torn line
                    line = b"\n" + line  # ends here, and this record starts a line of its own
            f.write(line)
        if self.writer is not None:
            for key, value in record.items():
                if key != "episode" and math.isfinite(value):
                    self.writer.add_scalar(key, value, episode)
            self.writer.flush()
        if self.interactive and episode > 0:  # episode 0 = the evaluation before training
            for phase, bar in self.bars.items():
                seconds = metrics.get(f"time/{phase}")
                if seconds is not None:
                    bar.set_postfix_str(f"{seconds:.2f}s", refresh=False)
                bar.update(1)
        else:
            print(f"episode {episode}: " + " ".join(f"{k}={v:.4g}" for k, v in sorted(metrics.items())), flush=True)

    def close(self) -> Path | None:
        """Close bars and writer; plot the run's reward and KL per episode to metrics.png (None if no data)."""
        for bar in self.bars.values():
            bar.close()
        if self.writer is not None:
            self.writer.close()
        return plot_metrics(self.jsonl, self.out_dir / "metrics.png")


def plot_metrics(jsonl_path, png_path, keys=(("reward/mean", "eval/reward"), ("kl/reference",))) -> Path | None:
    """One panel per group of `keys`: those metrics against episode (keys never logged are skipped).
    Returns png_path, or None when nothing was logged."""
    records = read_jsonl_metrics(jsonl_path)
    if not records:
        return None
    import matplotlib
    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(keys), 1, figsize=(7, 3 * len(keys)), sharex=True, squeeze=False)
    for ax, group in zip(axes[:, 0], keys):
        for name in group:
            points = [(r["episode"], r[name]) for r in records if name in r]
            if points:
                ax.plot(*zip(*points), marker="o" if len(points) < 30 else None, markersize=3, label=name)
        ax.set_ylabel(" / ".join(group))
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="best", fontsize=8)
    axes[-1, 0].set_xlabel("episode")
    fig.tight_layout()
    png_path = Path(png_path)
    try:
        with atomic_file(png_path) as tmp:
            fig.savefig(tmp, dpi=100)
    finally:
        plt.close(fig)
    return png_path


def sample_metrics(rewards: torch.Tensor, batch, old_logprobs: torch.Tensor, solved_reward: float | None = 1.0,
                   is_weights: torch.Tensor | None = None) -> dict:
    """Reward, length and train/inference mismatch figures of one episode's samples (a RolloutBatch)."""
    mask = batch.loss_mask
    diff = (old_logprobs - batch.infer_logprobs).abs() * mask
    metrics = {
        "reward/mean": rewards.mean().item(),
        "reward/std": rewards.std().item() if rewards.numel() > 1 else 0.0,
        "response/length": batch.response_lengths.float().mean().item(),
        "mismatch/logprob_max_abs": diff.max().item(),
        "mismatch/logprob_mean_abs": (diff.sum() / mask.sum().clamp(min=1)).item(),
    }
    if solved_reward is not None:
        metrics["reward/solved"] = (rewards >= solved_reward).float().mean().item()
    if is_weights is not None:  # truncated importance sampling on: how far from 1 the weights are
        metrics["mismatch/is_weight_mean"] = (is_weights * mask).sum().item() / max(mask.sum().item(), 1)
        metrics["mismatch/is_weight_min"] = is_weights[mask > 0].min().item()
    return metrics


def prefixed(prefix: str, stats: dict) -> dict:
    return {f"{prefix}/{k}": v for k, v in stats.items()}
