"""Per-GPU memory of a Megatron trainer step and of a vLLM engine beside it: one pure function each,
no torch.

    from chatgen.training.memory_estimate import Shape, trainer_memory, engine_memory
    shape = Shape.from_hf_config(json.load(open("Qwen2.5-7B/config.json")))
    trainer_memory(shape, tp=4, dp=2, seq_length=2048, micro_batch_size=4, dtype="bfloat16")   # {part: bytes}

`chatgen config` prints both for a run (chatgen.rlhf.memory) and warns when a phase exceeds the
device; docs/scaling.md's tables come from them. What is counted (bytes per GPU, the worst pipeline
stage):
- weights: parameters / (TP x PP) in `dtype` (the first stage also holds the embedding, the last the
  output layer);
- gradients: the same count in float32 (megatron's DDP buffers; `grad_reduce_dtype` = dtype: 2
  bytes);
- optimizer: Adam's two float32 moments, plus float32 master weights under bf16/fp16, / DP
  (distributed optimizer);
- activations: what the backward keeps, per layer and micro-batch, after Korthikanti et al. 2022
  ("Reducing Activation Recomputation in Large Transformer Models", table 2): s·b·h·(10 + 24/t +
  5·a·s/(h·t)) bytes in 16-bit (34/t instead of 10 + 24/t with sequence parallelism; selective
  recompute drops the a·s term; full keeps 2·s·b·h per layer, /t with SP, plus one layer's full set
  while it is recomputed), x the layers (with PP, 1F1B keeps PP micro-batches of L/PP layers in
  flight on the first stage: L layers' worth), doubled for float32; the formula is for GPT's 4h MLP
  and multi-head attention: SwiGLU and grouped KV heads change it by ~10%;
- logits: float32 logits and their log-softmax over the vocabulary / TP for every token of a
  micro-batch.
Not counted: the CUDA context and NCCL buffers (~1-2 GB a process), allocator fragmentation,
temporary buffers of the optimizer step. Treat the figures as +-20%.
"""

import dataclasses

BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Shape:
    """A decoder-only transformer's sizes (what the estimate needs of an HF config.json)."""

    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool = False
    head_dim: int | None = None

    @classmethod
    def from_hf_config(cls, c: dict) -> "Shape":
        return cls(
            layers=c["num_hidden_layers"],
            hidden=c["hidden_size"],
            ffn=c["intermediate_size"],
            heads=c["num_attention_heads"],
            kv_heads=c.get("num_key_value_heads") or c["num_attention_heads"],
            vocab=c["vocab_size"],
            tied=bool(c.get("tie_word_embeddings")),
            head_dim=c.get("head_dim"),
        )

    @property
    def dim(self) -> int:
        return self.head_dim or self.hidden // self.heads

    def layer_params(self) -> int:
        attention = self.hidden * self.dim * (2 * self.heads + 2 * self.kv_heads)  # q, o; k, v
        return attention + 3 * self.hidden * self.ffn + 2 * self.hidden  # SwiGLU MLP, two norms

    def params(self) -> int:
        return (
            self.layers * self.layer_params()
            + self.vocab * self.hidden * (1 if self.tied else 2)
            + self.hidden
        )

    def kv_bytes_per_token(self, dtype: str = "bfloat16") -> int:
        return 2 * self.layers * self.kv_heads * self.dim * BYTES[dtype]


def activation_bytes(
    shape: Shape,
    seq_length: int,
    micro_batch_size: int,
    tp: int = 1,
    dtype: str = "bfloat16",
    recompute: str = "none",
    sequence_parallel: bool = False,
    recompute_layers: int | None = None,
) -> int:
    """Activation memory the backward needs on one GPU (see the module docstring), in bytes.
    recompute_layers: with recompute full, only that many layers recompute (recompute_num_layers);
    the others keep all of theirs."""
    s, b, h, a, t = seq_length, micro_batch_size, shape.hidden, shape.heads, tp
    scale = BYTES[dtype] / 2  # the formula counts 16-bit activations
    per_token = 34 / t if sequence_parallel else 10 + 24 / t
    whole_layer = s * b * h * (per_token + 5 * a * s / (h * t))
    if recompute == "full":
        n = shape.layers if recompute_layers is None else min(recompute_layers, shape.layers)
        kept = 2 * s * b * h / (t if sequence_parallel else 1)
        return int(scale * (n * kept + (shape.layers - n + 1) * whole_layer))
    attention = 0 if recompute == "selective" else 5 * a * s / (h * t)
    return int(scale * shape.layers * s * b * h * (per_token + attention))


def trainer_memory(
    shape: Shape,
    *,
    tp: int = 1,
    pp: int = 1,
    dp: int = 1,
    seq_length: int,
    micro_batch_size: int = 1,
    dtype: str = "bfloat16",
    grad_reduce_dtype: str | None = None,
    recompute: str = "none",
    sequence_parallel: bool = False,
    recompute_layers: int | None = None,
) -> dict:
    """{weights, gradients, optimizer, activations, logits, total}: bytes on the busiest GPU of a
    training step."""
    layers = -(-shape.layers // pp) * shape.layer_params()
    embedding = shape.vocab * shape.hidden
    # first stage; the last is no bigger
    stage = layers + embedding * (1 if pp > 1 or shape.tied else 2)
    params = stage / tp
    grad = BYTES[grad_reduce_dtype or "float32"]
    optimizer = (8 + (4 if dtype != "float32" else 0)) * params / dp
    out = dict(
        weights=params * BYTES[dtype],
        gradients=params * grad,
        optimizer=optimizer,
        activations=activation_bytes(
            shape,
            seq_length,
            micro_batch_size,
            tp,
            dtype,
            recompute,
            sequence_parallel,
            recompute_layers,
        ),
        logits=2 * 4 * seq_length * micro_batch_size * shape.vocab / tp,
    )
    out = {k: int(v) for k, v in out.items()}
    out["total"] = sum(out.values())
    return out


def engine_memory(
    shape: Shape,
    *,
    tp: int = 1,
    dtype: str = "bfloat16",
    device_bytes: int,
    gpu_memory_utilization: float = 0.9,
) -> dict:
    """{weights, kv_cache, kv_tokens, total}: a vLLM engine rank's share (vLLM takes
    gpu_memory_utilization of the device and fills what its weights leave with KV cache; ~1 GB of
    it goes to CUDA graphs and activations)."""
    total = int(gpu_memory_utilization * device_bytes)
    weights = shape.params() * BYTES[dtype] // tp
    kv = max(0, total - weights - GIB)
    return dict(
        weights=weights,
        kv_cache=kv,
        kv_tokens=kv // (shape.kv_bytes_per_token(dtype) // tp),
        total=total,
    )
