"""What a run shows while it runs and when it ends (chatgen.rlhf.metrics): one line per episode off a terminal, one
live line on it, a summary table (pytest tests/unit/test_progress.py)."""

import io
import os

import pytest

from chatgen.rlhf import metrics
from chatgen.rlhf.metrics import MetricsLogger, PhaseTimer, summary


def grpo_records(episodes: int, eval_every: int) -> list:
    records = [{"episode": 0, "eval/reward": 0.3, "eval/solved": 0.1, "time/eval": 0.4}]
    for k in range(1, episodes + 1):
        r = {
            "episode": k,
            "reward/mean": 0.5 + k / 1000,
            "policy/loss": 0.01,
            "time/generate": 0.2,
            "time/train": 0.3,
            "time/episode": 0.65,
        }
        if k % eval_every == 0:
            r.update({"eval/reward": 0.8 + k / 1000, "eval/solved": 0.5, "time/eval": 0.4})
        records.append(r)
    return records


def test_summary_shows_the_curve_time_per_phase_and_the_files():
    text = summary(
        grpo_records(10, 5),
        ["generate", "reward", "train", "eval"],
        {"metrics": "out/metrics.jsonl", "checkpoints": "out/checkpoints/episode_000010"},
        "[chatgen] done",
    )
    lines = text.splitlines()
    assert lines[0] == "[chatgen] done"
    # loss: not headline
    assert lines[1].split() == [
        "episode",
        "time",
        "reward/mean",
        "eval/reward",
        "eval/solved",
    ]
    # every evaluation, episode 0 included
    assert [line.split()[0] for line in lines[2:5]] == [
        "0",
        "5",
        "10",
    ]
    # 10 x 0.65 s
    assert lines[2].split()[2] == "-" and lines[4].split()[1:4] == [
        "00:06",
        "0.510",
        "0.810",
    ]
    # reward never ran: left out
    assert "generate 0.20 · train 0.30 · eval 0.40 (2x) · episode 0.65" in lines[5]
    assert lines[6:] == [
        "  metrics      out/metrics.jsonl",
        "  checkpoints  out/checkpoints/episode_000010",
    ]


def test_summary_of_a_long_run_keeps_max_rows_first_and_last_included():
    lines = summary(grpo_records(1000, 5), ["generate"], {}).splitlines()
    episodes = [int(line.split()[0]) for line in lines[1:-1]]
    assert len(episodes) == metrics.MAX_ROWS and episodes[0] == 0 and episodes[-1] == 1000
    assert episodes == sorted(episodes)


def test_summary_without_evaluations_samples_the_episodes():
    records = [{"episode": k, "policy/loss": 1 / k, "time/episode": 1.0} for k in range(1, 4)]
    lines = summary(records, [], {}).splitlines()
    assert lines[0].split() == ["episode", "time", "policy/loss"]
    assert [line.split()[0] for line in lines[1:4]] == ["1", "2", "3"]


def test_off_a_terminal_each_episode_is_one_short_line(tmp_path, capsys):
    logger = MetricsLogger(tmp_path, ["generate", "train"], 4, tensorboard=False)
    timer = PhaseTimer(on_start=logger.show_phase)
    assert logger.bar.disable  # pytest's stdout is no terminal
    for record in grpo_records(4, 2):
        logger.log(record["episode"], {k: v for k, v in record.items() if k != "episode"})
    logger.close()
    with timer("generate"):
        pass
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "episode 0/4 (before training): eval/reward 0.3 · eval/solved 0.1"
    assert (
        out[2]
        == "episode 2/4: reward/mean 0.502 · eval/reward 0.802 · eval/solved 0.5 · 0.65 s · ETA 00:01"
    )
    assert out[4].endswith("ETA 00:00") and len(out) == 5 and max(map(len, out)) < 100


class Terminal(io.StringIO):
    def isatty(self):
        return True

    def fileno(self):
        return 1


def test_on_a_terminal_one_live_line_shows_the_phase_the_last_evaluation_and_the_episode_time(
    tmp_path, monkeypatch
):
    terminal = Terminal()
    monkeypatch.setattr("sys.stdout", terminal)
    monkeypatch.setattr(os, "get_terminal_size", lambda fd: os.terminal_size((100, 40)))
    logger = MetricsLogger(tmp_path, ["generate", "train"], 4, tensorboard=False)
    timer = PhaseTimer(on_start=logger.show_phase)
    records = grpo_records(4, 2)
    logger.log(0, {k: v for k, v in records[0].items() if k != "episode"})
    with timer("generate"):
        line = terminal.getvalue().split("\r")[-1]
    assert "0/4, generate · eval/reward 0.300" in line
    logger.log(1, {k: v for k, v in records[1].items() if k != "episode"})
    with timer("train"):
        line = terminal.getvalue().split("\r")[-1]
    assert (
        line.startswith("episode |") and "1/4, train · eval/reward 0.300 · 0.65 s/episode [" in line
    )
    logger.close()
    # one line, redrawn in place; no per-episode lines
    assert "\n" not in terminal.getvalue().rstrip("\n")


@pytest.mark.parametrize("size", [os.terminal_size((0, 0)), OSError])
def test_a_terminal_of_no_width_or_no_descriptor_gets_plain_lines(size, monkeypatch):
    def terminal_size(fd):
        if size is OSError:
            raise OSError("not a terminal")
        return size

    monkeypatch.setattr("sys.stdout", Terminal())
    monkeypatch.setattr(os, "get_terminal_size", terminal_size)
    assert metrics.progress_bar(3, "step").disable


def test_an_asynchronous_run_shows_its_staleness():
    records = grpo_records(4, 2)
    for k, r in enumerate(records[1:], 1):
        r.update({"async/staleness_mean": k / 2, "async/buffer_fill": 1 / 3})
    text = summary(records, ["generate", "train"], {"metrics": "m.jsonl"})
    assert "  asynchronous (median): async/staleness_mean 1.25 · async/buffer_fill 0.33" in text
    assert "asynchronous" not in summary(grpo_records(4, 2), ["generate"], {"metrics": "m.jsonl"})
