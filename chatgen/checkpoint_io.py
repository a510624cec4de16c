"""Checkpoint file I/O shared by the trainer, `chatgen convert` and `chatgen make-tiny-model`.

    from chatgen.checkpoint_io import atomic_directory, read_hf_safetensors, read_megatron_shard
    hf = read_hf_safetensors("outputs/tiny-llama", tie_word_embeddings=False)   # {HF name: tensor}
    shard = read_megatron_shard("outputs/tiny-llama-tp2pp2", t=1, p=0)          # {Megatron name: tensor}
    with atomic_directory("outputs/new-model") as tmp:                          # renamed into place on success
        ...

Weights are read with safetensors only (never pickle). Imports neither Megatron nor vLLM.
"""
import contextlib
import os
import shutil
import tempfile
from pathlib import Path

from safetensors import safe_open

MEGATRON_META = "chatgen_megatron.json"  # HF config, TP, PP, padded vocab, iteration of a chatgen Megatron checkpoint


def megatron_shard_file(path, t: int, p: int) -> Path:
    """The weights of tensor-parallel rank t, pipeline stage p in a chatgen Megatron checkpoint directory."""
    return Path(path) / f"model_tp{t}_pp{p}.safetensors"


def read_megatron_shard(path, t: int, p: int) -> dict:
    with safe_open(str(megatron_shard_file(path, t, p)), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def read_hf_safetensors(path, tie_word_embeddings: bool, names=None) -> dict:
    """All tensors of the *.safetensors files in HF directory `path` (only those in `names` when given).

    With tied embeddings a checkpoint may store the matrix only as lm_head.weight; it then also serves as
    model.embed_tokens.weight.
    """
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files; chatgen reads HF checkpoints in safetensors")
    if names is not None and tie_word_embeddings and "model.embed_tokens.weight" in names:
        names = {*names, "lm_head.weight"}  # the tied matrix may be stored under the head's name only
    hf = {}
    for file in files:
        with safe_open(str(file), "pt") as f:
            hf.update({k: f.get_tensor(k) for k in f.keys() if names is None or k in names})
    if tie_word_embeddings and "model.embed_tokens.weight" not in hf and "lm_head.weight" in hf:
        hf["model.embed_tokens.weight"] = hf["lm_head.weight"]
    return hf


@contextlib.contextmanager
def atomic_directory(path):
    """Yield a fresh hidden directory beside `path`, renamed to `path` when the block succeeds.

    On an exception the directory is removed, so `path` is either complete or absent. `path` must not
    exist (or be an empty directory); its parent is created.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; a model directory is meant to be shared
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
