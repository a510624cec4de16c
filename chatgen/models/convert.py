"""HF checkpoint <-> chatgen Megatron checkpoint, at any TP x PP that fits the model; a
megatron-core distributed checkpoint (a trainer's, or a Megatron-LM run's `torch_dist` one) -> HF
(`chatgen convert`).

    chatgen convert --to megatron --input outputs/tiny-llama --output outputs/tiny-llama-tp2pp2 --tp 2 --pp 2
    chatgen convert --to hf --input outputs/tiny-llama-tp2pp2 --output outputs/tiny-llama-back
    chatgen convert --to hf --input outputs/run/checkpoints/episode_000020/policy_trainer --output outputs/ep20-hf
    chatgen convert --to hf --input megatron_lm_run/iter_0001000 --hf-config outputs/tiny-llama --output outputs/x

`--to megatron` writes chatgen_megatron.json (HF config, TP, PP, padded vocab) +
model_tp{t}_pp{p}.safetensors per rank, with megatron-core local-spec parameter names and local
layer numbers (weights only; `load` accepts it at that TP x PP). What
`MegatronModule.save_checkpoint` writes is a megatron-core distributed checkpoint beside a
chatgen_megatron.json: `--to hf` reads its whole tensors in this one process, whatever layout saved
it. A Megatron-LM checkpoint in the same format (`--ckpt-format torch_dist`, the directory of one
iteration) has no chatgen_megatron.json: `--hf-config` names the HF model (directory or config.json)
of its architecture, whose tokenizer files are copied too. Pure tensor index arithmetic
(chatgen/models/layout.py): HF -> Megatron -> HF is bit-exact. Imports neither Megatron nor vLLM. To
change the layout of a weights-only Megatron checkpoint, convert it to HF and back.
"""

import json
import re
import tempfile
from pathlib import Path

from safetensors.torch import save_file

from chatgen import models
from chatgen.core import dcp
from chatgen.core.checkpoint_io import (
    atomic_directory,
    copy_hf_side_files,
    megatron_shard_file,
    read_hf_safetensors,
    read_megatron_meta,
    read_megatron_shard,
    write_megatron_meta,
)
from chatgen.models import layout, lora_format


def hf_to_megatron_dir(src, dst, tp: int, pp: int, divisible_by: int = 128) -> Path:
    src, dst = Path(src), Path(dst)
    hf_config = json.loads((src / "config.json").read_text())
    spec = models.spec_from_hf_config(hf_config)
    hf = read_hf_safetensors(src, spec.tie_word_embeddings)
    padded = spec.padded_vocab_size(tp, divisible_by)
    shards = layout.hf_to_megatron(hf, spec, tp, pp, padded)
    with atomic_directory(dst) as tmp:
        for (p, t), state in shards.items():
            save_file(
                {k: v.contiguous().clone() for k, v in state.items()},
                str(megatron_shard_file(tmp, t, p)),
            )
        write_megatron_meta(tmp, hf_config, tp, pp, padded, iteration=0)
        copy_hf_side_files(src, tmp)
    return dst


def megatron_to_hf_dir(
    src, dst, replace: bool = False, side_files_from=None, hf_config=None
) -> Path:
    """A chatgen Megatron checkpoint (or, with `hf_config`, a Megatron-LM distributed one) -> an
    HF directory `dst` (written atomically; an existing one is replaced only with `replace`),
    with the tokenizer, chat template and generation files of `src`, or of the HF directory
    `side_files_from` (default with `hf_config`: that model's directory), and a
    generation_config.json made from the model config when neither has one."""
    src, dst = Path(src), Path(dst)
    config, hf = megatron_checkpoint_to_hf(src, hf_config)
    side_files_from = side_files_source(src, side_files_from, hf_config)
    with atomic_directory(dst, replace=replace) as tmp:
        save_file(
            {k: v.contiguous().clone() for k, v in hf.items()},
            str(tmp / "model.safetensors"),
            metadata={"format": "pt"},
        )
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        copy_hf_side_files(side_files_from, tmp)
        if not (tmp / "generation_config.json").exists():
            generation = json.dumps(generation_config(config), indent=2)
            (tmp / "generation_config.json").write_text(generation)
    return dst


def side_files_source(src, side_files_from=None, hf_config=None) -> Path:
    """Where `megatron_to_hf_dir` takes the tokenizer files from: `side_files_from`, else the
    directory of `hf_config` (a Megatron-LM checkpoint's architecture), else the checkpoint `src`
    itself."""
    if side_files_from is None and hf_config is not None:
        side_files_from = Path(hf_config) if Path(hf_config).is_dir() else Path(hf_config).parent
    return Path(side_files_from or src)


def generation_config(hf_config: dict) -> dict:
    """generation_config.json as transformers derives it from a model config (its special token
    ids), for an export whose source had none: `generate` then stops at the model's EOS as the
    engine did."""
    ids = {
        key: hf_config[key]
        for key in ("bos_token_id", "eos_token_id", "pad_token_id")
        if hf_config.get(key) is not None
    }
    return {**ids, "_from_model_config": True}


def hf_config_view(checkpoint) -> str:
    """A new temporary HF directory holding a chatgen Megatron checkpoint's config.json and
    tokenizer files, for an engine to start from before the checkpoint's weights are written into
    it; the caller removes it."""
    view = tempfile.mkdtemp(prefix="chatgen-hf-view-")
    (Path(view) / "config.json").write_text(json.dumps(read_megatron_meta(checkpoint)["hf_config"]))
    copy_hf_side_files(checkpoint, view)
    return view


def megatron_checkpoint_to_hf(src, hf_config=None) -> tuple[dict, dict]:
    """(HF config, {HF name: tensor}) of a chatgen Megatron checkpoint, whatever its TP x PP (x
    DP), in memory; with `hf_config` (an HF directory or config.json: the architecture) also of a
    Megatron-LM distributed checkpoint, which carries no chatgen_megatron.json."""
    src = Path(src)
    meta = read_megatron_meta(src)
    if meta is None and hf_config is not None and dcp.is_dist_checkpoint(src):
        config_file = (
            Path(hf_config) / "config.json" if Path(hf_config).is_dir() else Path(hf_config)
        )
        meta = {"hf_config": json.loads(config_file.read_text()), "distributed": True}
    if meta is None:
        hint = (
            " (a megatron-core distributed checkpoint without one, e.g. Megatron-LM's: pass --hf-config with the "
            "HF model of its architecture)"
            if dcp.is_dist_checkpoint(src)
            else ""
        )
        raise FileNotFoundError(
            f"{src}: not a chatgen Megatron checkpoint (no chatgen_megatron.json){hint}"
        )
    spec = models.spec_from_hf_config(meta["hf_config"])
    if meta.get("distributed"):
        hf = layout.megatron_to_hf({(0, 0): dist_checkpoint_state(src, spec)}, spec, 1, 1)
        if (src / lora_format.CHECKPOINT_DIR).is_dir():  # a LoRA trainer's: W + (alpha / r) B A
            lora_format.merge_peft(hf, src / lora_format.CHECKPOINT_DIR)
        return meta["hf_config"], hf
    tp, pp = meta["tensor_model_parallel_size"], meta["pipeline_model_parallel_size"]
    shards = {(p, t): read_megatron_shard(src, t, p) for p in range(pp) for t in range(tp)}
    return meta["hf_config"], layout.megatron_to_hf(shards, spec, tp, pp)


# megatron-core names the two norms of a layer as Transformer Engine fuses them into the next
# linear, in its checkpoints whatever the layer spec, and in the model itself under the Transformer
# Engine spec; chatgen's parameter mappings use the local spec's names
TE_NORM_NAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}


def dist_checkpoint_state(src, spec) -> dict:
    """{local-spec name: tensor} of the whole model (TP = PP = 1) in a megatron-core distributed
    checkpoint, whatever layout saved it: every tensor whole
    (chatgen.core.dcp.read_full_tensors); the checkpoint stacks each layer parameter of the
    decoder into one (num_layers, ...) tensor, and a mixture-of-experts layer's experts into one
    (num_layers, num_experts, ...) tensor."""
    full = dcp.read_full_tensors(src, skip=("optimizer.", "chained_"))
    state = {}
    for sp in layout.stage_params(spec, 1, 0):
        expert = re.fullmatch(
            r"decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.(.+)", sp.local_name
        )
        layer = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", sp.local_name)
        if expert:  # the experts of every layer stacked: (num_layers, num_experts, ...)
            key, index = (
                f"decoder.layers.mlp.experts.experts.{expert[3]}",
                (int(expert[1]), int(expert[2])),
            )
        elif layer:
            key, index = f"decoder.layers.{TE_NORM_NAMES.get(layer[2], layer[2])}", (int(layer[1]),)
        else:
            key, index = sp.local_name, ()
        if key not in full:
            raise KeyError(
                f"{src}: the distributed checkpoint has no {key} (for {sp.local_name}); it holds "
                f"{sorted(full)[:20]}: is it a {spec.family} model of this config?"
            )
        state[sp.local_name] = full[key][index]
    return state
