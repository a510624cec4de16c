"""chatgen.core.quiet: the known-harmless third-party notices are filtered by library module, category and text,
nothing else is; `-v` / CHATGEN_VERBOSE=1 filters nothing (pytest tests/unit/test_quiet.py)."""

import logging
import os
import subprocess
import sys
import warnings

import pytest

from chatgen.core import quiet


def shown(message, category, module) -> bool:
    """Whether a warning issued from `module` would show after quiet.apply() (filters restored after)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet.apply()
        warnings.warn_explicit(message, category, "x.py", 1, module=module)
    return bool(caught)


def logged(logger: str, message: str) -> bool:
    """Whether `message` at WARNING on `logger` gets past its filters to a handler (whatever level the library
    configured, e.g. vLLM's ERROR once an engine of this test process started)."""
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    log = logging.getLogger(logger)
    level, log.level = log.level, logging.WARNING
    log.addHandler(handler)
    try:
        log.warning(message)
    finally:
        log.removeHandler(handler)
        log.level = level
    return bool(records)


@pytest.fixture
def quiet_env(monkeypatch):
    monkeypatch.delenv(quiet.VERBOSE, raising=False)
    for name in quiet.LOGGED:
        monkeypatch.setattr(logging.getLogger(name), "filters", [])
    # apply() only sets defaults: a user's choice stays
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "INFO")
    # (and this test process's environment is restored)
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "0")


def test_each_filter_hides_its_notice_from_its_module_only(quiet_env):
    apex = "Transformer Engine and Apex are not installed. Falling back to Torch optimizers."
    assert not shown(apex, UserWarning, "megatron.core.optimizer")
    assert not shown(
        "Apex is not installed. Falling back to Torch Norm",
        UserWarning,
        "megatron.core.models.backends",
    )
    assert not shown(
        "full scope is deprecated. Use empty cuda_graph_scope",
        UserWarning,
        "megatron.core.transformer.transformer_config",
    )
    assert not shown(
        "`torch.distributed.reduce_op` is deprecated, please use `torch.distributed.ReduceOp` instead",
        FutureWarning,
        "vllm.triton_utils.dispatcher",
    )
    # a resume's three
    assert not shown(
        "`load_state_dict` is deprecated and will be removed in future versions. Please use `load`",
        FutureWarning,
        "megatron.core.dist_checkpointing.strategies.torch",
    )
    assert not shown(
        "Please use DTensor instead and we are deprecating ShardedTensor.",
        FutureWarning,
        "torch.distributed.checkpoint.default_planner",
    )
    assert shown(
        "Please use DTensor instead and we are deprecating ShardedTensor.",
        FutureWarning,
        "my_project.ckpt",
    )
    assert not shown(
        "When using async grad allreduce it is recommended to set the environment variable "
        "CUDA_DEVICE_MAX_CONNECTIONS to 1 for maximum speedup",
        UserWarning,
        "megatron.core.tensor_parallel.layers",
    )
    # the same text from another library, another warning from the same module, another category: all shown
    assert shown(apex, UserWarning, "my_project.trainer")
    assert shown("the learning rate is zero", UserWarning, "megatron.core.optimizer")
    assert shown("`torch.distributed.reduce_op` is deprecated", FutureWarning, "my_project.dist")
    assert shown("Apex is not installed", RuntimeWarning, "megatron.core.models.backends")
    triton, ray_auth = (
        "vllm.triton_utils.importing",
        "ray._private.authentication.authentication_token_setup",
    )
    assert not logged(
        triton, "Triton is installed, but doesn't include CPU backend. Disabling Triton."
    )
    assert not logged(
        ray_auth, "Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=..."
    )
    assert logged(
        ray_auth,
        "Token authentication is disabled for this Ray cluster. Anyone with network access...",
    )
    assert logged(triton, "Triton found 0 active drivers")  # the same logger's other messages
    # another logger
    assert logged("vllm.engine", "Triton is installed, but doesn't include CPU backend")
    quiet.apply()  # a second call adds nothing
    assert len(logging.getLogger(triton).filters) == 1
    assert os.environ["VLLM_LOGGING_LEVEL"] == "INFO"


def test_verbose_filters_nothing(quiet_env, monkeypatch):
    monkeypatch.setenv(quiet.VERBOSE, "1")
    monkeypatch.delenv("VLLM_LOGGING_LEVEL")
    assert shown(
        "Apex is not installed. Falling back to Torch Norm",
        UserWarning,
        "megatron.core.models.backends",
    )
    assert logged(
        "vllm.triton_utils.importing", "Triton is installed, but doesn't include CPU backend."
    )
    assert "VLLM_LOGGING_LEVEL" not in os.environ


@pytest.mark.parametrize(
    "argv", [["-v", "config", "--reference"], ["config", "--reference", "--verbose"]]
)
def test_the_cli_flag_anywhere_turns_filters_off_for_this_process_and_its_workers(
    argv, monkeypatch, capsys
):
    from chatgen.cli import main

    monkeypatch.setenv(quiet.VERBOSE, "0")  # not verbose; restored after the test
    assert main(argv) == 0 and "### `runtime`" in capsys.readouterr().out
    # Ray workers inherit CHATGEN_ variables
    assert quiet.verbose() and os.environ[quiet.VERBOSE] == "1"


@pytest.mark.integration
def test_megatron_and_vllm_imports_say_nothing_unless_verbose():
    """The real libraries: what megatron-core and vLLM print while chatgen imports them (fresh processes)."""
    code = (
        "from chatgen.core import quiet; quiet.apply()\n"
        "import megatron.core.optimizer, megatron.core.models.gpt.gpt_layer_specs, vllm.triton_utils\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in (quiet.VERBOSE, "VLLM_LOGGING_LEVEL")}
    # both at once: each is seconds of imports on one core
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=run_env,
        )
        for run_env in (env, {**env, quiet.VERBOSE: "1"})
    ]
    (quiet_out, quiet_err), (_, loud_err) = [proc.communicate(timeout=300) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], quiet_err + loud_err
    assert quiet_err == "" and quiet_out == ""
    # (vLLM's "Triton is installed, but ..." was the other: setup_env.sh removes triton now)
    assert "Apex is not installed" in loud_err
