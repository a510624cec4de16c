"""`chatgen convert`: HF checkpoint <-> chatgen Megatron checkpoint, at any TP x PP that fits the model.

    chatgen convert --to megatron --input outputs/tiny-llama --output outputs/tiny-llama-tp2pp2 --tp 2 --pp 2
    chatgen convert --to hf --input outputs/tiny-llama-tp2pp2 --output outputs/tiny-llama-back

A chatgen Megatron checkpoint is what `MegatronModule.save_checkpoint` writes and `load` accepts:
chatgen_megatron.json (HF config, TP, PP, padded vocab) + model_tp{t}_pp{p}.safetensors per rank, with
megatron-core local-spec parameter names and local layer numbers. Pure tensor index arithmetic
(chatgen/param_sync/layout.py): HF -> Megatron -> HF is bit-exact. Imports neither Megatron nor vLLM.
To change the layout of a Megatron checkpoint, convert it to HF and back.
"""
import json
import shutil
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

from chatgen.param_sync import layout

META = "chatgen_megatron.json"
HF_SIDE_FILES = ("tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "generation_config.json")


def add_arguments(p):
    p.add_argument("--to", required=True, choices=["megatron", "hf"], help="target format")
    p.add_argument("--input", required=True, help="HF directory (--to megatron) or chatgen Megatron checkpoint")
    p.add_argument("--output", required=True, help="directory to write (must not exist)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the Megatron checkpoint")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size of the Megatron checkpoint")
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="pad the vocab to a multiple of this times TP (as MegatronConfig does)")


def read_safetensors_dir(path: Path) -> dict:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files; chatgen reads HF checkpoints in safetensors")
    state = {}
    for file in files:
        with safe_open(str(file), "pt") as f:
            state.update({k: f.get_tensor(k) for k in f.keys()})
    return state


def _copy_side_files(src: Path, dst: Path) -> None:
    for name in HF_SIDE_FILES:
        if (src / name).exists():
            shutil.copy(src / name, dst / name)


def hf_to_megatron_dir(src, dst, tp: int, pp: int, divisible_by: int = 128) -> Path:
    src, dst = Path(src), Path(dst)
    hf_config = json.loads((src / "config.json").read_text())
    spec = layout.spec_from_hf_config(hf_config)
    hf = read_safetensors_dir(src)
    if spec.tie_word_embeddings and "model.embed_tokens.weight" not in hf and "lm_head.weight" in hf:
        hf["model.embed_tokens.weight"] = hf["lm_head.weight"]
    padded = spec.padded_vocab_size(tp, divisible_by)
    shards = layout.hf_to_megatron(hf, spec, tp, pp, padded)
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for (p, t), state in shards.items():
        save_file({k: v.contiguous().clone() for k, v in state.items()}, str(tmp / f"model_tp{t}_pp{p}.safetensors"))
    (tmp / META).write_text(json.dumps(dict(hf_config=hf_config, tensor_model_parallel_size=tp,
                                            pipeline_model_parallel_size=pp, padded_vocab_size=padded,
                                            iteration=0), indent=1))
    _copy_side_files(src, tmp)
    tmp.rename(dst)
    return dst


def megatron_to_hf_dir(src, dst) -> Path:
    src, dst = Path(src), Path(dst)
    if not (src / META).exists():
        raise FileNotFoundError(f"{src}: not a chatgen Megatron checkpoint (no {META})")
    meta = json.loads((src / META).read_text())
    tp, pp = meta["tensor_model_parallel_size"], meta["pipeline_model_parallel_size"]
    spec = layout.spec_from_hf_config(meta["hf_config"])
    shards = {}
    for p in range(pp):
        for t in range(tp):
            with safe_open(str(src / f"model_tp{t}_pp{p}.safetensors"), "pt") as f:
                shards[(p, t)] = {k: f.get_tensor(k) for k in f.keys()}
    hf = layout.megatron_to_hf(shards, spec, tp, pp)
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: v.contiguous().clone() for k, v in hf.items()}, str(tmp / "model.safetensors"),
              metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(meta["hf_config"], indent=2))
    _copy_side_files(src, tmp)
    tmp.rename(dst)
    return dst


def run(args) -> int:
    if Path(args.output).exists():
        raise SystemExit(f"--output {args.output} exists; choose a new directory")
    if args.to == "megatron":
        out = hf_to_megatron_dir(args.input, args.output, args.tp, args.pp, args.make_vocab_size_divisible_by)
        print(f"wrote Megatron checkpoint TP={args.tp} PP={args.pp} to {out}")
    else:
        out = megatron_to_hf_dir(args.input, args.output)
        print(f"wrote HF checkpoint to {out}")
    return 0
