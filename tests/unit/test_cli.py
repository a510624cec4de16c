"""`chatgen` reports bad input as one line naming the problem, with exit code 1 (2 for config errors), never a
traceback; CHATGEN_DEBUG=1 brings the traceback back."""
import subprocess
import sys


def chatgen(*args, env=None):
    import os

    return subprocess.run([sys.executable, "-m", "chatgen.cli", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


def test_help_lists_every_subcommand():
    from chatgen.cli import COMMANDS

    out = chatgen("--help").stdout
    assert all(name in out for name in COMMANDS)


def test_bad_spec_is_one_message_not_a_traceback(tmp_path):
    proc = chatgen("make-tiny-model", "--output", str(tmp_path / "m"), "num_key_value_heads=0")
    assert proc.returncode == 1
    assert "chatgen make-tiny-model:" in proc.stderr and "num_key_value_heads: must be a positive integer" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "m").exists()


def test_config_error_exits_2_and_names_the_key(tmp_path):
    proc = chatgen("make-tiny-model", "--output", str(tmp_path / "m"), "num_hiden_layers=3")
    assert proc.returncode == 2 and "did you mean 'num_hidden_layers'" in proc.stderr


def test_generate_with_a_wrong_model_dir_names_the_flag(tmp_path):
    (tmp_path / "in.jsonl").write_text('{"prompt_ids": [1, 2]}\n')
    proc = chatgen("generate", "--model", str(tmp_path / "nope"), "--input", str(tmp_path / "in.jsonl"),
                   "--output", str(tmp_path / "out.jsonl"))
    assert proc.returncode == 1 and "--model" in proc.stderr and "no config.json" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_debug_env_shows_the_traceback(tmp_path):
    proc = chatgen("make-tiny-model", "--output", str(tmp_path / "m"), "num_key_value_heads=0",
                   env={"CHATGEN_DEBUG": "1"})
    assert proc.returncode != 0 and "Traceback" in proc.stderr


def test_make_tiny_model_family_flag_sets_the_family_over_config(tmp_path):
    import json
    from pathlib import Path

    config = Path(__file__).resolve().parents[2] / "configs" / "models" / "tiny_llama.yaml"
    from chatgen.cli import main

    assert main(["make-tiny-model", "--config", str(config), "--family", "qwen3", "--output", str(tmp_path / "m"),
                 "num_hidden_layers=1"]) == 0
    hf = json.loads((tmp_path / "m" / "config.json").read_text())
    assert (hf["model_type"], hf["architectures"], hf["num_hidden_layers"]) == ("qwen3", ["Qwen3ForCausalLM"], 1)
    assert hf["head_dim"] == 32 and hf["tie_word_embeddings"] is False  # the rest from --config
