"""Checkpoint file I/O shared by the trainer, the RLHF runs, `chatgen convert` and the model makers,
and the one way chatgen writes anything that must never be seen half-written.

    from chatgen.core.checkpoint_io import atomic_directory, atomic_file, read_hf_safetensors, read_megatron_shard
    hf = read_hf_safetensors("outputs/tiny-llama", tie_word_embeddings=False)   # {HF name: tensor}
    shard = read_megatron_shard("outputs/tiny-llama-tp2pp2", t=1, p=0)          # {Megatron name: tensor}
    with atomic_directory("outputs/new-model") as tmp:                          # renamed into place on success
        ...
    with atomic_file("outputs/run/metrics.png") as tmp:                         # a file, the same way
        fig.savefig(tmp)

Atomic writes: everything is written under a hidden staging name beside the target (`.NAME.tmp`) and
renamed into place with os.replace once complete, so a crash at any point leaves the previous
version (or nothing) under the final name. Processes that write one directory together (the ranks of
a trainer, the actors of a run) use `begin_directory` / `commit_directory`, the two halves of
`atomic_directory`; the ranks of one torch.distributed job, `ranks_write_directory`. Weights are
read with safetensors only (never pickle). Imports neither Megatron nor vLLM.
"""

import contextlib
import json
import os
import shutil
from pathlib import Path

from safetensors import safe_open

MEGATRON_META = "chatgen_megatron.json"  # HF config, TP, PP, padded vocab, iteration of a chatgen Megatron checkpoint
# Tokenizer and generation files an HF directory carries beside the weights (copied by whatever
# derives a new HF directory from an old one: convert, the SFT warm start, a trainer's checkpoint).
HF_SIDE_FILES = (
    "tokenizer.model",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
    "chat_template.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
)


def write_megatron_meta(
    directory,
    hf_config: dict,
    tp: int,
    pp: int,
    padded_vocab_size: int,
    iteration: int,
    optimizer: bool = False,
    distributed: bool = False,
    dp: int = 1,
    ep: int = 1,
) -> None:
    """The chatgen_megatron.json of a chatgen Megatron checkpoint (what `load` and `chatgen
    convert` read). distributed: the weights are megatron-core's distributed checkpoint in the
    same directory (what the trainer saves, loadable at any TP x PP x DP:
    chatgen/training/dist_checkpoint.py), not model_tp*_pp*.safetensors (what `chatgen convert
    --to megatron` writes); `optimizer`: it holds the optimizer state too, which a load then
    requires; tp, pp, dp, ep: the layout it was saved at (the weights hold every expert whatever
    the EP)."""
    (Path(directory) / MEGATRON_META).write_text(
        json.dumps(
            dict(
                hf_config=hf_config,
                tensor_model_parallel_size=tp,
                pipeline_model_parallel_size=pp,
                data_parallel_size=dp,
                padded_vocab_size=padded_vocab_size,
                iteration=iteration,
                optimizer=optimizer,
                expert_model_parallel_size=ep,
                distributed=distributed,
            ),
            indent=1,
        )
    )


def read_megatron_meta(directory) -> dict | None:
    """The chatgen_megatron.json of `directory`, or None when it is not a chatgen Megatron
    checkpoint."""
    path = Path(directory) / MEGATRON_META
    return json.loads(path.read_text()) if path.exists() else None


def read_hf_config(path, what: str = "load") -> dict:
    """config.json of an HF directory, or the HF config stored in a chatgen Megatron checkpoint;
    a FileNotFoundError naming `what` (the key or flag that gave the path) when it is neither."""
    path = Path(path)
    meta = read_megatron_meta(path)
    if meta is not None:
        return meta["hf_config"]
    if (path / "config.json").is_file():
        return json.loads((path / "config.json").read_text())
    raise FileNotFoundError(
        f"{what}={str(path)!r}: neither an HF model directory (config.json) nor a chatgen "
        f"Megatron checkpoint (chatgen_megatron.json); point {what} at one of them"
    )


def copy_hf_side_files(src, dst) -> None:
    """Copy the tokenizer / generation files of HF directory `src` that `dst` does not have yet."""
    for name in HF_SIDE_FILES:
        if (Path(src) / name).exists() and not (Path(dst) / name).exists():
            shutil.copy(Path(src) / name, Path(dst) / name)


def megatron_shard_file(path, t: int, p: int) -> Path:
    """The weights of tensor-parallel rank t, pipeline stage p in a chatgen Megatron checkpoint
    directory."""
    return Path(path) / f"model_tp{t}_pp{p}.safetensors"


def read_megatron_shard(path, t: int, p: int) -> dict:
    with safe_open(str(megatron_shard_file(path, t, p)), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def read_hf_safetensors(path, tie_word_embeddings: bool, names=None) -> dict:
    """All tensors of the *.safetensors files in HF directory `path` (only those in `names` when
    given).

    With tied embeddings a checkpoint may store the matrix only as lm_head.weight; it then also serves as
    model.embed_tokens.weight.
    """
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"{path}: no *.safetensors files; chatgen reads HF checkpoints in safetensors"
        )
    if names is not None and tie_word_embeddings and "model.embed_tokens.weight" in names:
        # the tied matrix may be stored under the head's name only
        names = {
            *names,
            "lm_head.weight",
        }
    hf = {}
    for file in files:
        with safe_open(str(file), "pt") as f:
            hf.update({k: f.get_tensor(k) for k in f.keys() if names is None or k in names})
    if tie_word_embeddings and "model.embed_tokens.weight" not in hf and "lm_head.weight" in hf:
        hf["model.embed_tokens.weight"] = hf["lm_head.weight"]
    return hf


def staging_path(path) -> Path:
    """Where the directory `path` is written before `commit_directory` moves it into place (the
    same name in every process, so the ranks of a job find it)."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp")


def begin_directory(path) -> Path:
    """Create (fresh) the staging directory for `path` and return it; its parent is created. The
    name is derived from `path`, so every process writing into it finds the same one."""
    path = Path(path)
    tmp = staging_path(path)
    if tmp.exists():  # left over from a crash while writing
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    tmp.chmod(0o755)
    return tmp


def commit_directory(path) -> Path:
    """Move the complete staging directory of `path` into place, replacing an existing `path`
    (the old one is renamed away first and removed last, so `path` is never missing a file it
    had)."""
    path = Path(path)
    old = path.with_name(f".{path.name}.old")
    if old.exists():
        shutil.rmtree(old)
    if path.exists():
        os.replace(path, old)
    os.replace(staging_path(path), path)
    shutil.rmtree(old, ignore_errors=True)
    return path


@contextlib.contextmanager
def ranks_write_directory(path):
    """The atomic directory the ranks of a torch.distributed job write together (a trainer's
    checkpoint): rank 0 creates the staging directory, every rank writes into the one yielded, and
    once all have finished (a barrier) rank 0 moves it into place; the ranks leave together (a
    second barrier), so none reads `path` before it is complete. Collective: every rank of the
    default group enters it. A rank that fails inside leaves `path` as it was."""
    import torch.distributed as dist

    path = Path(path)
    if dist.get_rank() == 0:
        begin_directory(path)
    dist.barrier()
    yield staging_path(path)
    dist.barrier()
    if dist.get_rank() == 0:
        commit_directory(path)
    dist.barrier()


@contextlib.contextmanager
def atomic_directory(path, replace: bool = False):
    """Yield a fresh staging directory, moved to `path` when the block succeeds and removed when
    it fails, so `path` is either complete or as it was. An existing `path` is an error unless
    `replace`."""
    path = Path(path)
    if path.exists() and not replace:
        raise FileExistsError(f"{path} exists; remove it or choose another path")
    tmp = begin_directory(path)
    try:
        yield tmp
        commit_directory(path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_private_text(path, text: str) -> None:
    """Write `text` to `path` readable by this user only (0600), atomically (a staging file
    created anew beside it, then os.replace). A symbolic link at `path` is refused, not followed:
    whoever planted it would have the write land on its target."""
    path = Path(path)
    if path.is_symlink():
        raise OSError(
            f"{path} is a symbolic link; chatgen writes no file through a link it did "
            "not make (its target would be overwritten): remove the link"
        )
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def atomic_file(path):
    """Yield a staging path for one file beside `path`; it replaces `path` (fsynced) when the
    block succeeds and is removed when it fails."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # keeps the suffix: writers pick formats by it
    tmp = path.with_name(f".{path.name}.tmp{path.suffix}")
    try:
        yield tmp
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def hf_weight_shapes(path) -> dict:
    """{HF name: shape} of every tensor of the *.safetensors files of HF directory `path`, from
    their headers (nothing is read): what a model of a family chatgen/models does not map takes
    in a weight sync."""
    shapes = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            shapes.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})
    if not shapes:
        raise FileNotFoundError(
            f"{path}: no *.safetensors files; chatgen reads HF checkpoints in safetensors"
        )
    return shapes
