"""What a run reports: per-phase timers, one live progress line, JSONL + TensorBoard metrics, a PNG
plot, a summary.

    logger = MetricsLogger("outputs/run", phases=["generate", "train"], num_episodes=50)
    timer = PhaseTimer(on_start=logger.show_phase)
    with timer("generate"):
        ...
    logger.log(episode, {"reward/mean": 0.4, **timer.pop()})
    logger.close()   # writes outputs/run/metrics.png (reward and KL to the reference per episode)
    say(summary(read_jsonl_metrics("outputs/run/metrics.jsonl"), ["generate", "train"], {"metrics": ...}))

Files under the run directory: metrics.jsonl (one object per episode, {"episode": k, ...}),
tensorboard/ (`tensorboard --logdir outputs/run/tensorboard`), metrics.png. Resuming from episode k
keeps the records up to k and drops the later ones (they are about to be redone).

On a terminal (stdout a TTY) a run shows one live line: `episode |███   | 12/60, train · eval/reward
0.830 · 0.57 s/episode [00:08<00:27]` (the phase running now, the last held-out figure, the last
episode's seconds, elapsed < ETA). Elsewhere (CI, a log file) each episode prints one plain line
with the same figures. `progress_bar` and `say` give the warm start and `chatgen generate` the same
line.
"""

import datetime
import json
import logging
import math
import os
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from tqdm.auto import tqdm

from chatgen.core.checkpoint_io import atomic_file

logger = logging.getLogger(__name__)


BAR_FORMAT = "{desc} |{bar:12}| {n_fmt}/{total_fmt}{postfix} [{elapsed}<{remaining}]"
# the first of these a run logs stands for its training progress
HEADLINE = (
    "reward/mean",
    "policy/loss",
)
ASYNC_SHOWN = ("async/staleness_mean", "async/buffer_fill")  # max_staleness runs (docs/async_rl.md)
MAX_EVAL_KEYS = 3  # held-out figures shown per line and in the summary (metrics.jsonl has them all)
MAX_ROWS = 16  # rows of the summary's curve: every evaluation of the 60-episode tiny job


def progress_bar(total: int, what: str, initial: int = 0) -> tqdm:
    """The one live line of a long job on stdout: `what |bar| k/total, <postfix> [elapsed<ETA]`.
    Disabled (every call a no-op, `.disable` True) when stdout is not a terminal, or one of width
    0 (a pseudo-terminal some CI runners give, where tqdm draws nothing): the caller prints plain
    lines instead."""
    try:
        live = sys.stdout.isatty() and os.get_terminal_size(sys.stdout.fileno()).columns > 0
    except (OSError, ValueError):  # no file descriptor behind sys.stdout
        live = False
    return tqdm(
        total=total,
        initial=initial,
        desc=what,
        file=sys.stdout,
        dynamic_ncols=True,
        bar_format=BAR_FORMAT,
        disable=not live,
    )


def say(message: str) -> None:
    """Print a line to stdout, above the live progress line if one is drawn (never through it)."""
    with tqdm.external_write_mode(file=sys.stdout):
        print(message, flush=True)


class PhaseTimer:
    """Wall-clock seconds per named phase; `pop()` returns {"time/<phase>": s, ...} and resets.
    on_start(phase) is called as each phase begins (the progress line shows it)."""

    def __init__(self, on_start=None):
        self.seconds = {}
        self.on_start = on_start

    @contextmanager
    def __call__(self, phase: str):
        if self.on_start is not None:
            self.on_start(phase)
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
    """The episode records of a metrics.jsonl. A line that is not a whole record (what a kill or
    a full disk in the middle of an append leaves) is dropped with a warning naming the file and
    line: the metrics of one episode are lost, the run is not."""
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
            logger.warning(
                "%s:%d: not a whole metrics record (an append cut short by a kill or a full disk?): "
                "dropped: %r",
                path,
                lineno,
                line[:80],
            )
    return records


class MetricsLogger:
    """Writes each episode's metrics to JSONL and TensorBoard and moves the run's progress line.

    The live line shows on a terminal; when stdout is not one (a log file, CI) each episode prints
    one line instead. `start_episode` is the first episode this process will run (1 for a fresh run,
    k+1 after resuming from k). `phases`: the algorithm's phases, in order (the summary's time per
    phase follows it). `trackers`: started chatgen.rlhf.trackers (wandb, mlflow), given every
    record, closed with it.
    """

    def __init__(
        self,
        out_dir,
        phases,
        num_episodes: int,
        start_episode: int = 1,
        tensorboard: bool = True,
        trackers: list = (),
    ):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = self.out_dir / "metrics.jsonl"
        kept = [r for r in read_jsonl_metrics(self.jsonl) if r["episode"] < start_episode]
        # a kill here leaves the old file, never half of the new one
        with atomic_file(self.jsonl) as tmp:
            tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        self.writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step drops events at or after start_episode that a crashed run left behind
            self.writer = SummaryWriter(str(self.out_dir / "tensorboard"), purge_step=start_episode)
        self.trackers = list(trackers)  # chatgen.rlhf.trackers: wandb, mlflow
        self.phases, self.num_episodes = list(phases), num_episodes
        self.bar = progress_bar(num_episodes, "episode", start_episode - 1)
        # the live line after the count, in this order
        self.status = {
            "phase": "",
            "eval": "",
            "episode": "",
        }
        self.episode_seconds = []  # of this process's episodes: the ETA of the plain lines

    def log(self, episode: int, metrics: dict) -> None:
        record = {"episode": episode, **{k: float(v) for k, v in metrics.items()}}
        line = (json.dumps(record) + "\n").encode()
        with open(self.jsonl, "a+b") as f:  # "a+": every write appends, reads go anywhere
            end = f.seek(0, os.SEEK_END)
            if end:
                f.seek(end - 1)
                # the last append was cut short (a kill, a full disk): its torn line
                if f.read(1) != b"\n":
                    line = b"\n" + line  # ends here, and this record starts a line of its own
            f.write(line)
        if self.writer is not None:
            for key, value in record.items():
                if key != "episode" and math.isfinite(value):
                    self.writer.add_scalar(key, value, episode)
            self.writer.flush()
        for tracker in list(self.trackers):
            self._tracked(
                tracker, "log", episode, {k: v for k, v in record.items() if k != "episode"}
            )
        self.show_episode(record)

    def _tracked(self, tracker, method: str, *args) -> None:
        """A tracker's call; one that fails (a full disk, a lost server) is reported once, naming
        it and the episode, and dropped: the run and metrics.jsonl go on without it."""
        try:
            getattr(tracker, method)(*args)
        except Exception as e:  # noqa: BLE001 - whatever the tracker's library raises
            self.trackers.remove(tracker)
            name = type(tracker).__module__.rpartition(".")[2].removesuffix("_tracker")
            at = f" at episode {args[0]}" if method == "log" else ""
            logger.warning(
                "runtime.loggers: %s failed%s (%s: %s); it is dropped for the rest of the run, "
                "metrics.jsonl keeps every episode",
                name,
                at,
                type(e).__name__,
                e,
            )

    def show_phase(self, phase: str) -> None:
        self.status["phase"] = phase
        self.bar.set_postfix_str(" · ".join(v for v in self.status.values() if v))

    def show_episode(self, record: dict) -> None:
        """Move the live line on by one episode (episode 0, the evaluation before training, only
        sets its figure), or print the episode's plain line."""
        episode, seconds = record["episode"], record.get("time/episode")
        evals = eval_keys([record])
        if not self.bar.disable:
            if evals:
                self.status["eval"] = f"{evals[0]} {record[evals[0]]:.3f}"
            if ASYNC_SHOWN[0] in record:
                self.status["async"] = f"staleness {record[ASYNC_SHOWN[0]]:.2f}"
            if episode > 0:
                self.status["episode"] = f"{seconds:.2f} s/episode" if seconds is not None else ""
                self.bar.update(1)
            self.show_phase("")
            return
        shown = [*headline_keys([record]), *evals, *[k for k in ASYNC_SHOWN if k in record]]
        figures = [f"{k} {record[k]:.4g}" for k in shown]
        if episode == 0:
            say(f"episode 0/{self.num_episodes} (before training): " + " · ".join(figures))
            return
        if seconds is not None:
            self.episode_seconds.append(seconds)
            left = statistics.fmean(self.episode_seconds) * (self.num_episodes - episode)
            figures += [f"{seconds:.2f} s", f"ETA {tqdm.format_interval(left)}"]
        say(f"episode {episode}/{self.num_episodes}: " + " · ".join(figures))

    def close(self) -> Path | None:
        """Close the progress line and the writer; plot the run's reward and KL per episode to
        metrics.png (None if no data)."""
        self.bar.close()
        if self.writer is not None:
            self.writer.close()
        for tracker in list(self.trackers):
            self._tracked(tracker, "close")
        return plot_metrics(self.jsonl, self.out_dir / "metrics.png")


def headline_keys(records: list) -> list:
    """[the first of HEADLINE that `records` hold], or []."""
    for key in HEADLINE:
        if any(key in r for r in records):
            return [key]
    return []


def eval_keys(records: list) -> list:
    """The held-out figures ("eval/...") that `records` hold, in the order logged, at most
    MAX_EVAL_KEYS."""
    keys = dict.fromkeys(k for r in records for k in r if k.startswith("eval/"))
    return list(keys)[:MAX_EVAL_KEYS]


def summary(records: list, phases: list, places: dict, title: str = "") -> str:
    """The end-of-run table: the curve (each evaluation, or a sample of episodes when there is
    none; at most MAX_ROWS rows, the first and the last included) with the seconds of episodes so
    far, the median seconds of each phase per episode it ran in, and `places` ({"metrics": path,
    ...}) one per line."""
    columns = [*headline_keys(records), *eval_keys(records)]
    timed = [r for r in records if r["episode"] > 0]
    rows = [r for r in records if any(k in r for k in eval_keys(records))] or timed
    if len(rows) > MAX_ROWS:
        rows = [rows[round(i * (len(rows) - 1) / (MAX_ROWS - 1))] for i in range(MAX_ROWS)]
    elapsed, seconds = {}, 0.0
    for r in records:
        seconds += r.get("time/episode", 0.0)
        elapsed[r["episode"]] = seconds
    widths = [max(7, len(c)) for c in columns]
    lines = [title] if title else []
    lines.append(
        f"  {'episode':>7}  {'time':>7}" + "".join(f"  {c:>{w}}" for c, w in zip(columns, widths))
    )
    for r in rows:
        cells = [f"{r[c]:.3f}" if c in r else "-" for c in columns]
        lines.append(
            f"  {r['episode']:7d}  {tqdm.format_interval(elapsed[r['episode']]):>7}"
            + "".join(f"  {c:>{w}}" for c, w in zip(cells, widths))
        )
    per_phase = []
    for phase in phases:
        values = [r[f"time/{phase}"] for r in timed if f"time/{phase}" in r]
        if values:
            count = "" if len(values) == len(timed) else f" ({len(values)}x)"
            per_phase.append(f"{phase} {statistics.median(values):.2f}{count}")
    if timed:
        per_phase.append(
            f"episode {statistics.median(r.get('time/episode', 0.0) for r in timed):.2f}"
        )
        lines.append("  seconds per episode (median): " + " · ".join(per_phase))
    asynchronous = [k for k in ASYNC_SHOWN if any(k in r for r in timed)]
    if asynchronous:  # median per episode
        medians = [
            f"{k} {statistics.median(r[k] for r in timed if k in r):.2f}" for k in asynchronous
        ]
        lines.append("  asynchronous (median): " + " · ".join(medians))
    width = max(map(len, places), default=0)
    lines += [f"  {name.ljust(width)}  {place}" for name, place in places.items()]
    return "\n".join(lines)


def plot_metrics(
    jsonl_path,
    png_path,
    keys=(
        ("reward/mean", "eval/reward"),
        ("policy/accuracy", "eval/preference_accuracy"),
        ("kl/reference",),
    ),
    title: str | None = None,
) -> Path | None:
    """One panel per group of `keys` that has data: those metrics against episode (keys never logged
    are skipped, a group with none is no panel: no empty KL panel for a run without a reference
    model; the accuracies panel is DPO's). The title: `title`, default the run's name (the last two parts of png_path's directory)
    and the time metrics were last written. Returns png_path, or None when nothing in `keys` was
    logged."""
    records = read_jsonl_metrics(jsonl_path)
    panels = []
    for group in keys:
        lines = [(name, [(r["episode"], r[name]) for r in records if name in r]) for name in group]
        if any(points for _, points in lines):
            panels.append([(name, points) for name, points in lines if points])
    if not panels:
        return None
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    if title is None:
        mtime = Path(jsonl_path).stat().st_mtime
        written = datetime.datetime.fromtimestamp(mtime, datetime.timezone.utc)
        # outputs/grpo_tiny/<date> -> grpo_tiny/<date>
        run = "/".join(Path(png_path).resolve().parent.parts[-2:])
        title = f"{run} · {written:%Y-%m-%d %H:%M} UTC"
    fig, axes = plt.subplots(
        len(panels), 1, figsize=(7, 3 * len(panels) + 0.4), sharex=True, squeeze=False
    )
    fig.suptitle(title)
    for ax, panel in zip(axes[:, 0], panels):
        for name, points in panel:
            marker = "o" if len(points) < 30 else None
            ax.plot(*zip(*points), marker=marker, markersize=3, label=name)
        ax.set_ylabel(" / ".join(name for name, _ in panel))
        ax.grid(alpha=0.3)
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


def sample_metrics(
    rewards: torch.Tensor,
    batch,
    old_logprobs: torch.Tensor,
    solved_reward: float | None = 1.0,
    is_weights: torch.Tensor | None = None,
) -> dict:
    """Reward, length and train/inference mismatch figures of one episode's samples (a
    RolloutBatch)."""
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
        metrics["mismatch/is_weight_mean"] = (is_weights * mask).sum().item() / max(
            mask.sum().item(), 1
        )
        metrics["mismatch/is_weight_min"] = is_weights[mask > 0].min().item()
    return metrics


def prefixed(prefix: str, stats: dict) -> dict:
    return {f"{prefix}/{k}": v for k, v in stats.items()}


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimator of pass@k (Chen et al. 2021, "Evaluating Large Language Models
    Trained on Code"): the chance that at least one of k samples drawn without replacement from
    n, c of them correct, is correct, 1 - C(n - c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k: needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k)


def eval_metrics(
    rewards: torch.Tensor, n: int, solved_reward: float | None, prefix: str = "eval"
) -> dict:
    """Held-out figures of (P x n,) rewards, prompt-major (prompt i's samples at rows i*n ..
    i*n+n-1): <prefix>/reward (mean), <prefix>/solved (share of samples with reward >=
    solved_reward), and with n > 1: <prefix>/mean@n (the mean over each prompt's n samples,
    averaged over prompts: <prefix>/reward under the name verl logs) and <prefix>/pass@k for k =
    1, 2, 4, ... and n (a prompt passes when one of k samples is solved; the unbiased estimator
    over its n samples)."""
    metrics = {f"{prefix}/reward": rewards.mean().item()}
    if n > 1:
        metrics[f"{prefix}/mean@{n}"] = rewards.view(-1, n).mean(1).mean().item()
    if solved_reward is None:
        return metrics
    solved = rewards >= solved_reward
    metrics[f"{prefix}/solved"] = solved.float().mean().item()
    if n > 1:
        correct = solved.view(-1, n).sum(1).tolist()
        for k in sorted({*(2**i for i in range(n.bit_length()) if 2**i <= n), n}):
            metrics[f"{prefix}/pass@{k}"] = statistics.fmean(pass_at_k(n, c, k) for c in correct)
    return metrics
