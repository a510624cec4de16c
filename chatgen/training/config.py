"""The trainer's per-model config: `MegatronConfig`, the keys a `backend: megatron` model reads
(docs/megatron_module.md)."""

import dataclasses
import json
from pathlib import Path
from typing import Any, ClassVar, Literal, Optional

from chatgen.config import DTYPES, USER_KEYS_DOC, args_problem, opt

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(kw_only=True)
class LoRAConfig:
    """`lora:` of a trainer model: low-rank adapters on the frozen base
    (chatgen/training/lora.py, docs/lora.md)."""

    rank: int = opt(
        0, "adapter rank r (verl: lora_rank; PEFT: r); 0 = no LoRA, every parameter trains"
    )
    alpha: float = opt(
        16.0, "the adapter's output is scaled by alpha / rank (verl: lora_alpha; PEFT: lora_alpha)"
    )
    dropout: float = opt(0.0, "dropout on the adapter's input while training (PEFT: lora_dropout)")
    target_modules: list[str] = opt(
        list(LORA_TARGETS),
        "HF names of the linear layers to adapt (verl / PEFT: target_modules); a q/k/v or gate/up target "
        "adapts only its slice of Megatron's fused layer",
    )
    from_peft: Optional[str] = opt(
        None,
        "a PEFT adapter directory (adapter_config.json + adapter_model.safetensors) to start from when `load` "
        "is an HF model; null = a fresh adapter (B = 0: the run starts at the base model)",
        path=True,
    )

    def check(self):
        if self.rank < 0:
            yield "rank", f"must be > 0 (or 0 = no LoRA), got {self.rank}; 8 or 16 are usual"
        if self.rank and self.alpha <= 0:
            yield (
                "alpha",
                f"must be > 0, got {self.alpha}; 2 x rank (e.g. {2 * self.rank}) is usual",
            )
        if not 0 <= self.dropout < 1:
            yield "dropout", f"must be in [0, 1), got {self.dropout}; 0 or 0.05 are usual"
        unknown = [t for t in self.target_modules if t not in LORA_TARGETS]
        if unknown:
            yield (
                "target_modules",
                f"{unknown}: not a LoRA target; use some of {list(LORA_TARGETS)} (HF names)",
            )
        if self.rank and not self.target_modules:
            yield "target_modules", f"is empty; name some of {list(LORA_TARGETS)}"


@dataclasses.dataclass(kw_only=True)
class MegatronConfig:
    # What a resumed trainer takes from its checkpoint, not from these keys: the weights, the RNG
    # streams, the optimizer's state and the LR schedule's. A resume that changes one of them is
    # refused (chatgen.rlhf.run): the run would go on with the saved value while
    # resolved_config.yaml showed the new one.
    RESTORED_BY_CHECKPOINT: ClassVar[tuple] = (
        "load",
        "seed",
        "lr",
        "min_lr",
        "weight_decay",
        "adam_beta1",
        "adam_beta2",
        "adam_eps",
        "lr_warmup_iters",
        "lr_decay_iters",
        "lora",  # the adapters' shapes and scale are in the checkpoint
    )

    load: Optional[str] = opt(
        None, "Hugging Face model directory or Megatron checkpoint to start from", path=True
    )
    dtype: DTYPES = opt(
        "float32",
        "parameter and compute dtype (bfloat16/float16: the optimizer keeps fp32 masters)",
    )
    seed: int = opt(1234, "initialisation and dropout seed")
    tensor_model_parallel_size: int = opt(1, "tensor-parallel ranks")
    pipeline_model_parallel_size: int = opt(1, "pipeline-parallel stages")
    data_parallel_size: Optional[int] = opt(
        None,
        "data-parallel replicas: the model runs on TP x PP x DP ranks, each replica on its share of a batch; "
        "null = num_gpu / (TP x PP) on GPUs, on CPU expert_model_parallel_size (1 for a dense model)",
    )
    expert_model_parallel_size: int = opt(
        1,
        "expert-parallel ranks of a mixture-of-experts model: each holds num_experts / EP experts of every layer "
        "(taken out of the data-parallel ranks: world = TP x PP x DP, EP divides DP)",
    )
    moe_aux_loss_coeff: float = opt(
        0.0,
        "weight of the router load-balancing loss (Switch Transformer's) of a mixture-of-experts model, added "
        "to train_step's loss; 0 = none",
    )
    moe_routing_replay: bool = opt(
        False,
        "compute every MoE layer with the experts the engine chose for each token (the batch's routed_experts: "
        "the generation model needs return_routed_experts) instead of routing again",
    )
    overlap_grad_reduce: bool = opt(
        False,
        "reduce gradient buckets over DP while the backward of the last micro-batch still runs (megatron-core "
        "DDP); pays off on GPUs with DP > 1",
    )
    activation_recompute: Literal["none", "selective", "full"] = opt(
        "none",
        "recompute activations in the backward instead of keeping them (megatron's recompute_granularity): "
        "selective = each layer's attention scores and softmax (most of the memory of long sequences, little "
        "compute), full = every layer's whole forward from its input (least memory, ~1/3 more compute)",
    )
    recompute_num_layers: Optional[int] = opt(
        None,
        "with activation_recompute: full, only the first N layers of each pipeline stage recompute "
        "(megatron's recompute_method: block); null = every layer. A dial between none and full: "
        "N/layers of full's memory saving for N/layers of its extra compute",
    )
    sequence_parallel: bool = opt(
        False,
        "with tensor_model_parallel_size > 1: split the norms' and dropouts' activations over the TP ranks "
        "along the sequence (megatron's sequence_parallel; same loss, 1/TP of that memory)",
    )
    grad_reduce_dtype: Optional[DTYPES] = opt(
        None,
        "dtype of the gradient buffers and their reduction over DP: float32 (null: the default, micro-batches "
        "accumulate without rounding) or the parameters' own dtype (half the memory and traffic)",
    )
    offload_params: bool = opt(
        True,
        "colocated on GPUs with a vLLM engine: keep the weights in host memory while the engine generates",
    )
    offload_grads: bool = opt(True, "the same for the gradient buffers")
    offload_optimizer: bool = opt(
        True, "the same for the optimizer state (fp32 main weights, Adam moments)"
    )
    seq_length: Optional[int] = opt(
        None,
        "longest sample (prompt + response) in tokens; longer batches are an error; null = max_position_embeddings",
    )
    micro_batch_size: Optional[int] = opt(
        None, "samples per forward/backward; null = runtime.train_micro_batch_size"
    )
    max_tokens_per_micro_batch: Optional[int] = opt(
        None,
        "micro-batches by tokens (verl: use_dynamic_bsz + ppo_max_token_len_per_gpu): whole samples (a DPO "
        "pair, a packed group sharing its prompt) binned into micro-batches of at most this many tokens, "
        "packed into one row each where the trainer packs; the loss weighted to the global batch's token "
        "or sample mean (docs/long_context.md); null = micro_batch_size samples each",
    )
    logits_temperature: Optional[float] = opt(
        None,
        "score tokens under softmax(logits / T); null = 1, or in an RLHF run the policy's sampling "
        "temperature for the trainers whose role scores its samples (policy_trainer, reference)",
    )
    logits_top_k: Optional[int] = opt(
        None,
        "score tokens under the top-k of softmax(logits / T), renormalised (vLLM's truncation; the "
        "scored token always stays); null or <= 0 = off; an RLHF run derives it from the policy's top_k",
    )
    logits_top_p: Optional[float] = opt(
        None,
        "the same for top-p (after top-k, as vLLM); null or 1.0 = off; derived from the policy's top_p",
    )
    global_batch_size: Optional[int] = opt(
        None,
        "samples per optimizer step over all DP ranks (train_step checks it); null = runtime.train_global_batch_size",
    )
    pack_shared_prefix: bool = opt(
        True,
        "train_step (and forward_tokens given a loss_mask) runs each prompt a group's samples share once, "
        "groups sharing packed rows no wider than the longest (same loss and gradients); false = one row per "
        "sample",
    )
    optimizer: Literal["adam", "muon"] = opt(
        "adam",
        "adam: AdamW (megatron's distributed one on backend: megatron); muon: torch.optim.Muon on the "
        "hidden matrices and AdamW on the rest (chatgen/training/muon.py), backend: fsdp only",
    )
    lr: float = opt(1e-6, "peak learning rate")
    min_lr: float = opt(0.0, "learning rate at the end of the decay")
    weight_decay: float = opt(0.0, "AdamW weight decay")
    adam_beta1: float = opt(0.9, "AdamW beta1")
    adam_beta2: float = opt(0.999, "AdamW beta2")
    adam_eps: float = opt(1e-8, "AdamW epsilon")
    clip_grad: float = opt(1.0, "clip the global gradient norm to this; 0 = no clipping")
    lr_warmup_iters: int = opt(0, "optimizer steps of linear warm-up")
    lr_decay_iters: Optional[int] = opt(
        None, "optimizer steps of cosine decay from lr to min_lr after warm-up; null = constant lr"
    )
    make_vocab_size_divisible_by: int = opt(
        128, "pad the embedding rows to a multiple of this (times TP size)"
    )
    lora: LoRAConfig = opt(
        LoRAConfig, "low-rank adapters on the frozen base (docs/lora.md); off while lora.rank is 0"
    )
    args: dict[str, Any] = opt({}, USER_KEYS_DOC)

    def check(self):
        if self.optimizer == "muon" and type(self) is MegatronConfig:
            yield (
                "optimizer",
                "muon orthogonalises whole weight matrices, and megatron's distributed optimizer "
                "holds each weight as flat slices over the data-parallel ranks (megatron-core's "
                "own Muon needs the emerging_optimizers package and no distributed optimizer); "
                "use optimizer: adam on this backend, or backend: fsdp, whose trainer takes "
                "optimizer: muon (docs/algorithms.md, Muon)",
            )
        if self.recompute_num_layers is not None and (
            self.activation_recompute != "full" or self.recompute_num_layers < 1
        ):
            yield (
                "recompute_num_layers",
                f"{self.recompute_num_layers} with activation_recompute: "
                f"{self.activation_recompute}; it takes a number of layers >= 1 and "
                "activation_recompute: full (or remove the key)",
            )
        if self.logits_temperature is not None and self.logits_temperature <= 0:
            yield "logits_temperature", f"must be > 0 or null, got {self.logits_temperature}"
        if self.logits_top_p is not None and not 0 < self.logits_top_p <= 1:
            yield "logits_top_p", f"must be in (0, 1] or null, got {self.logits_top_p}"
        for key in (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "expert_model_parallel_size",
            "make_vocab_size_divisible_by",
        ):
            if getattr(self, key) < 1:
                yield key, f"must be >= 1, got {getattr(self, key)}; set a positive integer"
        if self.data_parallel_size is not None and self.data_parallel_size < 1:
            yield (
                "data_parallel_size",
                f"must be >= 1 or null, got {self.data_parallel_size}; null derives it",
            )
        if self.seq_length is not None and self.seq_length < 1:
            yield (
                "seq_length",
                f"must be >= 1 or null, got {self.seq_length}; null takes max_position_embeddings",
            )
        for key in ("micro_batch_size", "global_batch_size"):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                yield (
                    key,
                    f"must be >= 1 or null, got {getattr(self, key)}; null takes the runtime's value",
                )
        if (budget := self.max_tokens_per_micro_batch) is not None:
            if budget < 1:
                yield "max_tokens_per_micro_batch", f"must be >= 1 or null, got {budget}"
            for key in ("pipeline_model_parallel_size", "expert_model_parallel_size"):
                if getattr(self, key) > 1:
                    yield (
                        "max_tokens_per_micro_batch",
                        f"needs {key}: 1 (its stages / expert ranks exchange micro-batches of one "
                        "shape, and token bins differ in shape); set it to null or the key to 1",
                    )
        if (
            self.micro_batch_size
            and self.global_batch_size
            and self.global_batch_size % self.micro_batch_size
        ):
            yield (
                "global_batch_size",
                (
                    f"{self.global_batch_size} is not a multiple of micro_batch_size="
                    f"{self.micro_batch_size}; make it one"
                ),
            )
        if not 0 < self.lr <= 1:
            yield (
                "lr",
                f"must be in (0, 1], got {self.lr}; LLM fine-tuning uses about 1e-7 to 1e-3 (e.g. 1e-6)",
            )
        if not 0 <= self.min_lr <= self.lr:
            yield "min_lr", f"must be in [0, lr={self.lr}], got {self.min_lr}; lower it"
        for key in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, key) < 1:
                yield key, f"must be in [0, 1), got {getattr(self, key)}; 0.9 / 0.999 are usual"
        for key in (
            "weight_decay",
            "adam_eps",
            "clip_grad",
            "lr_warmup_iters",
            "moe_aux_loss_coeff",
        ):
            if getattr(self, key) < 0:
                yield key, f"must be >= 0, got {getattr(self, key)}; set a non-negative value"
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            yield (
                "sequence_parallel",
                (
                    "needs tensor_model_parallel_size > 1 (it splits activations over the TP "
                    "ranks); set it to false or raise tensor_model_parallel_size"
                ),
            )
        if self.grad_reduce_dtype not in (None, "float32", self.dtype):
            yield (
                "grad_reduce_dtype",
                (
                    f"{self.grad_reduce_dtype} with dtype {self.dtype}: gradients reduce in "
                    f"float32 or in the parameters' dtype; set float32, {self.dtype} or null"
                ),
            )
        if self.lora.rank and self.sequence_parallel:
            yield (
                "lora",
                "LoRA with sequence_parallel is not supported (the adapters read the full sequence); set "
                "sequence_parallel: false or lora.rank: 0",
            )
        if problem := args_problem(self):
            yield "args", problem


# Keys of MegatronConfig an fsdp trainer has no use for, at the only value it runs them with, and
# the fix.
MEGATRON_ONLY = {
    "tensor_model_parallel_size": (1, "FSDP shards every parameter over all ranks (data parallel)"),
    "pipeline_model_parallel_size": (1, "FSDP runs the whole model on every rank"),
    "expert_model_parallel_size": (1, "FSDP shards the experts like every other weight"),
    "sequence_parallel": (False, "it needs tensor parallelism"),
    "moe_routing_replay": (False, "routing replay patches megatron-core's router"),
    "moe_aux_loss_coeff": (0.0, "the load-balancing loss is added by megatron-core's router"),
    "overlap_grad_reduce": (False, "FSDP2 overlaps its reduce-scatters by itself"),
    "grad_reduce_dtype": (None, "FSDP reduces in float32 (dtype: bfloat16 is mixed precision)"),
    "recompute_num_layers": (None, "FSDP checkpoints every layer with activation_recompute: full"),
}


@dataclasses.dataclass(kw_only=True)
class FSDPConfig(MegatronConfig):
    """The keys of a `backend: fsdp` trainer (chatgen/training/fsdp_module.py,
    docs/fsdp_backend.md): MegatronConfig's, where they mean the same (load, dtype, optimizer,
    batch sizes, offload_*, seq_length, activation_recompute), plus FSDP2's own. dtype
    bfloat16/float16 is mixed precision: fp32 parameters and optimizer state, computation in the
    dtype, gradients reduced in fp32."""

    reshard_after_forward: bool = opt(
        True,
        "free each layer's gathered weights after its forward and gather them again for the backward "
        "(FSDP2's default, ZeRO-3 memory); false keeps them until the backward (ZeRO-2-like: less "
        "communication, the full weights in memory during a step)",
    )
    context_parallel_size: int = opt(
        1,
        "ranks each sequence is split over (torch's ring attention; verl's "
        "ulysses_sequence_parallel_size, NeMo RL's context_parallel_size): CUDA only and not yet "
        "run, refused on CPU (docs/long_context.md)",
    )

    def check(self):
        yield from super().check()
        if self.context_parallel_size < 1:
            yield "context_parallel_size", f"must be >= 1, got {self.context_parallel_size}"
        if self.context_parallel_size > 1 and self.max_tokens_per_micro_batch is not None:
            yield (
                "max_tokens_per_micro_batch",
                "token micro-batches pack samples into one row, which the context-parallel split "
                "does not take; remove the key or set context_parallel_size: 1",
            )
        for key, (allowed, why) in MEGATRON_ONLY.items():
            if getattr(self, key) != allowed:
                yield (
                    key,
                    f"{getattr(self, key)} is a Megatron-only setting ({why}); remove the key for "
                    "backend: fsdp, or set backend: megatron to use it",
                )
        if self.activation_recompute == "selective":
            yield (
                "activation_recompute",
                "selective recomputation is megatron-core's; backend: fsdp checkpoints whole layers: "
                "set full (or none)",
            )
        if self.load and (problem := hf_family_problem(self.load)):
            yield "load", problem


# Families transformers trains but a weight sync cannot serve, each with why (measured on vLLM 0.32
# CPU).
ENGINE_REFUSED = {
    "deepseek_v3": "vLLM's CPU path fails on its multi-head latent attention (a shape error)",
    "deepseek_v2": "vLLM's CPU path fails on its multi-head latent attention (a shape error)",
}


def hf_family_problem(load) -> str | None:
    """Why an fsdp trainer cannot take the model at `load` (an HF directory, or a checkpoint an
    fsdp trainer wrote: both hold config.json), or None: a model_type transformers has no causal
    LM for, one whose transformers code renames the checkpoint's weights as it loads them (the
    names an engine takes would differ from the model's), or one the engine cannot serve
    (ENGINE_REFUSED). A missing config.json is left to the trainer's start, which names the path."""
    config = Path(load) / "config.json"
    if not config.is_file():
        return None
    model_type = json.loads(config.read_text()).get("model_type")
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type in ENGINE_REFUSED:
        return (
            f"{load}: model_type {model_type!r} is refused: {ENGINE_REFUSED[model_type]}; pick a family "
            "of docs/models.md"
        )
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return (
            f"{load}: model_type {model_type!r} has no causal LM in transformers; backend: fsdp trains "
            "AutoModelForCausalLM models (docs/models.md lists the tested families)"
        )
    if get_checkpoint_conversion_mapping(model_type):
        return (
            f"{load}: model_type {model_type!r} is renamed by transformers as it loads (its experts "
            "fused), so its parameters are not the checkpoint's names a weight sync sends; train it "
            "with backend: megatron"
        )
    return None
