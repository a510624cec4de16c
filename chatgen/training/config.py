"""The trainer's per-model config: `MegatronConfig`, the keys a `backend: megatron` model reads (docs/megatron_module.md)."""
import dataclasses
from typing import Any, Optional

from chatgen.config import DTYPES, USER_KEYS_DOC, args_problem, opt


@dataclasses.dataclass(kw_only=True)
class MegatronConfig:
    load: Optional[str] = opt(None, "Hugging Face model directory or Megatron checkpoint to start from", path=True)
    dtype: DTYPES = opt("float32", "parameter and compute dtype (bfloat16/float16: the optimizer keeps fp32 masters)")
    seed: int = opt(1234, "initialisation and dropout seed")
    tensor_model_parallel_size: int = opt(1, "tensor-parallel ranks")
    pipeline_model_parallel_size: int = opt(1, "pipeline-parallel stages")
    seq_length: Optional[int] = opt(
        None, "longest sample (prompt + response) in tokens; longer batches are an error; null = max_position_embeddings")
    micro_batch_size: Optional[int] = opt(None, "samples per forward/backward; null = runtime.train_micro_batch_size")
    global_batch_size: Optional[int] = opt(
        None, "samples per optimizer step over all DP ranks (train_step checks it); null = runtime.train_global_batch_size")
    pack_shared_prefix: bool = opt(
        True, "train_step runs each prompt a group's samples share once (one packed row per group; same loss and "
              "gradients); false = one row per sample")
    lr: float = opt(1e-6, "peak learning rate")
    min_lr: float = opt(0.0, "learning rate at the end of the decay")
    weight_decay: float = opt(0.0, "AdamW weight decay")
    adam_beta1: float = opt(0.9, "AdamW beta1")
    adam_beta2: float = opt(0.999, "AdamW beta2")
    adam_eps: float = opt(1e-8, "AdamW epsilon")
    clip_grad: float = opt(1.0, "clip the global gradient norm to this; 0 = no clipping")
    lr_warmup_iters: int = opt(0, "optimizer steps of linear warm-up")
    lr_decay_iters: Optional[int] = opt(None, "optimizer steps of cosine decay from lr to min_lr after warm-up; null = constant lr")
    make_vocab_size_divisible_by: int = opt(128, "pad the embedding rows to a multiple of this (times TP size)")
    args: dict[str, Any] = opt({}, USER_KEYS_DOC)

    def check(self):
        for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "make_vocab_size_divisible_by"):
            if getattr(self, key) < 1:
                yield key, f"must be >= 1, got {getattr(self, key)}; set a positive integer"
        if self.seq_length is not None and self.seq_length < 1:
            yield "seq_length", f"must be >= 1 or null, got {self.seq_length}; null takes max_position_embeddings"
        for key in ("micro_batch_size", "global_batch_size"):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                yield key, f"must be >= 1 or null, got {getattr(self, key)}; null takes the runtime's value"
        if self.micro_batch_size and self.global_batch_size and self.global_batch_size % self.micro_batch_size:
            yield "global_batch_size", (f"{self.global_batch_size} is not a multiple of micro_batch_size="
                                        f"{self.micro_batch_size}; make it one")
        if not 0 < self.lr <= 1:
            yield "lr", f"must be in (0, 1], got {self.lr}; LLM fine-tuning uses about 1e-7 to 1e-3 (e.g. 1e-6)"
        if not 0 <= self.min_lr <= self.lr:
            yield "min_lr", f"must be in [0, lr={self.lr}], got {self.min_lr}; lower it"
        for key in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, key) < 1:
                yield key, f"must be in [0, 1), got {getattr(self, key)}; 0.9 / 0.999 are usual"
        for key in ("weight_decay", "adam_eps", "clip_grad", "lr_warmup_iters"):
            if getattr(self, key) < 0:
                yield key, f"must be >= 0, got {getattr(self, key)}; set a non-negative value"
        if problem := args_problem(self):
            yield "args", problem
