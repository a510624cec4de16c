"""tool_math_smollm2 on the real engine: SmolLM2-135M-Instruct warm-started on whole-episode
demonstrations (`python -m chatgen.environments.tool_math --demonstrations-for`,
examples/sft_warm_start.py) writes a call that the run's server parses with vLLM's hermes parser into
`tool_calls` for the official `openai` client, and after the sandboxed tool's output answers the
number: a whole tool_math episode scores. Slow: a SmolLM2 warm start on CPU takes minutes. The RL
rise itself is measured by a run of the recipe (docs/agents.md).

    CHATGEN_RUN_SLOW=1 .venv/bin/python -m pytest tests/integration/test_tool_math_smollm2.py
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]


def warm_start(model: Path, work: Path, steps: int = 12) -> Path:
    """SmolLM2 after `steps` SFT steps on demonstrations of episodes through the tool (all of them,
    not the recipe's 18.5%: here greedy must take the tool's path)."""
    from chatgen import tasks
    from chatgen.environments import tool_math

    tasks.write_task_data(str(work), task="arithmetic", n_train=400, n_eval=8)
    tool_math.demonstrations(model, work, n=400, call_fraction=1.0)
    out = work / "sft"
    subprocess.run(
        [sys.executable, str(REPO / "examples/sft_warm_start.py"), "--load", str(model)]
        + ["--data", str(work / tool_math.SFT_FILE), "--output", str(out), "--steps", str(steps)]
        + ["--batch-size", "16", "--lr", "2e-5"],
        check=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    return out


def test_warm_started_smollm2_calls_the_python_tool_and_answers_from_its_output(
    smollm2_dir, tmp_path
):
    import openai

    from chatgen import environments
    from chatgen.environments.tool_math import SYSTEM
    from chatgen.environments.tools import PYTHON_TOOL
    from chatgen.generation.vllm.module import VLLMModule
    from chatgen.serving.embedded import EmbeddedServer

    model = warm_start(smollm2_dir, tmp_path)
    module = VLLMModule(
        dict(load=str(model), kv_cache_memory_bytes=128 << 20, enforce_eager=True, seq_length=512)
    ).start()
    server = None
    try:
        server = EmbeddedServer(module, api_key="k", model_name="p", tool_call_parser="hermes")
        client = openai.OpenAI(base_url=server.url, api_key="k")
        reply = client.chat.completions.create(
            model="p",
            messages=[
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": "What is 23 + 19? Reply with only the result."},
            ],
            tools=[PYTHON_TOOL.schema],
            max_tokens=64,
            temperature=0,
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls", choice.message.content
        (call,) = choice.message.tool_calls
        assert call.function.name == "python"
        code = json.loads(call.function.arguments)["code"]
        assert "23" in code and "19" in code  # the question's numbers, to be computed by the tool

        # whole episodes of the environment through the server: call, the sandbox's output, the
        # number (the second turn the warm start of first turns alone never learned)
        runner = environments.build("tool_math", {}, server.url, "k", "p", max_turns=3, parse=True)
        for a, b in ((31, 12), (9, 17), (40, 25)):
            question = f"What is {a} + {b}? Reply with only the result, as a number."
            episode = runner.episode({"prompt": question, "answer": str(a + b)}, 0.0, 64)
            assert episode.metrics.get("tool_calls") == 1.0, episode.turns
            assert episode.reward == 1.0 and not episode.truncated, episode.turns
    finally:
        if server is not None:
            server.close()
        module.shutdown()
