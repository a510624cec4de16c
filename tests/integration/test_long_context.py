"""An 8K-token-response GRPO episode of the tiny model on CPU, its peak memory against `chatgen
config`'s estimate (benchmarks/bench_long_context.py; docs/long_context.md). Minutes: slow.

    CHATGEN_RUN_SLOW=1 python -m pytest tests/integration/test_long_context.py
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_an_8k_response_episode_runs_within_the_estimate(tmp_path):
    if not (REPO / "outputs" / "tiny-llama-sft" / "config.json").is_file():
        pytest.skip("outputs/tiny-llama-sft is missing: run examples/prepare_tiny.sh")
    out = tmp_path / "long.json"
    subprocess.run(
        [
            sys.executable,
            "benchmarks/bench_long_context.py",
            "--output",
            str(out),
            "--lengths",
            "8192",
        ],
        cwd=REPO,
        check=True,
        timeout=3600,
    )
    (run,) = json.loads(out.read_text())["lengths"].values()
    assert run["episode"]["response/length"] == 8192  # every response L tokens: ignore_eos
    # training is where the s^2 attention lives; generation's KV cache is small
    assert run["phases"]["train"] > run["phases"]["generate"] + 1.0
    assert abs(run["error"]) <= 0.25, run
