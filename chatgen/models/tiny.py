"""`chatgen make-tiny-model`: build a tiny model of a chatgen family (llama, qwen2, qwen3,
qwen3_moe, mixtral) as a Hugging Face directory.

    chatgen make-tiny-model --config configs/models/tiny_llama.yaml --output outputs/tiny-llama
    chatgen make-tiny-model --config configs/models/tiny_qwen2.yaml --output outputs/tiny-qwen2 num_key_value_heads=1
    chatgen make-tiny-model --family qwen3 --output outputs/tiny-qwen3     # the built-in defaults, as a Qwen3
    chatgen make-tiny-model --family mixtral --output outputs/tiny-mixtral # 4 experts, 2 per token

The directory holds `config.json`, `model.safetensors` (fp32), `generation_config.json` and a
sentencepiece tokenizer (`tokenizer.model`, plus the `tokenizer.json` transformers converts it to)
trained on the corpus shipped in `chatgen/data/tiny_corpus.txt`. Nothing is downloaded. The result
loads with `transformers.AutoModelForCausalLM.from_pretrained(DIR)` and with `vllm.LLM(DIR)`, the
same loading code as a real checkpoint.

`--family NAME` sets the spec's `family` (the HF model_type; any of `chatgen.models.supported()`),
over `--config` and under `key=value` overrides. The HF config is transformers' own class for that
model_type (`AutoConfig.for_model`), so the maker holds no per-family code; the family module then
checks the result (`spec_from_hf`), so a spec the family refuses fails here, before anything is
built. The mixture-of-experts dials (`num_experts`, `num_experts_per_tok`, `moe_intermediate_size`)
go to the config under those names where transformers' config class for the family has them (a field
or an alias: Qwen3-MoE has all three, Mixtral the first two, its experts being `intermediate_size`
wide; dense families none), so they mean nothing to a dense family and need no per-family code
either.

Norm weights (including Qwen3's q_norm / k_norm) and QKV biases (Qwen2) are randomised rather than
left at ones/zeros, so that a layout bug in a conversion or a weight sync changes the logits instead
of hiding behind a constant.
"""

import dataclasses
import json
import os
from pathlib import Path

import yaml

from chatgen import models
from chatgen.config import load_model_config
from chatgen.core.checkpoint_io import atomic_directory

CORPUS = Path(__file__).resolve().parent.parent / "data" / "tiny_corpus.txt"
SPECIAL_TOKENS = {"unk": ("<unk>", 0), "bos": ("<s>", 1), "eos": ("</s>", 2), "pad": ("<pad>", 3)}


@dataclasses.dataclass
class TinyModelSpec:
    """The few dials of a tiny model; everything else is derived."""

    family: str = "llama"  # HF model_type: llama | qwen2 (QKV bias) | qwen3 (QK-norm) | qwen3_moe | mixtral (MoE)
    vocab_size: int = 512  # tokenizer vocabulary; the model's embedding has exactly this many rows
    hidden_size: int = 128
    intermediate_size: int = 352
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int | None = (
        None  # per attention head; None: hidden_size / num_attention_heads (filled in)
    )
    max_position_embeddings: int = 512
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    init_std: float = 0.02
    seed: int = 0
    # mixture-of-experts families only (see the module docstring)
    num_experts: int = 4  # experts per layer
    num_experts_per_tok: int = 2  # experts each token goes to
    moe_intermediate_size: int = (
        128  # one expert's SwiGLU width, where the family has the key (Qwen3-MoE)
    )

    def __post_init__(self):
        if (
            self.head_dim is None
            and self.num_attention_heads > 0
            and self.hidden_size % self.num_attention_heads == 0
        ):
            self.head_dim = self.hidden_size // self.num_attention_heads


# vLLM's CPU attention kernels accept only these head sizes.
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def validate_spec(spec: TinyModelSpec, source: str = "<spec>") -> None:
    """Every problem of the spec in one ValueError naming the keys, then the family's own check
    of the HF config."""
    errors = []
    if spec.family not in models.supported():
        errors.append(f"family: {spec.family!r} is not supported; use one of {models.supported()}")
    sizes = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
        "num_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
    )
    errors += [
        f"{key}: must be a positive integer, got {getattr(spec, key)}"
        for key in sizes
        if getattr(spec, key) < 1
    ]
    if errors:
        raise ValueError(f"{source}: invalid tiny-model spec:\n  " + "\n  ".join(errors))
    if spec.head_dim is None:
        errors.append("hidden_size: must be divisible by num_attention_heads (or set head_dim)")
    elif spec.head_dim not in VLLM_CPU_HEAD_SIZES:
        errors.append(
            f"head_dim: head size {spec.head_dim} is not supported by vLLM's CPU attention (head_dim, or "
            f"hidden_size/num_attention_heads when unset); pick sizes giving one of {VLLM_CPU_HEAD_SIZES}"
        )
    if spec.num_attention_heads % spec.num_key_value_heads:
        errors.append("num_key_value_heads: must divide num_attention_heads")
    if spec.vocab_size < 260:
        errors.append("vocab_size: must be >= 260 (256 byte-fallback pieces + 4 special tokens)")
    if not errors:
        try:
            models.spec_from_hf_config(hf_config(spec).to_dict())
        except ValueError as e:
            errors.append(f"family {spec.family}: {e}")
    if errors:
        raise ValueError(f"{source}: invalid tiny-model spec:\n  " + "\n  ".join(errors))


def load_spec(path: str | os.PathLike | None = None, overrides: list[str] = ()) -> TinyModelSpec:
    """Read a spec YAML (flat keys of TinyModelSpec, `includes:` and `${VAR}` allowed) plus
    `key=value` overrides.

    Goes through chatgen's config loader, so an unknown key names the closest valid one and every
    problem is reported at once (ConfigError); checks that need the whole spec (head size,
    divisibility) follow.
    """
    spec = load_model_config(path, TinyModelSpec, list(overrides))
    validate_spec(spec, str(path or "overrides"))
    return spec


def train_tokenizer(out_dir: Path, vocab_size: int, corpus: Path = CORPUS) -> None:
    """Train a BPE sentencepiece model (digits split, byte fallback) and write transformers'
    files."""
    import sentencepiece as spm

    spm.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(out_dir / "tokenizer"),
        vocab_size=vocab_size,
        model_type="bpe",
        split_digits=True,  # every digit is its own token: arithmetic/sorting tasks stay learnable
        byte_fallback=True,  # no <unk> on unseen characters
        character_coverage=1.0,
        num_threads=1,
        minloglevel=2,
        **{f"{name}_id": idx for name, (_, idx) in SPECIAL_TOKENS.items()},
        **{f"{name}_piece": piece for name, (piece, _) in SPECIAL_TOKENS.items()},
    )
    (out_dir / "tokenizer.vocab").unlink()
    config = {
        "tokenizer_class": "LlamaTokenizer",
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": 1 << 20,
        **{f"{name}_token": piece for name, (piece, _) in SPECIAL_TOKENS.items()},
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    # Let transformers convert the sentencepiece model once, so loaders find a ready tokenizer.json.
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(str(out_dir)).save_pretrained(str(out_dir))


MOE_KEYS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")


def hf_config(spec: TinyModelSpec):
    """The transformers config object for a spec: transformers' own config class for
    `spec.family`, with the MoE dials that class has (a field or an alias)."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[spec.family]
    known = {f.name for f in dataclasses.fields(config_class)} | set(config_class.attribute_map)
    moe = {key: getattr(spec, key) for key in MOE_KEYS if key in known}
    return AutoConfig.for_model(
        spec.family,
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        rope_theta=spec.rope_theta,
        rms_norm_eps=spec.rms_norm_eps,
        tie_word_embeddings=spec.tie_word_embeddings,
        initializer_range=spec.init_std,
        bos_token_id=SPECIAL_TOKENS["bos"][1],
        eos_token_id=SPECIAL_TOKENS["eos"][1],
        pad_token_id=SPECIAL_TOKENS["pad"][1],
        dtype="float32",
        **moe,
    )


def build_model(spec: TinyModelSpec):
    """A randomly initialised transformers model (fp32) with non-trivial norms and biases."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(hf_config(spec), dtype=torch.float32)
    gen = torch.Generator().manual_seed(spec.seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(spec.init_std * torch.randn(p.shape, generator=gen))
    return model


def make_tiny_model(spec: TinyModelSpec, output: str | os.PathLike, corpus: Path = CORPUS) -> Path:
    """Write the model directory atomically (built in a temp dir, then renamed into place)."""
    output = Path(output)
    if output.exists():
        raise FileExistsError(f"--output {output} exists; remove it or pick another directory")
    with atomic_directory(output) as tmp:
        train_tokenizer(tmp, spec.vocab_size, corpus)
        build_model(spec).save_pretrained(str(tmp), safe_serialization=True)
        (tmp / "chatgen_tiny_model.yaml").write_text(
            yaml.safe_dump(dataclasses.asdict(spec), sort_keys=False)
        )
    return output
