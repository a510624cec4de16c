"""runtime.loggers: the real wandb (offline: its run file read back) and the real mlflow (a local
file store read back with its client) get every episode's metrics and the masked resolved config,
and a resumed run continues the same tracker run.

    pytest tests/unit/test_trackers.py
"""

import json
import struct
import sys
from pathlib import Path

import pytest

from chatgen.rlhf.config import load_config
from chatgen.rlhf.metrics import MetricsLogger
from chatgen.rlhf.trackers import IDS_NAME, MASK, flatten, mask_secrets, start_trackers

TINY = Path(__file__).resolve().parents[2] / "configs" / "grpo_tiny.yaml"
SECRET = "sk-do-not-log-me"


def test_mask_secrets_masks_credentials_not_column_names(monkeypatch):
    from chatgen.config import loader

    # no ${VAR} text read by another test of this process
    monkeypatch.setattr(loader, "_from_env", {})
    tree = {
        "runtime": {"prompt_key": "question", "answer_key": "solution", "seed": 1},
        "models": {
            "reward": {
                "config": {
                    "api_key": SECRET,
                    "hf_token": SECRET,
                    "password": "",
                    "max_tokens": 8,
                    "headers": [{"secret": SECRET}],
                }
            }
        },
    }
    flat = flatten(mask_secrets(tree))
    assert flat["runtime.prompt_key"] == "question" and flat["runtime.answer_key"] == "solution"
    assert flat["models.reward.config.api_key"] == flat["models.reward.config.hf_token"] == MASK
    assert (
        flat["models.reward.config.password"] == "" and flat["models.reward.config.max_tokens"] == 8
    )
    assert SECRET not in json.dumps(flat)


def run_episodes(cfg, out: Path, episodes, resume: bool) -> list:
    trackers = start_trackers(cfg, out, resume=resume)
    logger = MetricsLogger(
        out, [], 3, start_episode=episodes[0], tensorboard=False, trackers=trackers
    )
    for episode in episodes:
        logger.log(
            episode,
            {"reward/mean": episode / 10, "eval/pass@4": episode / 4, "eval/bad": float("nan")},
        )
    logger.close()
    return trackers


def config(data, out: Path, logger: str):
    cfg = load_config(
        TINY, [*data, f"runtime.output_dir={out}", f"runtime.loggers=[jsonl,{logger}]"]
    )
    cfg.models["policy"].config.args["api_key"] = (
        SECRET  # a credential a user put among their own keys
    )
    return cfg


def wandb_records(run_file: Path) -> list:
    """The protobuf records of a .wandb file (a LevelDB-style log: 7-byte header, 32 KiB blocks of
    crc32 + length + type chunks)."""
    from wandb.proto import wandb_internal_pb2

    raw, pos, records, chunk = run_file.read_bytes(), 7, [], b""
    assert raw[:4] == b":W&B"
    while pos + 7 <= len(raw):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a chunk header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos : pos + 7])
        chunk, pos = chunk + raw[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            records.append(wandb_internal_pb2.Record.FromString(chunk))
            chunk = b""
    return records


def test_wandb_offline_run_holds_the_metrics_and_the_masked_config_and_resume_continues_it(
    data, tmp_path, monkeypatch
):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    # issue 50, finding 8: wandb records the command line, where an override may hold a secret
    monkeypatch.setattr(sys, "argv", ["chatgen", "train", "x.yaml", f"policy.args.token={SECRET}"])
    out = tmp_path / "run"
    (first,) = run_episodes(config(data, out, "wandb"), out, [1, 2], resume=False)
    (again,) = run_episodes(config(data, out, "wandb"), out, [3], resume=True)
    assert again.run_id == first.run_id == json.loads((out / IDS_NAME).read_text())["wandb"]
    history, params = {}, {}
    run_files = sorted(
        (out / "wandb").glob(f"offline-run-*-{first.run_id}/run-{first.run_id}.wandb")
    )
    assert len(run_files) == 2  # the first process's and the resumed one's, one run id
    for run_file in run_files:
        assert SECRET.encode() not in run_file.read_bytes()
        for record in wandb_records(run_file):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                row = {
                    i.key or "/".join(i.nested_key): json.loads(i.value_json)
                    for i in record.history.item
                }
                history[row["episode"]] = row
            elif kind in ("run", "config"):
                updates = record.run.config.update if kind == "run" else record.config.update
                params.update(
                    {u.key or "/".join(u.nested_key): json.loads(u.value_json) for u in updates}
                )
    assert sorted(history) == [1, 2, 3]
    assert [history[e]["reward/mean"] for e in (1, 2, 3)] == pytest.approx([0.1, 0.2, 0.3])
    assert history[2]["eval/pass@4"] == pytest.approx(0.5) and "eval/bad" not in history[2]
    assert (
        params["runtime"]["seed"] == 1234
        and params["models"]["policy"]["config"]["args"]["api_key"] == MASK
    )
    leaked = [p for p in out.rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()]
    assert leaked == [] and sys.argv[-1] == f"policy.args.token={MASK}"


def test_mlflow_file_store_holds_the_metrics_and_params_and_resume_continues_the_run(
    data, tmp_path, monkeypatch
):
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    out = tmp_path / "run"
    (first,) = run_episodes(config(data, out, "mlflow"), out, [1, 2], resume=False)
    (again,) = run_episodes(config(data, out, "mlflow"), out, [3], resume=True)
    assert again.run_id == first.run_id
    client = MlflowClient(tracking_uri=(out / "mlruns").resolve().as_uri())
    run = client.get_run(first.run_id)
    assert (
        client.get_experiment(run.info.experiment_id).name == "chatgen"
        and run.info.run_name == "run"
    )
    assert run.info.status == "FINISHED"
    history = client.get_metric_history(first.run_id, "reward/mean")
    assert sorted(m.step for m in history) == [1, 2, 3]
    assert [m.value for m in sorted(history, key=lambda m: m.step)] == pytest.approx(
        [0.1, 0.2, 0.3]
    )
    passed = sorted(client.get_metric_history(first.run_id, "eval/pass_at_4"), key=lambda m: m.step)
    assert [m.value for m in passed] == [0.25, 0.5, 0.75]
    assert client.get_metric_history(first.run_id, "eval/bad") == []
    assert (
        run.data.params["runtime.seed"] == "1234"
        and run.data.params["runtime.loggers"] == "['jsonl', 'mlflow']"
    )
    assert run.data.params["models.policy.config.args.api_key"] == MASK


def test_trackers_are_imported_only_when_named(data, tmp_path):
    import subprocess
    import sys

    code = (
        "import sys; from chatgen.rlhf.config import load_config; "
        "from chatgen.rlhf.trackers import "
        f"start_trackers; from pathlib import Path; cfg = load_config({str(TINY)!r}, {data!r}); "
        f"start_trackers(cfg, Path({str(tmp_path)!r}), False); "
        "print(sorted(m for m in ('wandb', 'mlflow') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    assert out.stdout.strip() == "[]" and not (tmp_path / IDS_NAME).exists()


def test_a_tracker_failing_mid_run_is_reported_once_and_dropped(
    data, tmp_path, monkeypatch, caplog
):
    """Issue 50, finding 12: a tracker failing mid-run (a full disk, its store gone) stopped the run
    with the library's raw traceback."""
    import shutil

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    out = tmp_path / "run"
    trackers = start_trackers(config(data, out, "mlflow"), out, resume=False)
    logger = MetricsLogger(out, [], 3, tensorboard=False, trackers=trackers)
    logger.log(1, {"reward/mean": 0.1})
    shutil.rmtree(out / "mlruns")  # the store is gone under the run
    with caplog.at_level("WARNING", logger="chatgen.rlhf.metrics"):
        logger.log(2, {"reward/mean": 0.2})
        logger.log(3, {"reward/mean": 0.3})
        logger.close()
    failed = [
        r.getMessage() for r in caplog.records if "runtime.loggers: mlflow failed" in r.getMessage()
    ]
    assert len(failed) == 1 and "at episode 2" in failed[0] and logger.trackers == []
    episodes = [
        json.loads(line)["episode"] for line in (out / "metrics.jsonl").read_text().splitlines()
    ]
    assert episodes == [1, 2, 3]
