"""Unit tests of chatgen.config: includes, ${VAR}, overrides, typed validation, shipped YAMLs.

/work/main/.venv/bin/python -m pytest tests/unit/test_config.py -q
"""

import dataclasses
import functools
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from chatgen import cli
from chatgen.cli.config import key_reference, sections
from chatgen.compat.chatlearn import dialect, megatron_lm_keys, model_args
from chatgen.config import ConfigError, load_model_config, parse_overrides
from chatgen.generation.vllm.config import VLLMConfig
from chatgen.rlhf.config import (
    format_config,
    load_config,
    resolve_schema,
    save_resolved,
    schema_marker,
    to_dict,
)
from chatgen.rlhf.schema import ModelEntry, RuntimeConfig
from chatgen.training.config import MegatronConfig

REPO = Path(__file__).resolve().parents[2]


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text).lstrip())
    return path


def errors_of(fn, *args) -> list[str]:
    with pytest.raises(ConfigError) as info:
        fn(*args)
    assert str(info.value).startswith(f"{len(info.value.errors)} config error(s):")
    return info.value.errors


@pytest.fixture
def main_yaml(tmp_path, monkeypatch):
    """A main YAML with a vLLM policy, a Megatron trainer and a python reward; cwd = tmp_path."""
    monkeypatch.chdir(tmp_path)
    write(
        tmp_path / "models" / "policy.yaml",
        """
        load: /models/tiny
        temperature: 0.7
        n: 4
    """,
    )
    write(
        tmp_path / "models" / "trainer.yaml",
        """
        load: /models/tiny
        lr: 1e-5
    """,
    )
    return write(
        tmp_path / "main.yaml",
        """
        runtime:
          num_episode: 2
          sample_per_episode: 16
          train_global_batch_size: 8
          colocation: [[policy, policy_trainer]]
        models:
          policy: {backend: vllm, model_config_file: models/policy.yaml}
          policy_trainer: {backend: megatron, trainable: true, model_config_file: models/trainer.yaml}
          reward: {backend: python, model_class: chatgen.module:Module, config: {answer_key: answer}}
    """,
    )


# --- loading and layering ------------------------------------------------------------------------------------


def test_main_config_loads_typed_sections(main_yaml):
    cfg = load_config(main_yaml)
    assert cfg.runtime.num_episode == 2 and cfg.runtime.colocation == [["policy", "policy_trainer"]]
    policy = cfg.models["policy"]
    assert isinstance(policy.config, VLLMConfig)
    assert (policy.config.temperature, policy.config.n, policy.config.top_p) == (0.7, 4, 1.0)
    trainer = cfg.models["policy_trainer"].config
    # `1e-5` is a float, not YAML 1.1's str
    assert isinstance(trainer, MegatronConfig) and trainer.lr == 1e-5
    assert cfg.models["reward"].config == {"answer_key": "answer"}
    assert {Path(f).name for f in cfg.files} == {"main.yaml", "policy.yaml", "trainer.yaml"}


def test_dials_left_at_none_are_derived_from_runtime(main_yaml):
    cfg = load_config(main_yaml)
    trainer = cfg.models["policy_trainer"].config
    assert (trainer.micro_batch_size, trainer.global_batch_size) == (1, 8)
    assert cfg.models["policy"].config.generation_batch_size == cfg.runtime.generation_batch_size
    cfg = load_config(main_yaml, ["runtime.train_global_batch_size=null"])
    assert (
        cfg.runtime.train_global_batch_size
        == 16
        == cfg.models["policy_trainer"].config.global_batch_size
    )


def test_trainer_batch_size_disagreeing_with_runtime_is_an_error(main_yaml):
    (errors,) = errors_of(load_config, main_yaml, ["policy_trainer.global_batch_size=4"])
    assert "global_batch_size: 4 disagrees with runtime.train_global_batch_size=8" in errors


def test_includes_are_defaults_nested_and_relative_to_the_including_file(tmp_path):
    write(tmp_path / "common" / "deep.yaml", "top_k: 5\ntemperature: 0.1\n")
    write(
        tmp_path / "common" / "base.yaml",
        "includes: deep.yaml\ntemperature: 0.2\ntop_p: 0.5\nn: 2\n",
    )
    write(tmp_path / "common" / "other.yaml", "n: 3\n")
    path = write(
        tmp_path / "run" / "policy.yaml",
        """
        includes: [../common/base.yaml, ../common/other.yaml]
        top_p: 0.9
    """,
    )
    cfg = load_model_config(path, VLLMConfig)
    assert cfg.top_k == 5  # from the include of an include
    assert cfg.temperature == 0.2  # an include's include never overrides the include
    assert cfg.top_p == 0.9  # the including file wins over its include
    assert cfg.n == 3  # later includes win over earlier ones


def test_includes_deep_merge_mappings(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(
        tmp_path / "base.yaml",
        """
        runtime: {num_episode: 5, seed: 1, algorithm: {kl_coef: 0.1, clip_eps: 0.3}}
        models: {policy: {backend: vllm}}
    """,
    )
    cfg = load_config(
        write(
            tmp_path / "main.yaml",
            """
        includes: base.yaml
        runtime: {seed: 2, algorithm: {kl_coef: 0.0}}
    """,
        )
    )
    assert (cfg.runtime.num_episode, cfg.runtime.seed) == (5, 2)
    assert (cfg.runtime.algorithm.kl_coef, cfg.runtime.algorithm.clip_eps) == (0.0, 0.3)


def test_include_cycle_is_detected(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "a.yaml", "includes: b.yaml\nn: 1\n")
    write(tmp_path / "b.yaml", "includes: [a.yaml]\n")
    (error,) = errors_of(load_model_config, tmp_path / "a.yaml", VLLMConfig)
    assert (
        error
        == "b.yaml: includes: include cycle a.yaml -> b.yaml -> a.yaml; remove one of these includes"
    )


def test_missing_include_and_model_file_name_the_referrer(main_yaml, tmp_path):
    write(tmp_path / "models" / "policy.yaml", "includes: nope.yaml\n")
    main_yaml.write_text(main_yaml.read_text().replace("models/trainer.yaml", "models/trainr.yaml"))
    errors = errors_of(load_config, main_yaml)
    assert len(errors) == 2
    assert errors[0].startswith("models/policy.yaml: includes: cannot read models/nope.yaml")
    assert errors[1].startswith(
        "main.yaml: models.policy_trainer.model_config_file: cannot read models/trainr.yaml"
    )


def test_missing_main_yaml_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (error,) = errors_of(load_config, "nope.yaml", ["runtime.seed=1"])
    assert error.startswith(
        "nope.yaml: cannot read nope.yaml (No such file or directory); fix the path"
    )


def test_diamond_includes_are_not_a_cycle_and_includes_take_env_vars(tmp_path, monkeypatch):
    monkeypatch.setenv("CG_BASE", "base")
    monkeypatch.delenv("CG_NOPE", raising=False)
    write(tmp_path / "base.yaml", "top_k: 3\n")
    write(tmp_path / "a.yaml", "includes: ${CG_BASE}.yaml\nn: 2\n")
    write(tmp_path / "b.yaml", "includes: base.yaml\nn: 5\n")
    cfg = load_model_config(write(tmp_path / "p.yaml", "includes: [a.yaml, b.yaml]\n"), VLLMConfig)
    assert (cfg.top_k, cfg.n) == (3, 5)
    monkeypatch.chdir(tmp_path)
    (error,) = errors_of(
        load_model_config, write(tmp_path / "q.yaml", "includes: ${CG_NOPE}.yaml\n"), VLLMConfig
    )
    assert error.startswith("q.yaml: includes: environment variable CG_NOPE is not set")


def test_yaml_syntax_error_names_file_and_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "bad.yaml", "n: 1\ntemperature: [0.5\n")
    (error,) = errors_of(load_model_config, "bad.yaml", VLLMConfig)
    assert re.match(r"bad\.yaml: line \d+: YAML syntax error: .+; fix the YAML syntax", error)


# --- ${VAR:default} ------------------------------------------------------------------------------------------


def test_env_whole_values_are_typed_and_inner_ones_stay_strings(tmp_path, monkeypatch):
    monkeypatch.delenv("CG_N", raising=False)
    monkeypatch.delenv("CG_DIR", raising=False)
    monkeypatch.delenv("CG_L", raising=False)
    monkeypatch.setenv("CG_FLAG", "true")
    path = write(
        tmp_path / "p.yaml",
        """
        n: ${CG_N:4}
        temperature: ${CG_T:0.5}
        ignore_eos: ${CG_FLAG:false}
        load: ${CG_DIR:/tmp/models}/tiny-${CG_N:4}
        tokenizer: ${CG_EMPTY:}
    """,
    )
    cfg = load_model_config(path, VLLMConfig)
    assert (cfg.n, cfg.temperature, cfg.ignore_eos) == (4, 0.5, True)
    assert cfg.load == "/tmp/models/tiny-4" and cfg.tokenizer is None
    monkeypatch.setenv("CG_N", "8")
    assert load_model_config(path, VLLMConfig).n == 8
    monkeypatch.setenv("CG_L", "[1, 2]")
    assert load_model_config(write(tmp_path / "r.yaml", "x: ${CG_L:[3]}\n"), dict) == {"x": [1, 2]}


def test_unset_env_var_without_default_is_null_with_one_warning(tmp_path, monkeypatch, caplog):
    """As ChatLearn's parse_value: a whole `${VAR}` with VAR unset is null, and one warning names it."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CG_TOKENIZER_DIR", raising=False)
    write(tmp_path / "p.yaml", "load: /m\ntokenizer: ${CG_TOKENIZER_DIR}\n")
    with caplog.at_level("WARNING", logger="chatgen.config.loader"):
        assert load_model_config("p.yaml", VLLMConfig).tokenizer is None
    assert [r.getMessage() for r in caplog.records] == [
        "p.yaml: tokenizer: environment variable CG_TOKENIZER_DIR is not set and has no default: read as null "
        "(export CG_TOKENIZER_DIR=... or write ${CG_TOKENIZER_DIR:default})"
    ]


def test_unset_env_var_inside_a_string_is_an_error(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CG_MODEL_DIR", raising=False)
    write(tmp_path / "p.yaml", "load: ${CG_MODEL_DIR}/x\n")
    (error,) = errors_of(load_model_config, "p.yaml", VLLMConfig)
    assert error == (
        "p.yaml: load: environment variable CG_MODEL_DIR is not set and has no default, and a variable "
        "inside a longer string cannot be null; export CG_MODEL_DIR=... or write ${CG_MODEL_DIR:default}"
    )


def test_env_none_is_null_as_in_chatlearn_and_true_false_are_bools(tmp_path, monkeypatch):
    for name in ("CG_WINDOW", "CG_LOGPROBS", "CG_EOS", "CG_BEAM"):
        monkeypatch.delenv(name, raising=False)
    path = write(
        tmp_path / "p.yaml",
        """
        sliding_window: ${CG_WINDOW:None}
        prompt_logprobs: ${CG_LOGPROBS:None}
        ignore_eos: ${CG_EOS:True}
        use_beam_search: ${CG_BEAM:False}
        stop_token_list: None
    """,
    )
    cfg = load_model_config(path, VLLMConfig)
    assert (cfg.sliding_window, cfg.prompt_logprobs, cfg.ignore_eos, cfg.use_beam_search) == (
        None,
        None,
        True,
        False,
    )
    # a plain YAML None is text, in ChatLearn too: only `${...}` values
    assert cfg.stop_token_list == "None"
    monkeypatch.setenv("CG_LOGPROBS", "None")  # the environment's text is typed like a default's
    monkeypatch.setenv("CG_WINDOW", "4096")
    cfg = load_model_config(path, VLLMConfig, ["use_beam_search=false", "sliding_window=null"])
    assert (cfg.prompt_logprobs, cfg.sliding_window) == (None, None)
    # a refused key keeps its refusal when it is set
    (error,) = errors_of(load_model_config, path, VLLMConfig)
    assert "sliding_window: not supported" in error


def test_env_var_only_needed_where_its_value_survives(tmp_path, monkeypatch):
    monkeypatch.delenv("CG_MODEL_DIR", raising=False)
    write(tmp_path / "base.yaml", "load: ${CG_MODEL_DIR}\n")
    path = write(tmp_path / "p.yaml", "includes: base.yaml\nload: /models/x\n")
    assert load_model_config(path, VLLMConfig).load == "/models/x"


# --- overrides -----------------------------------------------------------------------------------------------


def test_parse_overrides_types_values_like_yaml():
    assert parse_overrides(
        ["a.b=1", "a.c=1e-5", "x=[1,2]", "f=true", "s=hello world", "z=null", "e=", "u=a=b"]
    ) == {
        "a": {"b": 1, "c": 1e-5},
        "x": [1, 2],
        "f": True,
        "s": "hello world",
        "z": None,
        "e": None,
        "u": "a=b",
    }
    (error,) = errors_of(parse_overrides, ["no_equals_sign"])
    assert "'no_equals_sign': not a key=value override" in error


def test_overrides_win_over_files_and_route_to_the_model(main_yaml):
    cfg = load_config(
        main_yaml,
        [
            "runtime.num_episode=3",
            "runtime.algorithm.kl_coef=0.05",
            "models.policy.temperature=0.5",
            "policy.top_p=0.8",
            "models.policy.num_gpu=2",
            "reward.answer_key=label",
        ],
    )
    assert cfg.runtime.num_episode == 3 and cfg.runtime.algorithm.kl_coef == 0.05
    assert (cfg.models["policy"].config.temperature, cfg.models["policy"].config.top_p) == (
        0.5,
        0.8,
    )
    assert cfg.models["policy"].num_gpu == 2  # an entry key stays on the entry
    assert cfg.models["reward"].config == {"answer_key": "label"}
    # the files are untouched
    assert load_config(main_yaml).models["policy"].config.temperature == 0.7
    # a GRPO model this YAML does not have
    (error,) = errors_of(load_config, main_yaml, ["reference.lr=1"])
    assert error == (
        "command line: reference: no model 'reference' under models; configured: policy, "
        "policy_trainer, reward"
    )


def test_model_config_overrides_and_no_file(tmp_path):
    cfg = load_model_config(
        None, VLLMConfig, ["load=/m", "temperature=0", "stop_token_list=</a>;<b>"]
    )
    assert (cfg.load, cfg.temperature, cfg.stop_token_list) == ("/m", 0.0, "</a>;<b>")
    (error,) = errors_of(load_model_config, None, VLLMConfig, ["temprature=0"])
    assert error == "command line: temprature: unknown key; did you mean 'temperature'?"
    assert load_model_config(None, VLLMConfig, {"load": "/m", "n": 4}) == VLLMConfig(load="/m", n=4)
    (error,) = errors_of(load_model_config, None, VLLMConfig, {"top_p": 2.0})
    assert error == "overrides: top_p: must be in (0, 1], got 2.0; use 1.0 to turn top-p off"


# --- args: the user's own keys -------------------------------------------------------------------------------


def test_args_survive_includes_overrides_and_the_resolved_config(main_yaml, tmp_path):
    write(
        tmp_path / "models" / "base.yaml",
        "args: {prompt_key: text, shuffle: {seed: 1, epochs: 2}}\n",
    )
    policy = write(
        tmp_path / "models" / "policy.yaml",
        """
        includes: base.yaml
        load: /m
        args: {shuffle: {epochs: 3}, extra: [1, 2]}
    """,
    )
    cfg = load_model_config(policy, VLLMConfig, ["args.prompt_key=question"])
    assert cfg.args == {
        "prompt_key": "question",
        "shuffle": {"seed": 1, "epochs": 3},
        "extra": [1, 2],
    }
    cfg = load_config(main_yaml, ["policy.args.prompt_key=q", "models.policy_trainer.args.note=x"])
    assert cfg.models["policy"].config.args == {
        "prompt_key": "q",
        "shuffle": {"seed": 1, "epochs": 3},
        "extra": [1, 2],
    }
    assert cfg.models["policy_trainer"].config.args == {"note": "x"}
    again = load_config(save_resolved(cfg, tmp_path / "run"))
    assert again.models["policy"].config.args == cfg.models["policy"].config.args


def test_args_may_not_repeat_a_chatgen_key_and_must_have_string_keys():
    (error,) = errors_of(
        load_model_config, None, VLLMConfig, {"args": {"seq_length": 8, "mine": 1}}
    )
    assert error == (
        "overrides: args: 'seq_length' is a chatgen key of this model; set it at the top level of the "
        "file, or give your key another name"
    )
    (error,) = errors_of(load_model_config, None, MegatronConfig, {"args": {1: "x"}})
    assert (
        error
        == "overrides: args: expected dict[str, Any], got dict {1: 'x'}; set it to dict[str, Any]"
    )


def test_model_args_is_the_typed_keys_and_the_user_keys_in_one_flat_copy():
    cfg = load_model_config(
        None, VLLMConfig, {"load": "/m", "args": {"prompt_key": "q", "nested": {"a": [1]}}}
    )
    flat = model_args(cfg)
    assert set(flat) == {f.name for f in dataclasses.fields(VLLMConfig)} - {"args"} | {
        "prompt_key",
        "nested",
    }
    assert (flat["load"], flat["temperature"], flat["prompt_key"]) == ("/m", 1.0, "q")
    flat["nested"]["a"].append(2)
    assert cfg.args["nested"] == {"a": [1]}
    with pytest.raises(ConfigError, match="args: 'n' is a chatgen key of this model"):
        model_args(VLLMConfig(args={"n": 2}))  # built in code, past the loader


# --- validation ----------------------------------------------------------------------------------------------


def test_misspelled_key_names_file_key_and_closest(main_yaml, tmp_path):
    write(tmp_path / "models" / "policy.yaml", "load: /m\ntempreature: 0.7\n")
    (error,) = errors_of(load_config, main_yaml)
    assert error == "models/policy.yaml: tempreature: unknown key; did you mean 'temperature'?"


def test_every_error_is_collected_into_one_message(main_yaml, tmp_path):
    write(
        tmp_path / "models" / "policy.yaml",
        "tempreature: 0.7\ntop_p: 1.5\nlogprobs_mode: proccessed\n",
    )
    write(tmp_path / "models" / "trainer.yaml", "lr: fast\n")
    main_yaml.write_text(main_yaml.read_text().replace("num_episode", "num_episodes"))
    errors = errors_of(load_config, main_yaml, ["runtime.seed=abc"])
    assert errors == [
        "main.yaml: runtime.num_episodes: unknown key; did you mean 'num_episode'?",
        "command line: runtime.seed: expected int, got str 'abc'; set it to int",
        "models/policy.yaml: tempreature: unknown key; did you mean 'temperature'?",
        "models/policy.yaml: logprobs_mode: 'proccessed' is not one of 'raw', 'processed'; use one of those "
        "(did you mean 'processed'?)",
        # range checks run even though other keys of the same file failed: nothing needs a second round
        "models/policy.yaml: top_p: must be in (0, 1], got 1.5; use 1.0 to turn top-p off",
        "models/trainer.yaml: lr: expected float, got str 'fast'; set it to float",
    ]


def test_unknown_keys_without_a_close_match_list_the_valid_keys_once_per_file(
    tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "base.yaml", "num_layers: 2\nhidden_size: 8\nmy_key: 1\n")
    write(tmp_path / "p.yaml", "includes: base.yaml\ntempreature: 0.5\nreward_name: r\nstride: 3\n")
    valid = ", ".join(sorted(f.name for f in dataclasses.fields(VLLMConfig)))
    assert errors_of(
        functools.partial(load_model_config, dialect=dialect("chatgen")), "p.yaml", VLLMConfig
    ) == [
        # first: the file reads as a ChatLearn per-model YAML (Megatron-LM arguments), and how to load it
        "p.yaml: 2 key(s) are Megatron-LM arguments (hidden_size, num_layers): a ChatLearn per-model YAML; "
        "load it with `config_dialect: chatlearn` (the model entry's key, or --config-dialect chatlearn), "
        "docs/migrating_from_chatlearn.md",
        "base.yaml: num_layers: unknown key (a Megatron-LM argument)",
        "base.yaml: hidden_size: unknown key (a Megatron-LM argument)",
        "base.yaml: my_key: unknown key",
        "p.yaml: tempreature: unknown key; did you mean 'temperature'?",
        "p.yaml: reward_name: unknown key",
        "p.yaml: stride: unknown key",
        f"base.yaml: valid keys: {valid}; put your own keys under `args:` (a ChatLearn YAML with Megatron-LM keys "
        "loads with `config_dialect: chatlearn`, docs/migrating_from_chatlearn.md)",
        f"p.yaml: valid keys: {valid}; put your own keys under `args:`",
    ]
    write(tmp_path / "m.yaml", "runtime: {workers: 1, sed: 2}\nmodels: {policy: {backend: vllm}}\n")
    runtime_keys = ", ".join(sorted(f.name for f in dataclasses.fields(RuntimeConfig)))
    assert errors_of(load_config, "m.yaml") == [
        "m.yaml: runtime.workers: unknown key",
        "m.yaml: runtime.sed: unknown key; did you mean 'seed'?",
        f"m.yaml: valid keys of runtime: {runtime_keys}",
    ]


def test_range_checks_name_key_and_fix(tmp_path):
    path = write(
        tmp_path / "p.yaml",
        "temperature: -1\ntop_p: 0\ntop_k: 0\nseq_length: 2048\nmax_new_tokens: 4096\nmax_paddings: 8\n",
    )
    errors = errors_of(load_model_config, path, VLLMConfig)
    assert [e.split(": ")[1] for e in errors] == [
        "temperature",
        "top_p",
        "top_k",
        "max_new_tokens",
        "max_paddings",
    ]
    assert "use 0 for greedy decoding" in errors[0] and "use 1.0 to turn top-p off" in errors[1]
    assert "raise seq_length or lower max_new_tokens" in errors[3]


def test_quoted_number_says_remove_the_quotes(tmp_path):
    (error,) = errors_of(
        load_model_config, write(tmp_path / "p.yaml", "temperature: '0.5'\n"), VLLMConfig
    )
    assert error.endswith("expected float, got str '0.5'; remove the quotes")


def test_ints_pass_as_floats_but_bools_never_as_numbers(tmp_path):
    assert load_model_config(None, VLLMConfig, ["temperature=1"]).temperature == 1.0
    (error,) = errors_of(load_model_config, None, VLLMConfig, ["n=true"])
    assert error == "command line: n: expected int, got bool True; set it to int"


def test_unknown_model_name_names_closest(main_yaml):
    main_yaml.write_text(main_yaml.read_text().replace("  reward:", "  rewrd:"))
    (error,) = errors_of(load_config, main_yaml)
    assert error == "main.yaml: models.rewrd: not a model of grpo; did you mean 'reward'?"


def test_model_entry_checks(main_yaml):
    errors = errors_of(
        load_config,
        main_yaml,
        [
            "models.policy.trainable=true",
            "models.reward.backend=pytorch",
            "runtime.colocation=[[policy, polcy]]",
        ],
    )
    assert errors[0] == (
        "command line: models.policy.trainable: a vllm model cannot be trained; "
        "set trainable: false or backend: megatron"
    )
    assert errors[1].startswith(
        "command line: models.reward.backend: unknown generation backend 'pytorch'; chatgen ships "
    ) and errors[1].endswith("or megatron / fsdp (a trainer), python (your class, model_class)")
    assert errors[2] == (
        "command line: runtime.colocation: 'polcy' is not a configured model; "
        "did you mean 'policy'?"
    )


def test_per_model_key_in_the_entry_points_to_where_it_belongs(main_yaml):
    main_yaml.write_text(
        main_yaml.read_text().replace("backend: vllm,", "backend: vllm, temperature: 0.1,")
    )
    (error,) = errors_of(load_config, main_yaml)
    assert error == (
        "main.yaml: models.policy.temperature: a per-model key, not a model entry key; "
        "move it into the model_config_file or under models.policy.config"
    )


def test_python_model_keys_are_free_but_entry_typos_are_caught(main_yaml):
    assert load_config(main_yaml, ["reward.anything=1"]).models["reward"].config["anything"] == 1
    (error,) = errors_of(load_config, main_yaml, ["models.reward.num_gpuu=1"])
    assert error.startswith(
        "command line: models.reward.num_gpuu: unknown model entry key; did you mean 'num_gpu'?"
    )


def test_required_key_and_missing_models(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    errors = errors_of(
        load_config, write(tmp_path / "m.yaml", "runtime: {}\nmodels: {policy: {num_gpu: 1}}\n")
    )
    assert errors == [
        "m.yaml: models.policy.backend: required key is missing; add `backend: ...` "
        f"({dataclasses.fields(ModelEntry)[0].metadata['doc']})"
    ]
    (error,) = errors_of(load_config, write(tmp_path / "e.yaml", "runtime: {num_episode: 1}\n"))
    assert error.startswith("e.yaml: models: no models; add e.g. `models:")


def test_schema_by_name_class_or_import_path(tmp_path):
    path = write(tmp_path / "t.yaml", "tensor_model_parallel_size: 2\n")
    assert load_model_config(path, MegatronConfig) == load_model_config(path, MegatronConfig)
    spec = load_model_config(path, MegatronConfig)
    assert spec.tensor_model_parallel_size == 2


def test_entry_keys_and_per_model_keys_are_disjoint():
    """`models.<name>.<key>=` overrides route by name: a key in both would be ambiguous."""
    entry = {f.name for f in dataclasses.fields(ModelEntry)}
    for schema in (VLLMConfig, MegatronConfig):
        assert not entry & {f.name for f in dataclasses.fields(schema)}, schema.__name__


# --- output: log, save, reload -------------------------------------------------------------------------------


def test_save_resolved_reloads_to_the_same_config(main_yaml, tmp_path, monkeypatch):
    monkeypatch.setenv("CG_TEMP", "0.25")
    main_yaml.write_text(
        main_yaml.read_text().replace("num_episode: 2", "num_episode: ${CG_EPISODES:6}")
    )
    write(tmp_path / "models" / "policy.yaml", "includes: base.yaml\ntemperature: ${CG_TEMP}\n")
    write(tmp_path / "models" / "base.yaml", "load: /m\ntop_k: 7\n")
    cfg = load_config(main_yaml, ["policy.n=3"])
    out = save_resolved(cfg, tmp_path / "run")
    text = Path(out).read_text()
    assert text.startswith(
        "# chatgen config run/resolved_config.yaml\n# resolved from: main.yaml policy.n=3\n"
    )
    monkeypatch.delenv("CG_TEMP")
    again = load_config(out)
    assert to_dict(again) == to_dict(cfg) | {
        "models": {
            name: {**entry, "model_config_file": None}
            for name, entry in to_dict(cfg)["models"].items()
        }
    }
    assert (again.runtime.num_episode, again.models["policy"].config.temperature) == (6, 0.25)
    assert (again.models["policy"].config.top_k, again.models["policy"].config.n) == (7, 3)


@pytest.mark.faults
def test_secrets_stay_out_of_the_resolved_config_and_the_printout(
    main_yaml, tmp_path, monkeypatch, capsys
):
    """Issue 28, findings 5 and 10: a value interpolated from ${VAR} was written in plain text to
    resolved_config.yaml (0644) and printed by `chatgen config`; the file followed a planted
    link."""
    import os

    monkeypatch.setenv("JUDGE_API_KEY", "sk-live-0123456789")
    with (tmp_path / "models" / "policy.yaml").open("a") as f:
        f.write(
            "args: {judge: {api_key: '${JUDGE_API_KEY}'}, header: 'Bearer ${JUDGE_API_KEY}', "
            "hf_token: hf-literal-123}\n"
        )
    cfg = load_config(main_yaml, ["policy.args.password=pw-override-1"])
    assert cfg.models["policy"].config.args["header"] == "Bearer sk-live-0123456789"
    out = Path(save_resolved(cfg, tmp_path / "run"))
    write(main_yaml.parent / "train.jsonl", '{"prompt": "p", "answer": "a"}\n')
    ready = [
        "runtime.data_path=train.jsonl",
        "policy.temperature=1.0",
        "policy.args.password=pw-override-1",
    ]
    assert cli.main(["config", str(main_yaml), *ready]) == 0, capsys.readouterr()
    for shown in (out.read_text(), format_config(cfg), capsys.readouterr().out):
        for secret in ("sk-live-0123456789", "hf-literal-123", "pw-override-1"):
            assert secret not in shown
        assert "Bearer ${JUDGE_API_KEY}" in shown
    assert (out.stat().st_mode & 0o777, out.parent.stat().st_mode & 0o777) == (0o600, 0o700)
    again = load_config(out)  # the environment gives the value back
    assert again.models["policy"].config.args["header"] == "Bearer sk-live-0123456789"
    victim = write(tmp_path / "victim.txt", "keep")
    (tmp_path / "planted").mkdir()
    os.symlink(victim, tmp_path / "planted" / "resolved_config.yaml")
    with pytest.raises(OSError, match="symbolic link"):
        save_resolved(cfg, tmp_path / "planted")
    assert victim.read_text() == "keep"


def test_format_config_is_yaml_of_the_resolved_values(main_yaml):
    cfg = load_config(main_yaml, ["runtime.seed=9"])
    text = format_config(cfg)
    assert text.startswith("# resolved from main.yaml runtime.seed=9\n")
    assert yaml.safe_load(text) == to_dict(cfg)


def test_cli_prints_resolved_config_or_every_error(main_yaml, capsys):
    write(main_yaml.parent / "train.jsonl", '{"prompt": "p", "answer": "a"}\n')
    ready = ["runtime.data_path=train.jsonl", "policy.temperature=1.0"]
    assert cli.main(["config", str(main_yaml), *ready, "policy.max_new_tokens=7"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["models"]["policy"]["config"]["max_new_tokens"] == 7
    # absolute: actors run elsewhere
    assert printed["runtime"]["data_path"] == str(main_yaml.parent / "train.jsonl")
    assert cli.main(["config", str(main_yaml), "policy.temprature=0.1", "runtime.sed=1"]) == 2
    assert "2 config error(s)" in capsys.readouterr().err
    # the checks of a whole run too, the ones `chatgen train` makes before it starts anything
    assert cli.main(["config", str(main_yaml), "policy.min_p=0.1"]) == 2
    err = capsys.readouterr().err
    assert "models.policy.min_p: 0.1" in err and "runtime.data_path: required" in err
    assert cli.main(["config", "--schema", "vllm", "models/policy.yaml", "n=2"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["n"] == 2


# --- docs and shipped YAMLs ----------------------------------------------------------------------------------


def test_every_key_has_a_doc_and_is_in_docs_configuration_md():
    docs = (REPO / "docs" / "configuration.md").read_text()
    reference = key_reference()
    for _, _, cls in sections():
        for f in dataclasses.fields(cls):
            assert f.metadata.get("doc"), (
                f"{cls.__name__}.{f.name} has no doc: write `opt(default, \"doc\")`"
            )
            assert f"| `{f.name}` |" in reference
    # The tables in the docs are exactly what the code says (defaults, types, docs), not merely the names.
    assert reference.strip() in docs, (
        "docs/configuration.md's key reference differs from the schema: replace it "
        "with the output of `chatgen config --reference`"
    )


SHIPPED = sorted(
    p
    for d in ("configs", "examples")
    for p in (REPO / d).rglob("*")
    if p.suffix in (".yaml", ".yml")
)


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO))


def _is_main(path: Path) -> bool:
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError:
        return False
    return isinstance(data, dict) and bool({"runtime", "models"} & set(data))


MAINS = [p for p in SHIPPED if _is_main(p)]


@pytest.mark.parametrize("path", MAINS, ids=_rel)
def test_shipped_main_config_loads(path, monkeypatch):
    monkeypatch.chdir(REPO)
    load_config(path)


_read_by_mains = {}


def _files_read_by_mains():
    if not _read_by_mains:
        files, failed = set(), []
        for main in MAINS:
            try:
                files.update(Path(f) for f in load_config(main).files)
            except ConfigError:
                failed.append(_rel(main))
        _read_by_mains.update(files=files, failed=failed)
    return _read_by_mains["files"], _read_by_mains["failed"]


@pytest.mark.parametrize("path", [p for p in SHIPPED if p not in MAINS], ids=_rel)
def test_shipped_model_yaml_is_validated(path, monkeypatch):
    """A YAML that is not a main config is read by one, or names its schema in its first 5 lines:
    `# chatgen-schema: vllm` (megatron, python, package.module:DataclassName) or `# chatgen-schema: none <why>`.
    """
    monkeypatch.chdir(REPO)
    read, failed = _files_read_by_mains()
    if path in read:
        return  # validated by test_shipped_main_config_loads with its model's backend
    marker = schema_marker(path)
    if marker is None:
        if failed:
            pytest.skip(f"main YAML(s) {failed} do not load; fix them first")
        pytest.fail(
            f"{_rel(path)}: no main YAML under configs/ or examples/ reads it and it has no schema marker; "
            "add `# chatgen-schema: vllm` (or megatron, python, package.module:DataclassName, or "
            "`none <reason>`) within its first 5 lines"
        )
    schema, reason = marker
    if schema == "none":
        pytest.skip(f"{_rel(path)}: not a chatgen config ({reason or 'no reason given'})")
    load_model_config(path, resolve_schema(schema))


def test_importing_the_config_system_stays_light():
    code = "import sys, chatgen.config; print(sorted({'torch', 'vllm', 'megatron', 'ray'} & set(sys.modules)))"
    assert (
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout
        == "[]\n"
    )


def test_keys_vllm_v1_cannot_honour_come_out_with_the_other_errors(main_yaml, tmp_path):
    # One run of the loader reports the typo and every unsupported vLLM key together, not in two rounds.
    write(
        tmp_path / "models" / "policy.yaml",
        "load: /m\ntempreature: 0.7\nswap_space: 4\nuse_beam_search: true\nsliding_window: 128\n",
    )
    errors = errors_of(load_config, main_yaml)
    keys = sorted(e.split(": ")[1] for e in errors)
    assert keys == ["sliding_window", "swap_space", "tempreature", "use_beam_search"]
    assert all(e.startswith("models/policy.yaml: ") for e in errors)


def test_algorithm_knobs_are_typed_and_checked(main_yaml):
    cfg = load_config(
        main_yaml,
        ["runtime.algorithm.importance_sampling_cap=2", "runtime.algorithm.kl_estimator=k1"],
    )
    assert (
        cfg.runtime.algorithm.importance_sampling_cap == 2.0
        and cfg.runtime.algorithm.kl_estimator == "k1"
    )
    errors = errors_of(
        load_config,
        main_yaml,
        [
            "runtime.algorithm.gamma=1.5",
            "runtime.algorithm.kl_estimator=k4",
            "runtime.algorithm.importance_sampling_cap=0.5",
        ],
    )
    # gamma is ppo's, not grpo's
    assert sorted(e.split(": ")[1] for e in errors) == [
        "runtime.algorithm.gamma",
        "runtime.algorithm.importance_sampling_cap",
        "runtime.algorithm.kl_estimator",
        "valid keys of runtime.algorithm",
    ]


def test_overlap_generation_needs_a_correction_for_its_stale_samples(main_yaml):
    errors = errors_of(load_config, main_yaml, ["runtime.algorithm.overlap_generation=true"])
    assert len(errors) == 1 and "runtime.algorithm.overlap_generation" in errors[0]
    assert "importance_sampling_cap" in errors[0] and "old_logprobs: rollout" in errors[0]
    for fix in (
        "runtime.algorithm.importance_sampling_cap=2",
        "runtime.algorithm.old_logprobs=rollout",
    ):
        assert load_config(
            main_yaml, ["runtime.algorithm.overlap_generation=true", fix]
        ).runtime.algorithm.overlap_generation
    # a typo'd choice
    assert errors_of(load_config, main_yaml, ["runtime.algorithm.old_logprobs=engine"])


def test_cli_validates_a_per_model_yaml_by_its_schema_marker(tmp_path, capsys):
    from chatgen.cli import main

    path = write(
        tmp_path / "p.yaml",
        "# chatgen config p.yaml\n# chatgen-schema: vllm\nload: /m\ntemperature: 0.5\n",
    )
    assert main(["config", str(path)]) == 0 and "temperature: 0.5" in capsys.readouterr().out
    path.write_text("# chatgen-schema: vllm\ntempreature: 0.5\n")
    assert (
        main(["config", str(path)]) == 2 and "did you mean 'temperature'" in capsys.readouterr().err
    )
    path.write_text("load: /m\n")  # neither a main YAML nor a marker: says how to name the schema
    assert main(["config", str(path)]) == 2 and "--schema" in capsys.readouterr().err


@pytest.mark.faults
def test_a_schema_marker_imports_chatgen_modules_only(tmp_path, capsys):
    """A YAML line must not make `chatgen config` import arbitrary code; the command line may (--schema)."""
    import sys

    from chatgen.cli import main

    module = write(
        tmp_path / "planted_schema.py",
        "import dataclasses\nIMPORTED = True\n@dataclasses.dataclass\nclass S:\n    a: int = 1\n",
    )
    path = write(tmp_path / "p.yaml", "# chatgen-schema: planted_schema:S\na: 2\n")
    sys.path.insert(0, str(module.parent))
    try:
        assert main(["config", str(path)]) == 2
        assert "outside chatgen" in capsys.readouterr().err and "planted_schema" not in sys.modules
        assert main(["config", "--schema", "planted_schema:S", str(path)]) == 0  # explicit: allowed
        assert "a: 2" in capsys.readouterr().out
    finally:
        sys.path.remove(str(module.parent))
        sys.modules.pop("planted_schema", None)


@pytest.mark.faults
def test_a_key_given_twice_is_an_error_naming_both_lines(tmp_path):
    path = write(tmp_path / "p.yaml", "load: /m\ntemperature: 0.5\ntop_p: 0.9\ntemperature: 0.7\n")
    with pytest.raises(ConfigError, match=r"line 4: .*'temperature' appears twice .*lines 2 and 4"):
        load_model_config(path, VLLMConfig)


def test_yaml_merge_keys_are_accepted_and_keys_beside_them_override(tmp_path):
    """Issue 28, finding 7: the duplicate-key check refused `<<: *defaults` as a syntax error."""
    text = (
        "defaults: &defaults {load: /m, temperature: 0.5, top_p: 0.9}\n"
        "policy:\n  <<: *defaults\n  temperature: 0.7\n"
    )
    path = write(tmp_path / "p.yaml", text)
    from chatgen.config.safe_yaml import ConfigLoader

    loaded = yaml.load(path.read_text(), Loader=ConfigLoader)
    assert loaded == yaml.safe_load(text)
    assert loaded["policy"] == {"load": "/m", "temperature": 0.7, "top_p": 0.9}
    model = write(
        tmp_path / "m.yaml", "base: &b {load: /m, temperature: 0.5}\n<<: *b\ntop_p: 0.8\n"
    )
    with pytest.raises(ConfigError, match="base"):  # the anchor's own key is no VLLMConfig key
        load_model_config(model, VLLMConfig)


# nine levels of ten aliases: 400-odd bytes whose `models:` expands to 10^9 strings
ALIAS_BOMB = (
    "a: &a [x, x, x, x, x, x, x, x, x, x]\n"
    + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 10)}]\n" for i in range(8)
    )
    + "runtime: {num_episode: 1}\nmodels: {policy: {backend: vllm, config: {stop_token_list: *i}}}\n"
)
LOAD_BOMB = """
import resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))  # a regression stops here, not in the machine's swap
from chatgen.cli import main
start = time.monotonic()
rc = main(["config", sys.argv[1]])
print("RESULT", rc, round(time.monotonic() - start, 1))
"""


@pytest.mark.faults
def test_a_yaml_alias_bomb_and_a_huge_file_are_refused_by_name(tmp_path):
    """A 'billion laughs' config ran the loader out of memory (MemoryError, or the machine into swap)."""
    bomb = write(tmp_path / "bomb.yaml", ALIAS_BOMB)
    out = subprocess.run(
        [sys.executable, "-c", LOAD_BOMB, str(bomb)], capture_output=True, text=True, timeout=120
    )
    assert "RESULT 2" in out.stdout, out.stdout + out.stderr[-2000:]
    assert (
        f"{bomb.name}: refused: the document holds more than 100000 values once its aliases"
        in out.stderr
    ), out.stderr[-2000:]
    assert "MemoryError" not in out.stderr and "Traceback" not in out.stderr
    with pytest.raises(ConfigError, match="an alias refers to a node that contains it"):
        load_model_config(write(tmp_path / "loop.yaml", "load: &a [1, *a]\n"), VLLMConfig)
    huge = write(tmp_path / "huge.yaml", "load: /m\n" + "# padding\n" * 200_000)
    with pytest.raises(ConfigError, match=r"huge.yaml: refused: over 1048576 characters"):
        load_model_config(huge, VLLMConfig)
    with pytest.raises(ConfigError, match="nested deeper than the loader follows"):
        load_model_config(
            write(tmp_path / "deep.yaml", "load: " + "[" * 5000 + "]" * 5000 + "\n"), VLLMConfig
        )
    ok = load_model_config(write(tmp_path / "ok.yaml", "load: &m /m\ntokenizer: *m\n"), VLLMConfig)
    assert ok.tokenizer == ok.load == "/m"  # ordinary aliases still load


def test_override_values_keep_text_yaml_would_change():
    tree = parse_overrides(
        [
            "stop_token_list=Question: ;</s>",
            "load=#dir",
            "n=4",
            "top_p=0.9",
            "x=[1, 2]",
            "m={a: 1}",
            "tokenizer=null",
            "flag=true",
        ]
    )
    assert tree == {
        "stop_token_list": "Question: ;</s>",
        "load": "#dir",
        "n": 4,
        "top_p": 0.9,
        "x": [1, 2],
        "m": {"a": 1},
        "tokenizer": None,
        "flag": True,
    }
    cfg = load_model_config(None, VLLMConfig, ["load=/m", "stop_token_list=Question: ;</s>"])
    assert cfg.stop_token_list == "Question: ;</s>"


# --- the chatlearn dialect: a per-model YAML written for ChatLearn -------------------------------------------

# our own chain, in the style of ChatLearn's examples
CHATLEARN_STYLE = REPO / "tests" / "data" / "chatlearn_style"
SAMPLER, TRAINER = CHATLEARN_STYLE / "sampler.yaml", CHATLEARN_STYLE / "trainer.yaml"


@pytest.fixture
def chatlearn_env(monkeypatch):
    """cwd = the repository root; none of the chain's variables set."""
    monkeypatch.chdir(REPO)
    names = set()
    for path in CHATLEARN_STYLE.glob("*.yaml"):
        names |= set(re.findall(r"\$\{(\w+)", path.read_text()))
    for name in names:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def load_chatlearn(path, schema, overrides=()):
    return load_model_config(path, schema, list(overrides), dialect=dialect("chatlearn"))


def test_chatlearn_dialect_ignores_megatron_keys_and_sends_user_keys_to_args(chatlearn_env, caplog):
    chatlearn_env.setenv("CS_MODEL_DIR", "/models/tiny-llama")
    chatlearn_env.setenv("CS_SEQ_LEN", "512")
    chatlearn_env.setenv("CS_QUESTION_KEY", "question")
    with caplog.at_level("INFO", logger="chatgen.compat.chatlearn"):
        cfg = load_chatlearn(SAMPLER, VLLMConfig)
    assert (cfg.load, cfg.seq_length, cfg.max_new_tokens, cfg.new_token_limit) == (
        "/models/tiny-llama",
        512,
        32,
        True,
    )
    assert (cfg.n, cfg.temperature, cfg.top_p, cfg.eval_temperature, cfg.seed) == (
        2,
        0.7,
        0.8,
        0.2,
        7,
    )
    assert (cfg.tensor_parallel_size, cfg.dtype, cfg.stop_token_list) == (1, "float32", "</s>;###")
    assert (cfg.prompt_logprobs, cfg.sliding_window, cfg.tokenizer) == (None, None, None)
    assert cfg.args == {
        "shuffle_mode": 1,
        "samples_per_prompt": 3,
        "kl_target": 0.05,
        "reward_baseline": "None",
        "question_key": "question",
    }
    shown = "tests/data/chatlearn_style/sampler.yaml"
    ignored = (
        "attention_dropout, bf16, hidden_dropout, hidden_size, inference_batch_times_seqlen_threshold, "
        "make_vocab_size_divisible_by, max_position_embeddings, no_load_optim, no_load_rng, normalization, "
        "num_attention_heads, num_layers, position_embedding_type, swiglu, tokenizer_model, tokenizer_type, "
        "untie_embeddings_and_output_weights, use_distributed_optimizer"
    )
    # once each; the unset variables of ignored keys (CS_NUM_LAYERS, ...) need no value and get no warning
    assert [r.getMessage() for r in caplog.records] == [
        f"{shown} (chatlearn dialect): ignored 18 Megatron-LM key(s) that VLLMConfig does not have: {ignored}",
        f"{shown} (chatlearn dialect): read ChatLearn's spellings of chatgen keys: "
        "tensor_model_parallel_size -> tensor_parallel_size: 1",
        f"{shown} (chatlearn dialect): 5 key(s) chatgen does not know went to `args:` (your keys, in model_args): "
        "kl_target, question_key, reward_baseline, samples_per_prompt, shuffle_mode",
        f"{shown}: tokenizer: environment variable CS_TOKENIZER_DIR is not set and has no default: read as null "
        "(export CS_TOKENIZER_DIR=... or write ${CS_TOKENIZER_DIR:default})",
    ]


def test_chatlearn_dialect_from_a_main_yaml_with_overrides(chatlearn_env):
    cfg = load_config(
        CHATLEARN_STYLE / "main.yaml",
        [
            "policy.question_key=prompt",
            "policy.args.samples_per_prompt=5",
            "policy_trainer.args.kl_target=0.1",
        ],
    )
    policy, trainer = cfg.models["policy"].config, cfg.models["policy_trainer"].config
    # a top-level override of a user key goes to args too
    assert policy.args["question_key"] == "prompt"
    # an explicit `args:` entry wins over the routed key
    assert policy.args["samples_per_prompt"] == 5
    assert (
        model_args(policy)["question_key"] == "prompt" and model_args(policy)["seq_length"] == 256
    )
    assert isinstance(trainer, MegatronConfig)
    # Megatron-LM keys chatgen's trainer has are read; the others are ignored, not sent to args
    assert (trainer.lr, trainer.clip_grad, trainer.adam_beta2, trainer.lr_warmup_iters) == (
        2e-6,
        0.5,
        0.98,
        2,
    )
    assert (
        trainer.make_vocab_size_divisible_by,
        trainer.tensor_model_parallel_size,
        trainer.seq_length,
    ) == (64, 1, 256)
    assert trainer.args == {
        "max_new_tokens": 32,
        "shuffle_mode": 1,
        "samples_per_prompt": 3,
        "kl_target": 0.1,
        "reward_baseline": "None",
    }


def test_chatlearn_dialect_reads_bf16_as_dtype_unless_dtype_is_set(chatlearn_env):
    chatlearn_env.setenv("CS_BF16", "True")
    assert load_chatlearn(SAMPLER, VLLMConfig).dtype == "bfloat16"
    assert load_chatlearn(TRAINER, MegatronConfig).dtype == "bfloat16"
    assert load_chatlearn(SAMPLER, VLLMConfig, ["dtype=float32"]).dtype == "float32"
    (error,) = errors_of(load_chatlearn, SAMPLER, VLLMConfig, ["fp16=true"])
    assert error == (
        "command line: fp16: sets dtype to 'float16', and another ChatLearn key sets it to 'bfloat16'; "
        "keep one of them"
    )


def test_chatlearn_dialect_keeps_refusals_and_catches_typos(chatlearn_env):
    chatlearn_env.setenv("CS_BEAM", "True")
    errors = errors_of(
        load_chatlearn, SAMPLER, VLLMConfig, ["swap_space=4", "max_paddings=256", "tempreature=0.5"]
    )
    assert sorted(e.split(": ")[1] for e in errors) == [
        "max_paddings",
        "swap_space",
        "tempreature",
        "use_beam_search",
    ]
    (typo,) = [e for e in errors if "tempreature" in e]
    assert typo == (
        "command line: tempreature: unknown key; did you mean 'temperature'? (the chatlearn dialect sends "
        "unknown keys to `args:`, but not one this close to a chatgen key: fix its spelling, or move it "
        "under `args:` if it is yours)"
    )


def test_chatlearn_dialect_needs_a_schema_with_args():
    errors = errors_of(load_chatlearn, None, RuntimeConfig, ["x=1"])
    assert errors[0] == (
        "command line: the chatlearn dialect sends unknown keys to `args:`, and RuntimeConfig has no "
        "`args` field; read this file with the chatgen dialect"
    )
    # a python model's keys are its own
    assert load_chatlearn(None, dict, ["num_layers=2"]) == {"num_layers": 2}


def test_megatron_lm_key_list_is_sorted_and_names_no_chatlearn_or_vllm_key():
    lines = [
        line
        for line in (REPO / "chatgen/compat/megatron_lm_keys.txt").read_text().splitlines()
        if line and not line.startswith("#")
    ]
    assert lines == sorted(set(lines)) and set(lines) == megatron_lm_keys()
    assert {
        "num_layers",
        "hidden_size",
        "bf16",
        "lr_decay_style",
        "use_distributed_optimizer",
        "swiglu",
    } <= set(lines)
    assert not {
        "prompt_key",
        "init_kl_coef",
        "load_iteration",
        "temperature",
        "top_p",
        "n",
        "max_new_tokens",
        "tokenizer",
        "stop_token_list",
    } & set(lines)
