"""Shared fixtures: tiny HF-format models built once per machine and cached.

`make_tiny(config_name, **overrides)` returns the directory of a tiny model built from
`configs/models/<config_name>.yaml` with overrides; `tiny_llama_dir` / `tiny_qwen2_dir` / `tiny_qwen3_dir` are
the defaults.
The cache (CHATGEN_TEST_CACHE, default ~/.cache/chatgen/test-models) is keyed by the maker's source, the
corpus and the spec, so a change to any of them builds a fresh model.
"""
import hashlib
import os
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


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` need CUDA; elsewhere they are skipped with the reason, never silently dropped."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False on this machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
