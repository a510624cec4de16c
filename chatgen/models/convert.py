"""HF checkpoint <-> chatgen Megatron checkpoint, at any TP x PP that fits the model (`chatgen convert`).

    chatgen convert --to megatron --input outputs/tiny-llama --output outputs/tiny-llama-tp2pp2 --tp 2 --pp 2
    chatgen convert --to hf --input outputs/tiny-llama-tp2pp2 --output outputs/tiny-llama-back

A chatgen Megatron checkpoint is what `MegatronModule.save_checkpoint` writes and `load` accepts:
chatgen_megatron.json (HF config, TP, PP, padded vocab) + model_tp{t}_pp{p}.safetensors per rank, with
megatron-core local-spec parameter names and local layer numbers. Pure tensor index arithmetic
(chatgen/models/layout.py): HF -> Megatron -> HF is bit-exact. Imports neither Megatron nor vLLM.
To change the layout of a Megatron checkpoint, convert it to HF and back.
"""
import json
import tempfile
from pathlib import Path

from safetensors.torch import save_file

from chatgen import models
from chatgen.core.checkpoint_io import (
    atomic_directory,
    copy_hf_side_files,
    megatron_shard_file,
    read_hf_safetensors,
    read_megatron_meta,
    read_megatron_shard,
    write_megatron_meta,
)
from chatgen.models import layout


def hf_to_megatron_dir(src, dst, tp: int, pp: int, divisible_by: int = 128) -> Path:
    src, dst = Path(src), Path(dst)
    hf_config = json.loads((src / "config.json").read_text())
    spec = models.spec_from_hf_config(hf_config)
    hf = read_hf_safetensors(src, spec.tie_word_embeddings)
    padded = spec.padded_vocab_size(tp, divisible_by)
    shards = layout.hf_to_megatron(hf, spec, tp, pp, padded)
    with atomic_directory(dst) as tmp:
        for (p, t), state in shards.items():
            save_file({k: v.contiguous().clone() for k, v in state.items()}, str(megatron_shard_file(tmp, t, p)))
        write_megatron_meta(tmp, hf_config, tp, pp, padded, iteration=0)
        copy_hf_side_files(src, tmp)
    return dst


def megatron_to_hf_dir(src, dst, replace: bool = False, side_files_from=None) -> Path:
    """A chatgen Megatron checkpoint -> an HF directory `dst` (written atomically; an existing one is replaced
    only with `replace`), with the tokenizer files of `src` or of the HF directory `side_files_from`."""
    src, dst = Path(src), Path(dst)
    hf_config, hf = megatron_checkpoint_to_hf(src)
    with atomic_directory(dst, replace=replace) as tmp:
        save_file({k: v.contiguous().clone() for k, v in hf.items()}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2))
        copy_hf_side_files(side_files_from or src, tmp)
    return dst


def hf_config_view(checkpoint) -> str:
    """A new temporary HF directory holding a chatgen Megatron checkpoint's config.json and tokenizer files, for
    an engine to start from before the checkpoint's weights are written into it; the caller removes it."""
    view = tempfile.mkdtemp(prefix="chatgen-hf-view-")
    (Path(view) / "config.json").write_text(json.dumps(read_megatron_meta(checkpoint)["hf_config"]))
    copy_hf_side_files(checkpoint, view)
    return view


def megatron_checkpoint_to_hf(src) -> tuple[dict, dict]:
    """(HF config, {HF name: tensor}) of a chatgen Megatron checkpoint, whatever its TP x PP, in memory."""
    src = Path(src)
    meta = read_megatron_meta(src)
    if meta is None:
        raise FileNotFoundError(f"{src}: not a chatgen Megatron checkpoint (no chatgen_megatron.json)")
    tp, pp = meta["tensor_model_parallel_size"], meta["pipeline_model_parallel_size"]
    spec = models.spec_from_hf_config(meta["hf_config"])
    shards = {(p, t): read_megatron_shard(src, t, p) for p in range(pp) for t in range(tp)}
    return meta["hf_config"], layout.megatron_to_hf(shards, spec, tp, pp)
