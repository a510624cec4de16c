"""The recipe registries (chatgen.rlhf.recipe): a knob is a function found by the YAML value that names
it, a registered name or the path of the user's own function; a bad value is refused naming the key.

    pytest tests/unit/test_recipe_registry.py
"""

import textwrap

import pytest
import torch

from chatgen.config import ConfigError
from chatgen.rlhf import losses as L
from chatgen.rlhf import recipe
from chatgen.rlhf.recipe.registry import Registry

PLUGIN = """
import torch

from chatgen.rlhf.recipe import advantage, aggregation

CALLS = []


@advantage("unit_sign")
def sign(rewards, n, batch, algo):
    CALLS.append(("advantage", tuple(rewards.shape)))
    grouped = rewards.view(-1, n)
    return torch.sign(grouped - grouped.mean(dim=1, keepdim=True)).reshape(-1)


@aggregation("unit_half_sum")
def half_sum(per_token, mask, norm_length=None):
    CALLS.append(("aggregation", tuple(per_token.shape)))
    return (per_token * mask).sum() / 2
"""


def write(path, text):
    path.write_text(textwrap.dedent(text))
    return path


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """A module outside chatgen that registers an estimator and an aggregation; its registrations and
    the module are gone after the test (the registries are process-wide)."""
    import sys

    name = "unit_recipe_plugin"
    write(tmp_path / f"{name}.py", PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    registries = (recipe.advantage, recipe.aggregation)
    before = [dict(r.functions) for r in registries]
    yield name
    for registry, functions in zip(registries, before):
        registry.functions = functions
    sys.modules.pop(name, None)


@pytest.fixture
def main_yaml(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "train.jsonl", '{"prompt": "p", "answer": "a"}\n')
    write(tmp_path / "policy.yaml", "load: /models/tiny\nn: 4\n")
    write(tmp_path / "trainer.yaml", "load: /models/tiny\n")
    return write(
        tmp_path / "main.yaml",
        """
        runtime:
          sample_per_episode: 16
          data_path: train.jsonl
          algorithm: {name: grpo}
        models:
          policy: {backend: vllm, model_config_file: policy.yaml}
          policy_trainer: {backend: megatron, trainable: true, model_config_file: trainer.yaml}
          reward: {backend: python, model_class: "chatgen.rlhf.rewards:RuleReward"}
        """,
    )


def test_the_builtins_are_registered_under_their_yaml_names():
    def builtins(registry):  # another test's plugin may be registered in this process too
        return [n for n in registry.names() if registry.get(n).__module__.startswith("chatgen.")]

    assert builtins(recipe.advantage) == ["gdpo", "gigpo", "grpo", "opd", "reinforce_pp", "rloo"]
    assert recipe.ratio.get("token") is L.token_log_ratio
    assert recipe.aggregation.get("token_mean") is L.token_mean
    assert set(recipe.correction.names()) == {"token", "sequence", "geometric"}


def test_a_plugin_path_names_the_function_and_registers_its_module(plugin):
    fn = recipe.advantage.get(f"{plugin}:sign")
    assert fn.__name__ == "sign" and recipe.advantage.get("unit_sign") is fn  # imported: registered
    adv = fn(torch.tensor([1.0, 0.0, 0.0, 0.0]), 4, None, None)
    assert adv.tolist() == [1.0, -1.0, -1.0, -1.0]


def test_the_yaml_names_a_plugin_and_the_config_uses_it(main_yaml, plugin):
    from chatgen.rlhf.algorithms.grpo import step
    from chatgen.rlhf.config import load_config

    cfg = load_config(
        main_yaml,
        [
            f"runtime.algorithm.advantage_estimator={plugin}:sign",
            f"runtime.algorithm.loss_aggregation={plugin}:half_sum",
        ],
    )
    options = step.loss_options(cfg)
    assert options.aggregation.__name__ == "half_sum"
    assert options.aggregation(torch.ones(2, 3), torch.ones(2, 3)).item() == 3.0


@pytest.mark.parametrize(
    "key, value, expected",
    [
        ("advantage_estimator", "rlooo", "did you mean 'rloo'"),
        ("loss_aggregation", "token_sum", "valid names"),
        ("ratio_level", "no_such_module:fn", "no module 'no_such_module'"),
    ],
)
def test_an_unknown_value_is_refused_naming_the_key(main_yaml, key, value, expected):
    from chatgen.rlhf.config import load_config

    with pytest.raises(ConfigError) as raised:
        load_config(main_yaml, [f"runtime.algorithm.{key}={value}"])
    message = str(raised.value)
    assert key in message and expected in message


def test_a_registration_carries_its_rules(main_yaml):
    from chatgen.rlhf.config import load_config

    with pytest.raises(ConfigError, match="normalize_advantage_std"):
        load_config(
            main_yaml,
            [
                "runtime.algorithm.advantage_estimator=rloo",
                "runtime.algorithm.normalize_advantage_std=false",
            ],
        )


def test_two_functions_under_one_name_are_refused():
    registry = Registry("thing", "thing_key", "fn()")

    @registry("a")
    def first():
        pass

    registry("a")(first)  # the same function again (a module imported twice) is fine
    with pytest.raises(ValueError, match="registered twice"):

        @registry("a")
        def second():
            pass


@pytest.mark.parametrize(
    "items, key",
    [
        (["runtime.algorithm.policy_loss=cispo", "runtime.algorithm.dual_clip=3.0"], "dual_clip"),
        (
            ["runtime.algorithm.policy_loss=gmpo", "runtime.algorithm.ratio_level=sequence"],
            "ratio_level",
        ),
        (["runtime.algorithm.policy_loss=clipped_ppo"], "policy_loss"),
        (["runtime.algorithm.sapo_temperature_neg=0"], "sapo_temperature_neg"),
    ],
)
def test_a_policy_loss_is_refused_with_the_keys_it_cannot_take(main_yaml, items, key):
    from chatgen.rlhf.config import load_config

    with pytest.raises(ConfigError) as raised:
        load_config(main_yaml, items)
    assert f"runtime.algorithm.{key}" in str(raised.value)


def test_the_yaml_names_the_policy_loss(main_yaml):
    from chatgen.rlhf.algorithms.grpo import step
    from chatgen.rlhf.config import load_config

    default = step.loss_options(load_config(main_yaml, []))
    assert default.surrogate is L.ppo_clip
    cfg = load_config(
        main_yaml,
        ["runtime.algorithm.policy_loss=sapo", "runtime.algorithm.sapo_temperature_pos=0.5"],
    )
    options = step.loss_options(cfg)
    assert options.surrogate is recipe.policy_loss.get("sapo")
    assert options.sapo_temperature_pos == 0.5


def test_the_length_penalty_needs_solved_reward(main_yaml):
    from chatgen.rlhf.algorithms import grpo
    from chatgen.rlhf.config import load_config

    items = ["runtime.algorithm.length_penalty_coef=1.0"]
    assert not list(grpo.check(load_config(main_yaml, items)))
    cfg = load_config(main_yaml, [*items, "runtime.solved_reward=null"])
    (problem,) = grpo.check(cfg)
    assert (
        problem.startswith("runtime.algorithm.length_penalty_coef") and "solved_reward" in problem
    )
