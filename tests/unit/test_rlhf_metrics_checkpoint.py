"""Unit tests for chatgen.rlhf.metrics and chatgen.rlhf.checkpoint (pytest tests/unit/test_rlhf_metrics_checkpoint.py)."""

import json
import random
import time

import pytest
import torch

from chatgen.rlhf import checkpoint as ckpt
from chatgen.rlhf.data import PromptSampler
from chatgen.rlhf.metrics import MetricsLogger, PhaseTimer, plot_metrics, read_jsonl_metrics


def test_phase_timer_accumulates_and_resets():
    timer = PhaseTimer()
    with timer("generate"):
        time.sleep(0.02)
    with timer("generate"):
        time.sleep(0.02)
    with pytest.raises(RuntimeError):
        with timer("train"):
            raise RuntimeError("boom")  # a failing phase is still timed
    out = timer.pop()
    assert set(out) == {"time/generate", "time/train"}
    assert out["time/generate"] >= 0.04
    assert timer.pop() == {}


def test_metrics_logger_writes_jsonl_tensorboard_png(tmp_path, capsys):
    logger = MetricsLogger(tmp_path, phases=["generate", "train"], num_episodes=3)
    for ep in (1, 2, 3):
        logger.log(ep, {"reward/mean": 0.1 * ep, "kl/reference": 0.01 * ep, "time/generate": 0.5})
    png = logger.close()
    records = read_jsonl_metrics(tmp_path / "metrics.jsonl")
    assert [r["episode"] for r in records] == [1, 2, 3]
    assert records[2]["reward/mean"] == pytest.approx(0.3)
    assert png == tmp_path / "metrics.png" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert any(
        f.name.startswith("events.out.tfevents") for f in (tmp_path / "tensorboard").iterdir()
    )
    # not a TTY: one line per episode
    assert "episode 2/3: reward/mean 0.2" in capsys.readouterr().out


def test_metrics_logger_resume_drops_redone_episodes(tmp_path):
    logger = MetricsLogger(tmp_path, ["train"], 5, tensorboard=False)
    for ep in (1, 2, 3):
        logger.log(ep, {"reward/mean": ep})
    logger.close()
    # resume from 2
    resumed = MetricsLogger(tmp_path, ["train"], 5, start_episode=3, tensorboard=False)
    resumed.log(3, {"reward/mean": 30})
    resumed.close()
    assert [
        (r["episode"], r["reward/mean"]) for r in read_jsonl_metrics(tmp_path / "metrics.jsonl")
    ] == [(1, 1), (2, 2), (3, 30)]


@pytest.mark.faults
def test_a_torn_last_line_of_metrics_does_not_stop_a_resume(tmp_path, caplog):
    """What a kill or a full disk in the middle of an append leaves: `--resume` stopped with a JSON error naming no
    file. The torn record is dropped with a warning naming the file and line; the next append starts a line of
    its own, so the torn one cannot swallow it."""
    logger = MetricsLogger(tmp_path, ["train"], 5, tensorboard=False)
    for ep in (1, 2):
        logger.log(ep, {"reward/mean": ep})
    jsonl = tmp_path / "metrics.jsonl"
    with open(jsonl, "ab") as f:
        f.write(b'{"episode": 3, "reward/me')  # an append cut short (the disk was full)
    logger.log(3, {"reward/mean": 3})  # space again: the next one
    logger.close()
    with caplog.at_level("WARNING"):
        assert [r["episode"] for r in read_jsonl_metrics(jsonl)] == [1, 2, 3]
    assert f"{jsonl}:3: not a whole metrics record" in caplog.text
    with open(jsonl, "ab") as f:
        f.write(b'{"episode": 4, "rew')  # killed mid-append
    # --resume from 2
    resumed = MetricsLogger(tmp_path, ["train"], 5, start_episode=3, tensorboard=False)
    resumed.log(3, {"reward/mean": 30})
    resumed.close()
    assert jsonl.read_text().splitlines() == [
        '{"episode": 1, "reward/mean": 1.0}',
        '{"episode": 2, "reward/mean": 2.0}',
        '{"episode": 3, "reward/mean": 30.0}',
    ]


def test_plot_metrics_nothing_logged(tmp_path):
    assert plot_metrics(tmp_path / "missing.jsonl", tmp_path / "x.png") is None


def test_checkpoint_commit_and_latest(tmp_path):
    assert ckpt.latest_checkpoint(tmp_path) is None
    for ep in (2, 4):
        tmp = ckpt.begin_checkpoint(tmp_path, ep)
        (tmp / "policy_trainer").mkdir()
        (tmp / "policy_trainer" / "w.bin").write_bytes(b"x" * ep)
        final = ckpt.commit_checkpoint(tmp, {"episode": ep})
        assert final.name == ckpt.episode_dir_name(ep) and not tmp.exists()
    latest = ckpt.latest_checkpoint(tmp_path)
    assert latest == tmp_path / "episode_000004"
    assert ckpt.load_state(latest) == {"episode": 4}
    assert (latest / "policy_trainer" / "w.bin").read_bytes() == b"xxxx"


def test_crash_while_writing_keeps_last_good_checkpoint(tmp_path):
    tmp = ckpt.begin_checkpoint(tmp_path, 1)
    ckpt.commit_checkpoint(tmp, {"episode": 1})
    crashed = ckpt.begin_checkpoint(tmp_path, 2)
    (crashed / "half_written").write_bytes(b"partial")  # then the process dies: no commit
    assert ckpt.latest_checkpoint(tmp_path) == tmp_path / "episode_000001"
    # A stale `latest` (pointing at a missing dir) falls back to the newest complete directory.
    (tmp_path / "latest").write_text("episode_000009\n")
    assert ckpt.latest_checkpoint(tmp_path) == tmp_path / "episode_000001"
    # The next attempt at episode 2 starts from a clean temporary directory.
    again = ckpt.begin_checkpoint(tmp_path, 2)
    assert list(again.iterdir()) == []


def test_checkpoints_keep_no_secret_and_are_this_users_only(tmp_path, monkeypatch):
    """Issue 50, findings 1 and 9: engine_state.json held the unmasked config (0644, in a 0755 output
    dir), and the lock file followed a link planted at its name."""
    import os

    from chatgen.config import loader

    monkeypatch.setattr(loader, "_from_env", {"sk-from-env-123": "JUDGE_KEY"})
    out = tmp_path / "run"
    lock = ckpt.lock_output_dir(out)
    config = {
        "models": {"policy": {"config": {"args": {"password": "pw-1", "u": "x sk-from-env-123"}}}}
    }
    final = ckpt.commit_checkpoint(
        ckpt.begin_checkpoint(out / "checkpoints", 1), {"episode": 1, "config": config}
    )
    lock.close()
    text = (final / ckpt.STATE_FILE).read_text()
    assert "pw-1" not in text and "sk-from-env-123" not in text and "${JUDGE_KEY}" in text
    modes = {p.name: p.stat().st_mode & 0o777 for p in [out, *out.rglob("*")]}
    assert modes["run"] == modes["checkpoints"] == modes["episode_000001"] == 0o700
    assert modes[ckpt.STATE_FILE] == modes[ckpt.MANIFEST_FILE] == modes["latest"] == 0o600
    assert modes[ckpt.LOCK_FILE] == 0o600
    victim, planted = tmp_path / "victim.txt", tmp_path / "planted"
    victim.write_text("keep")
    planted.mkdir()
    os.symlink(victim, planted / ckpt.LOCK_FILE)
    with pytest.raises(OSError, match="symbolic link"):
        ckpt.lock_output_dir(planted)
    assert victim.read_text() == "keep"


def test_rng_state_roundtrip_through_json():
    random.seed(1)
    torch.manual_seed(1)
    state = json.loads(json.dumps(ckpt.rng_state()))
    expected = (random.random(), torch.rand(3))
    random.seed(99)
    torch.manual_seed(99)
    ckpt.set_rng_state(state)
    assert random.random() == expected[0]
    assert torch.equal(torch.rand(3), expected[1])


def test_prompt_sampler_resume_gives_same_batches():
    a = PromptSampler(10, 3, seed=5)
    batches = [a.next_batch() for _ in range(7)]
    assert all(len(b) == 3 for b in batches)
    # no repeat within a pass
    assert sorted(sum(batches[:3], [])) == sorted(set(sum(batches[:3], [])))
    b = PromptSampler(10, 3, seed=5)
    for _ in range(4):
        b.next_batch()
    c = PromptSampler(10, 3, seed=5)
    c.load_state_dict(json.loads(json.dumps(b.state_dict())))
    assert [c.next_batch() for _ in range(3)] == batches[4:]
    other = PromptSampler(10, 3, seed=6)
    assert [other.next_batch() for _ in range(3)] != batches[:3]
    with pytest.raises(ValueError, match="fewer than one batch"):
        PromptSampler(2, 3, seed=0)


def test_plot_has_only_panels_with_data_and_a_title(tmp_path, monkeypatch):
    """No reference model: no kl/reference panel; the title names the run (its directory) and the date."""
    import datetime

    import matplotlib.pyplot as plt

    figures = []
    # plot_metrics closes the figure it saved: keep it
    monkeypatch.setattr(plt, "close", figures.append)
    run = tmp_path / "my_run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(
        "".join(json.dumps({"episode": e, "reward/mean": 0.1 * e}) + "\n" for e in (1, 2))
    )
    assert plot_metrics(run / "metrics.jsonl", run / "metrics.png") == run / "metrics.png"
    (fig,) = figures
    assert [ax.get_ylabel() for ax in fig.axes] == ["reward/mean"]
    today = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    assert (
        fig._suptitle.get_text().startswith(f"{tmp_path.name}/my_run · ")
        and today in fig._suptitle.get_text()
    )
    (run / "metrics.jsonl").write_text(
        json.dumps({"episode": 1, "reward/mean": 0.1, "kl/reference": 0.2}) + "\n"
    )
    plot_metrics(run / "metrics.jsonl", run / "metrics.png", title="t")
    assert [ax.get_ylabel() for ax in figures[1].axes] == ["reward/mean", "kl/reference"]
    assert figures[1]._suptitle.get_text() == "t"
    (run / "metrics.jsonl").write_text(json.dumps({"episode": 1, "time/train": 1.0}) + "\n")
    assert plot_metrics(run / "metrics.jsonl", run / "x.png") is None  # no panel has data: no plot
