"""`chatgen` reports bad input as one line naming the problem, with exit code 2 (the input must
change; 1 means the work failed), never a traceback; CHATGEN_DEBUG=1 brings the traceback back."""

import subprocess
import sys

import pytest


def chatgen(*args, env=None):
    import os

    return subprocess.run(
        [sys.executable, "-m", "chatgen.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def chatgen_at_once(*commands) -> list:
    """`chatgen` of each command, all started at once (each is a second or more of imports on one
    core); their CompletedProcess, in order."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "chatgen.cli", *command],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for command in commands
    ]
    try:
        outputs = [proc.communicate(timeout=120) for proc in procs]
        return [
            subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
            for proc, (out, err) in zip(procs, outputs)
        ]
    finally:
        for proc in procs:
            proc.kill()


def test_help_lists_every_subcommand():
    from chatgen.cli import COMMANDS

    out = chatgen("--help").stdout
    assert all(name in out for name in COMMANDS)


def test_bad_spec_is_one_message_not_a_traceback(tmp_path):
    proc = chatgen("make-tiny-model", "--output", str(tmp_path / "m"), "num_key_value_heads=0")
    assert proc.returncode == 2
    assert (
        "chatgen make-tiny-model:" in proc.stderr
        and "num_key_value_heads: must be a positive integer" in proc.stderr
    )
    assert "Traceback" not in proc.stderr and not (tmp_path / "m").exists()


def test_config_error_exits_2_and_names_the_key(tmp_path):
    proc = chatgen("make-tiny-model", "--output", str(tmp_path / "m"), "num_hiden_layers=3")
    assert proc.returncode == 2 and "did you mean 'num_hidden_layers'" in proc.stderr


def test_generate_with_a_wrong_model_dir_names_the_flag(tmp_path):
    (tmp_path / "in.jsonl").write_text('{"prompt_ids": [1, 2]}\n')
    proc = chatgen(
        "generate",
        "--model",
        str(tmp_path / "nope"),
        "--input",
        str(tmp_path / "in.jsonl"),
        "--output",
        str(tmp_path / "out.jsonl"),
    )
    assert (
        proc.returncode == 2
        and "--model" in proc.stderr
        and "neither an HF model directory (config.json)" in proc.stderr
    )
    assert "Traceback" not in proc.stderr


def test_debug_env_shows_the_traceback(tmp_path):
    proc = chatgen(
        "make-tiny-model",
        "--output",
        str(tmp_path / "m"),
        "num_key_value_heads=0",
        env={"CHATGEN_DEBUG": "1"},
    )
    assert proc.returncode != 0 and "Traceback" in proc.stderr


def test_make_tiny_model_family_flag_sets_the_family_over_config(tmp_path):
    import json
    from pathlib import Path

    config = Path(__file__).resolve().parents[2] / "configs" / "models" / "tiny_llama.yaml"
    from chatgen.cli import main

    assert (
        main(
            [
                "make-tiny-model",
                "--config",
                str(config),
                "--family",
                "qwen3",
                "--output",
                str(tmp_path / "m"),
                "num_hidden_layers=1",
            ]
        )
        == 0
    )
    hf = json.loads((tmp_path / "m" / "config.json").read_text())
    assert (hf["model_type"], hf["architectures"], hf["num_hidden_layers"]) == (
        "qwen3",
        ["Qwen3ForCausalLM"],
        1,
    )
    assert hf["head_dim"] == 32 and hf["tie_word_embeddings"] is False  # the rest from --config


@pytest.mark.faults
def test_overrides_after_a_flag_reach_the_config(tmp_path):
    """docs/quickstart.md's `bash examples/train_grpo_tiny.sh --resume runtime.num_episode=100`: a key=value after
    a flag is an override (here a misspelt one, so the config loader stops the run before anything starts)."""
    misspelt, flag = chatgen_at_once(
        ["train", "configs/grpo_tiny.yaml", "--resume", "runtime.num_episod=100"],
        ["train", "configs/grpo_tiny.yaml", "--resume", "--bogus-flag"],
    )
    assert misspelt.returncode == 2 and "did you mean 'num_episode'" in misspelt.stderr
    assert "unrecognized arguments" not in misspelt.stderr
    assert flag.returncode == 2 and "unrecognized arguments: --bogus-flag" in flag.stderr


@pytest.mark.faults
def test_sizes_and_layouts_are_usage_errors_with_exit_code_2(tiny_llama_dir, tmp_path):
    (tmp_path / "in.jsonl").write_text('{"prompt_ids": [1, 2]}\n')
    bad = tmp_path / "bad.yaml"
    bad.write_text("runtime:\n  seed: 1\n  seed: 2\nmodels: {}\n")
    convert, check_sync, *bad_config = chatgen_at_once(
        ["convert", "--to", "megatron", "--input", str(tiny_llama_dir)]
        + ["--output", str(tmp_path / "m"), "--tp", "0"],
        ["check-sync", "--hf-checkpoint", str(tiny_llama_dir), "--train-tp", "3"]
        + ["--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "c.json")],
        # one exit code for a bad config, any command
        ["config", str(bad)],
        ["train", str(bad)],
    )
    assert (
        convert.returncode == 2
        and "--tp: 0 must be at least 1" in convert.stderr
        and "Traceback" not in convert.stderr
    )
    # one message, from the driver, before any engine or trainer process starts
    assert (
        check_sync.returncode == 2 and check_sync.stderr.count("layout TP=3 PP=1 does not fit") == 1
    )
    assert "Traceback" not in check_sync.stderr and not (tmp_path / "c.json").exists()
    for proc in bad_config:
        assert proc.returncode == 2 and "'seed' appears twice" in proc.stderr, proc.args


@pytest.mark.faults
def test_generate_checks_its_output_before_loading_the_model(tiny_llama_dir, tmp_path, capsys):
    """The output path is checked first (no model loads, nothing is lost after a long generation): never the
    input file, never an existing file without --overwrite."""
    from chatgen.cli import main

    prompts = tmp_path / "in.jsonl"
    prompts.write_text('{"prompt_ids": [1, 2]}\n')
    common = ["generate", "--model", str(tiny_llama_dir), "--input", str(prompts)]
    assert main([*common, "--output", str(prompts)]) == 2
    assert (
        "is the --input file" in capsys.readouterr().err
        and prompts.read_text() == '{"prompt_ids": [1, 2]}\n'
    )
    existing = tmp_path / "out.jsonl"
    existing.write_text("keep me\n")
    assert main([*common, "--output", str(existing)]) == 2
    assert "pass --overwrite" in capsys.readouterr().err and existing.read_text() == "keep me\n"
    assert (
        main([*common, "--output", str(tmp_path)]) == 2
        and "is a directory" in capsys.readouterr().err
    )
    assert (
        main([*common, "--output", "/proc/nope/out.jsonl"]) == 2
        and "--output" in capsys.readouterr().err
    )


ARENAS_SCRIPT = r"""
import ctypes, sys, threading
from chatgen.cli import one_malloc_arena
limited = one_malloc_arena()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.fopen.restype = ctypes.c_void_p
libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
libc.fclose.argtypes = [ctypes.c_void_p]

def allocate():
    blocks = [libc.malloc(4096) for _ in range(64)]
    barrier.wait()  # every thread holds its blocks at once: glibc cannot hand one thread's arena to the next
    for b in blocks:
        libc.free(b)

barrier = threading.Barrier(4)
threads = [threading.Thread(target=allocate) for _ in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
fp = libc.fopen(sys.argv[1].encode(), b"w")
libc.malloc_info(0, fp)
libc.fclose(fp)
print(limited, open(sys.argv[1]).read().count("<heap nr="))
"""


@pytest.mark.parametrize(
    "env, limited, arenas", [({}, "True", 1), ({"MALLOC_ARENA_MAX": "8"}, "False", 5)]
)
def test_the_cli_process_allocates_from_one_malloc_arena_unless_the_environment_chose(
    tmp_path, env, limited, arenas
):
    """Threads allocating at once get arenas of their own (the main one + 4 here) unless `one_malloc_arena` ran:
    then all share the main arena. A MALLOC_ARENA_MAX in the environment is the user's choice and is kept."""
    import os

    proc = subprocess.run(
        [sys.executable, "-c", ARENAS_SCRIPT, str(tmp_path / "info.xml")],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **env},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [limited, str(arenas)]


@pytest.mark.faults
def test_the_api_key_comes_from_the_environment_or_a_file_and_the_flag_warns(
    tiny_llama_dir, tmp_path, monkeypatch, capsys
):
    """--api-key was the only way, and `ps` shows it to every user of the machine. (Each call stops at a bad
    --control-timeout, after the key is read and before an engine starts.)"""
    from chatgen.cli import main

    serve = [
        "serve",
        "--model",
        str(tiny_llama_dir),
        "--control",
        "--host",
        "0.0.0.0",
        "--control-timeout",
        "0",
    ]
    monkeypatch.delenv("CHATGEN_API_KEY", raising=False)
    assert main([*serve, "--api-key", "k"]) == 2
    err = capsys.readouterr().err
    assert (
        "warning: --api-key shows the key to every user of this machine in the process list (ps)"
        in err
    )
    # the key was taken: --host 0.0.0.0 passed
    assert "--control-timeout 0.0: give the seconds" in err
    key_file = tmp_path / "key"
    key_file.write_text("from-a-file\n")
    assert main([*serve, "--api-key-file", str(key_file)]) == 2
    err = capsys.readouterr().err
    assert "warning" not in err and "--control-timeout" in err
    monkeypatch.setenv("CHATGEN_API_KEY", "from-the-environment")
    assert main(serve) == 2 and "--control-timeout" in capsys.readouterr().err
    assert main([*serve, "--api-key-file", str(key_file)]) == 2
    assert (
        "CHATGEN_API_KEY and --api-key-file both give an API key; give it one way"
        in capsys.readouterr().err
    )
    monkeypatch.delenv("CHATGEN_API_KEY")
    key_file.write_text("\n")
    assert main([*serve, "--api-key-file", str(key_file)]) == 2
    assert "--api-key-file: the API key is empty" in capsys.readouterr().err
    assert main(serve) == 2  # no key at all: a public --control is refused
    assert "--control on --host 0.0.0.0 without an API key" in capsys.readouterr().err


@pytest.mark.faults
def test_check_sync_names_a_prompt_id_outside_the_vocabulary(tiny_llama_dir, tmp_path, capsys):
    """It was an IndexError traceback from the embedding, after the engine and the trainer had started."""
    from chatgen.cli import main

    prompts = tmp_path / "in.jsonl"
    prompts.write_text('{"prompt_ids": [1, 2]}\n{"prompt_ids": [1, 9999]}\n')
    assert (
        main(
            [
                "check-sync",
                "--hf-checkpoint",
                str(tiny_llama_dir),
                "--input",
                str(prompts),
                "--output",
                str(tmp_path / "c.json"),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert (
        "in.jsonl:2: \"prompt_ids\": token id(s) [9999] outside the model's vocabulary [0, 512)"
        in err
    )
    assert "Traceback" not in err and not (tmp_path / "c.json").exists()


@pytest.mark.faults
def test_a_refused_run_writes_nothing_and_names_what_to_change(tmp_path, capsys):
    """A bad data file or a bad --resume-from created output_dir/.chatgen.lock (the docs promise nothing is
    written), a bad --resume-from exited 1, an output_dir that cannot exist gave a bare errno, and a data file
    that is not UTF-8 named neither file nor line."""
    from chatgen import tasks
    from chatgen.cli import main

    tasks.write_task_data(str(tmp_path / "data"), n_train=64, n_eval=8)
    out = tmp_path / "run"
    train = [
        "train",
        "configs/grpo_tiny.yaml",
        f"runtime.data_path={tmp_path}/data/train.jsonl",
        f"runtime.eval_data_path={tmp_path}/data/eval.jsonl",
        f"runtime.output_dir={out}",
    ]
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"prompt": "1 2", "answer": "1 2"}\n{"prompt": oops}\n')
    assert main([*train, f"runtime.data_path={bad}"]) == 2
    assert "bad.jsonl:2: not JSON" in capsys.readouterr().err and not out.exists()
    bad.write_bytes(b'{"prompt": "1 2", "answer": "1 2"}\n{"prompt": "caf\xe9", "answer": "1"}\n')
    assert main([*train, f"runtime.data_path={bad}"]) == 2
    assert "bad.jsonl:2: not UTF-8 (byte 0xe9" in capsys.readouterr().err and not out.exists()
    assert main([*train, "--resume-from", "episode_000007"]) == 2
    assert (
        "--resume-from episode_000007: no checkpoint there" in capsys.readouterr().err
        and not out.exists()
    )
    assert main([*train, "--resume"]) == 2
    assert "--resume: no complete checkpoint under" in capsys.readouterr().err and not out.exists()
    assert main([*train, "runtime.output_dir=/proc/x/run"]) == 2
    assert "runtime.output_dir: cannot write into /proc/x/run" in capsys.readouterr().err


def test_serve_refuses_a_port_in_use_or_out_of_range_before_the_engine_loads(
    tiny_llama_dir, capsys, monkeypatch
):
    import socket

    from chatgen.cli import main, serve

    monkeypatch.setattr(serve, "build_module", lambda args: pytest.fail("the engine must not load"))
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        assert main(["serve", "--model", str(tiny_llama_dir), "--port", str(port)]) == 2
    err = capsys.readouterr().err
    # nothing announced
    assert f"--port {port}: 127.0.0.1:{port} is in use" in err and "http://" not in err
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--model", str(tiny_llama_dir), "--port", "99999"])
    assert (
        exit_.value.code == 2 and "argument --port: 99999 is not a port" in capsys.readouterr().err
    )
    assert main(["serve", "--model", str(tiny_llama_dir), "--host", "nohost.invalid"]) == 2
    assert "--host nohost.invalid: not an address of this machine" in capsys.readouterr().err


def test_serve_gives_a_wide_model_every_core_and_a_narrow_one_all_but_one(tmp_path, monkeypatch):
    """`chatgen serve`'s OpenMP team (OMP_NUM_THREADS, set before torch loads): the model's hidden size decides."""
    import json

    from chatgen.cli import WIDE_HIDDEN_SIZE, serve_threads

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(4)))
    for name, hidden in (("narrow", WIDE_HIDDEN_SIZE // 4), ("wide", WIDE_HIDDEN_SIZE)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({"hidden_size": hidden}))
    assert serve_threads(["serve", "--model", str(tmp_path / "narrow")]) == 3
    assert serve_threads(["serve", "--port", "0", f"--model={tmp_path / 'wide'}"]) == 4
    # serve itself names the bad path
    assert serve_threads(["serve", "--model", str(tmp_path / "missing")]) == 3
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0})
    assert serve_threads(["serve", "--model", str(tmp_path / "narrow")]) == 1


def test_config_and_train_refuse_the_same_data_line_before_anything_starts(tmp_path, capsys):
    """`chatgen config` runs exactly train's checks (chatgen.cli.config.checked_run_config): a data line the run
    would refuse fails both, with the same message, before any model starts."""
    from chatgen import tasks
    from chatgen.cli import main

    tasks.write_task_data(str(tmp_path / "data"), n_train=64, n_eval=8)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1 2", "answer": "1 2"}\n{"question": "3 1", "answer": "1 3"}\n')
    common = [
        f"runtime.data_path={tmp_path}/data/train.jsonl",
        f"runtime.output_dir={tmp_path}/run",
        f"runtime.eval_data_path={bad}",
    ]
    messages = []
    for command in (["config", "configs/grpo_tiny.yaml"], ["train", "configs/grpo_tiny.yaml"]):
        assert main([*command, *common]) == 2, command
        err = capsys.readouterr().err
        assert f"{bad}, record 2 has no column 'prompt' (its columns: question, answer)" in err, err
        assert "(runtime.eval_data_path)" in err, err
        messages.append(
            [line.strip() for line in err.splitlines() if "bad.jsonl, record 2" in line]
        )
    assert messages[0] == messages[1] and not (tmp_path / "run").exists()


def test_train_restarts_itself_on_jemalloc_when_asked_and_no_allocator_is_preloaded(monkeypatch):
    """CHATGEN_MALLOC=jemalloc: `chatgen train` as a command replaces its process by one with Ray's jemalloc
    preloaded, same arguments; without it, or with an LD_PRELOAD already set (the restarted process, or the
    user's allocator), the process stays as it is."""
    from chatgen.core import process_tuning

    library = process_tuning.jemalloc_library()
    assert library is not None and library.endswith("libjemalloc.so")  # ray is a dependency
    calls = []
    monkeypatch.setattr("os.execve", lambda *args: calls.append(args))
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.delenv("CHATGEN_MALLOC", raising=False)
    process_tuning.restart_on_jemalloc(["train", "run.yaml"])
    assert calls == []  # glibc unless asked
    monkeypatch.setenv("CHATGEN_MALLOC", "jemalloc")
    process_tuning.restart_on_jemalloc(["train", "run.yaml", "a=1"])
    [(exe, args, env)] = calls
    assert (exe, args[1:]) == (sys.executable, ["-m", "chatgen.cli", "train", "run.yaml", "a=1"])
    assert env["LD_PRELOAD"] == library
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/libtcmalloc.so")
    process_tuning.restart_on_jemalloc(["train", "run.yaml"])
    assert len(calls) == 1


def test_a_process_preloading_the_jemalloc_found_allocates_with_it():
    """The library restart_on_jemalloc preloads loads into a Python process that imports torch."""
    import os

    from chatgen.core.process_tuning import jemalloc_library

    probe = "import torch; print(any('libjemalloc' in line for line in open('/proc/self/maps')))"
    proc = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "LD_PRELOAD": jemalloc_library()},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True"]


def test_heap_bound_trims_only_when_the_heap_grew_past_its_slack(monkeypatch):
    """HeapBound (chatgen train's end of episode): the first check sets the reference; later checks call
    malloc_trim only while the RSS is more than `slack` above it; on a preloaded allocator it never trims."""
    from chatgen.core import process_tuning

    monkeypatch.delenv("LD_PRELOAD", raising=False)
    sizes, trims = iter([100, 120, 131, 140, 90, 150]), []
    monkeypatch.setattr(process_tuning, "resident_bytes", lambda: next(sizes))
    bound = process_tuning.HeapBound(slack=30)
    bound._trim = trims.append
    assert [bound.check() for _ in range(6)] == [False, False, True, True, False, True]
    assert bound.trims == len(trims) == 3 and bound.reference == 100


def test_malloc_trim_is_glibcs_unless_an_allocator_is_mapped_in():
    """The trim (HeapBound, the engine's release) follows the allocator mapped into the process:
    none with jemalloc preloaded; glibc's when LD_PRELOAD is only set later, as vLLM's CPU platform
    sets it for its children once an engine starts."""
    import os

    from chatgen.core import process_tuning

    probe = "from chatgen.core.process_tuning import glibc_malloc_trim as t; print(t() is None)"
    later = "import os; os.environ['LD_PRELOAD'] = 'libgomp.so.1'; " + probe
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    outs = [
        subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        for code in (probe, later)
    ]
    assert [p.stdout.split() for p in outs] == [["False"], ["False"]], outs
    library = process_tuning.jemalloc_library()
    if library is None:
        pytest.skip("no jemalloc on this machine to preload")
    preloaded = subprocess.run(
        [sys.executable, "-c", probe],
        env={**env, "LD_PRELOAD": library},
        capture_output=True,
        text=True,
    )
    assert preloaded.stdout.split() == ["True"], preloaded.stderr


HELD_EXIT = """
import signal, threading, time
from chatgen import cli
cli.TERM_GRACE_S = 2.0
signal.signal(signal.SIGTERM, cli._terminate_within_grace)  # as `chatgen` installs it for itself
threading.Thread(target=time.sleep, args=(600,)).start()  # a thread that never ends holds the exit
print("ready", flush=True)
try:
    time.sleep(600)
except cli.Terminated:
    print("stopping", flush=True)
"""


def test_sigterm_ends_the_command_even_when_a_thread_holds_the_exit():
    """Issue 50, finding 2: after SIGTERM printed 'stopped cleanly' the process waited forever on
    a thread stuck in a peer's read. A `chatgen` process now exits 143 TERM_GRACE_S after SIGTERM
    whatever still runs."""
    import signal
    import time

    proc = subprocess.Popen(
        [sys.executable, "-c", HELD_EXIT], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline() == "ready\n"
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        took = time.monotonic() - sent
    finally:
        proc.kill()
    assert proc.returncode == 143 and 2.0 <= took < 20, (proc.returncode, took)
    assert "did not finish within 2 s of SIGTERM" in proc.stderr.read()


def test_serve_fits_max_new_tokens_to_a_short_context_unless_given(tiny_llama_dir, tmp_path):
    """Issue 50, finding 16: `chatgen serve --model M` of a 256-token model failed at start
    (`max_new_tokens: 256 leaves no room for a prompt`); the server bounds each request itself."""
    import argparse
    import json
    import shutil

    from chatgen.cli import serve
    from chatgen.config import ConfigError
    from chatgen.generation.config import resolve_seq_length

    model = tmp_path / "short"
    shutil.copytree(tiny_llama_dir, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 256}))
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)

    def resolved(*argv):
        args = parser.parse_args(["--model", str(model), *argv])
        module = serve.build_module(args)
        serve.fit_max_new_tokens(module, args)
        return resolve_seq_length(module.config, model)  # what the engine's setup checks

    assert resolved().max_new_tokens == 128
    assert resolved("max_new_tokens=100").max_new_tokens == 100
    with pytest.raises(ConfigError, match="max_new_tokens: 256 leaves no room"):
        resolved("max_new_tokens=256")  # the user's own value is checked, not changed


def test_serve_gateway_needs_an_api_key(tiny_llama_dir, monkeypatch, capsys):
    """--gateway's reward endpoint decides what trains: refused without a key, before an engine starts."""
    from chatgen.cli import main

    monkeypatch.delenv("CHATGEN_API_KEY", raising=False)
    assert main(["serve", "--model", str(tiny_llama_dir), "--gateway"]) == 2
    assert "--gateway: its reward endpoint decides what trains" in capsys.readouterr().err
