"""A recipe knob added from outside chatgen trains (issue 46's done-when): a module of the test's own
registers an advantage estimator and a loss aggregation, the YAML names them by path, and a GRPO run
(real vLLM and megatron-core, the tiny Llama, in process) trains with both; no file of chatgen knows them.

    python -m pytest tests/integration/test_recipe_plugins.py
"""

import json
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]

PLUGIN = """
import torch

from chatgen.rlhf.recipe import advantage, aggregation

CALLS = []


@advantage("plugin_sign")
def sign(rewards, n, batch, algo):
    '''+1 / -1 for a sample above / below its group's mean reward, 0 at it.'''
    CALLS.append(("advantage", tuple(rewards.shape)))
    grouped = rewards.view(-1, n)
    return torch.sign(grouped - grouped.mean(dim=1, keepdim=True)).reshape(-1)


@aggregation("plugin_sum_over_rows")
def sum_over_rows(per_token, mask, norm_length=None):
    '''Every token's loss summed, over the number of rows.'''
    CALLS.append(("aggregation", tuple(per_token.shape)))
    return (per_token * mask).sum() / per_token.shape[0]
"""


def test_a_plugin_estimator_and_aggregation_train(tiny_llama_dir, data_dir, tmp_path, monkeypatch):
    from chatgen.rlhf import recipe
    from chatgen.rlhf.algorithms import grpo
    from chatgen.rlhf.config import load_config

    (tmp_path / "plugin").mkdir()
    (tmp_path / "plugin" / "my_recipe_plugin.py").write_text(textwrap.dedent(PLUGIN))
    monkeypatch.syspath_prepend(str(tmp_path / "plugin"))
    monkeypatch.chdir(REPO)
    out = tmp_path / "run"
    items = {
        "runtime.data_path": f"{data_dir}/train.jsonl",
        "runtime.eval_data_path": f"{data_dir}/eval.jsonl",
        "runtime.output_dir": str(out),
        "runtime.num_episode": 1,
        "runtime.sample_per_episode": 16,
        "runtime.train_micro_batch_size": 16,
        "runtime.train_global_batch_size": 16,
        "runtime.eval_episode_interval": 100,
        "runtime.launcher": "local",
        "runtime.algorithm.advantage_estimator": "my_recipe_plugin:sign",
        "runtime.algorithm.loss_aggregation": "my_recipe_plugin:sum_over_rows",
        "policy.load": tiny_llama_dir,
        "policy.n": 4,
        "policy_trainer.load": tiny_llama_dir,
    }
    registries = (recipe.advantage, recipe.aggregation)
    before = [dict(r.functions) for r in registries]
    try:
        cfg = load_config(REPO / "configs/grpo_tiny.yaml", [f"{k}={v}" for k, v in items.items()])
        grpo.train(cfg, log=lambda *_: None)
        calls = sys.modules["my_recipe_plugin"].CALLS
    finally:  # the registries are process-wide: later tests see chatgen's own only
        for registry, functions in zip(registries, before):
            registry.functions = functions
        sys.modules.pop("my_recipe_plugin", None)
    assert ("advantage", (16,)) in calls  # the estimator saw the episode's 16 rewards
    # the trainer's loss went through the plugin: one call per micro-batch, (b, T-1) token losses
    assert any(kind == "aggregation" and shape[0] == 16 for kind, shape in calls)
    metrics = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert metrics["episode"] == 1 and metrics["policy/grad_norm"] > 0
