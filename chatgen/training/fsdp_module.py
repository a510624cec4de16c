"""`FSDPModule`: the trainer contract of `MegatronModule` on any Hugging Face causal LM, sharded
with torch's FSDP2 (`backend: fsdp`; docs/fsdp_backend.md).

    from chatgen.training.fsdp_module import FSDPModule
    trainer = FSDPModule(dict(load="outputs/tiny-llama", lr=1e-5)).start()
    logprobs = trainer.forward_tokens({"input_ids": ids})    # (B, T) -> (B, T-1) log-probs
    metrics = trainer.train_step(batch, loss_fn)             # one optimizer step
    for bucket in trainer.hf_weights().buckets(): ...        # weights as HF tensors (chatgen.param_sync)

The model is transformers' own `AutoModelForCausalLM` code for the checkpoint in `config.load`, so
any family transformers implements trains without a mapping (what a weight sync cannot serve is
refused when the config is checked: chatgen.training.config.hf_family_problem). `fully_shard` wraps
each decoder layer and then the whole model over every rank of the world (all ranks are
data-parallel; gloo on CPU, NCCL on GPU): each rank keeps 1/DP of every weight, gradient and Adam
moment, gathers a layer's weights for its forward and backward, and reduce-scatters (averages) its
gradients. Every method is collective, as MegatronModule's: call it on every rank with that rank's
share of the batch.

The contract matches MegatronModule's (same keys, hooks, declared methods and returns):
`token_outputs` at the config's `logits_temperature` (chatgen.training.token_scoring), micro-batches
from chatgen.training.micro_batches handed to the `loss_fn` as they come (token micro-batches
packed into one row each: a block-diagonal 4D mask, positions per sample), a NaN/inf gradient
skips the step, `offload` / `onload` / `memory_stats`, atomic checkpoints
(torch.distributed.checkpoint: every rank writes its own shards; a checkpoint loads at another DP).
"""

import math
from pathlib import Path

import torch
import torch.distributed as dist

from chatgen.core.checkpoint_io import read_hf_config
from chatgen.core.distributed import join_world
from chatgen.core.metrics import reduce_metrics
from chatgen.core.tensors import DEFAULT_BUCKET_BYTES
from chatgen.module import remote
from chatgen.training.config import FSDPConfig
from chatgen.training.context_parallel import CPU_REFUSAL, cp_meshes, cp_token_outputs, group_batch
from chatgen.training.fsdp_checkpoints import FSDP_META, FSDPCheckpoints
from chatgen.training.fsdp_lora import FSDPLoRAHooks, FSDPMergedWeights, attach
from chatgen.training.fsdp_weights import FSDPWeights
from chatgen.training.memory import MemoryHandoff, move_optimizer_state
from chatgen.training import muon
from chatgen.training.model_build import lr_factor
from chatgen.training.micro_batches import padding_positions, weighted_metrics
from chatgen.training.prefix_packing import pack_shared_prefix
from chatgen.training.schedule import first_scored_position, positions_and_mask
from chatgen.training.token_scoring import TokenScoring
from chatgen.training.trainer import Trainer


class FSDPModule(FSDPCheckpoints, FSDPLoRAHooks, TokenScoring, Trainer):
    """Trainer-side base class on FSDP2 (see the module docstring). Lifecycle as
    MegatronModule's: `init()` joins torch.distributed; `setup()` builds the model
    (`model_provider`), shards it, builds AdamW and loads a checkpoint this class wrote when
    `load` is one. Then `forward_tokens` / `train_step` per batch, `hf_weights()` for a sync,
    `save_checkpoint`, `offload()` / `onload()` around a colocated engine."""

    config_class = FSDPConfig

    def __init__(
        self, config=None, *, name: str = "policy_trainer", config_dialect: str = "chatgen"
    ):
        super().__init__(config, name=name, config_dialect=config_dialect)
        self.model = None  # the transformers model, its layers and root wrapped by fully_shard
        self.optimizer = None  # torch AdamW over the DTensor shards
        self.iteration = 0  # optimizer steps taken
        self.skipped_steps = 0  # train steps skipped for a NaN/inf gradient
        # where the training state is between a colocated engine's turns
        # (chatgen/training/memory.py)
        self.memory = MemoryHandoff(self.config, fsdp_movers(self))

    # ---- lifecycle
    # --------------------------------------------------------------------------------

    def init(self) -> None:
        """Framework: join torch.distributed (every rank data-parallel); read the model's
        config.json."""
        cfg = self.config
        if cfg.load is None:
            raise ValueError(
                f"{self.name}: `load` is required (an HF model directory or a chatgen fsdp checkpoint)"
            )
        self.cp_mesh = None  # the context-parallel sub-mesh (chatgen/training/context_parallel.py)
        if cfg.context_parallel_size > 1 and self.device.type == "cpu":
            raise ValueError(f"{self.name}: {CPU_REFUSAL}")
        join_world()
        self.dp, self.dp_rank = dist.get_world_size(), dist.get_rank()
        if cfg.data_parallel_size and cfg.data_parallel_size != self.dp:
            raise ValueError(
                f"{self.name}: data_parallel_size={cfg.data_parallel_size} but {self.dp} ranks were "
                f"launched; set data_parallel_size: {self.dp} or null"
            )
        if self.dp % cfg.context_parallel_size:
            raise ValueError(
                f"{self.name}: context_parallel_size={cfg.context_parallel_size} does not divide the "
                f"{self.dp} ranks launched"
            )
        torch.manual_seed(cfg.seed)
        self.hf_config = read_hf_config(cfg.load)
        max_positions = self.hf_config.get("max_position_embeddings")
        if cfg.seq_length and max_positions and cfg.seq_length > max_positions:
            raise ValueError(
                f"{self.name}: seq_length={cfg.seq_length} is longer than the model's "
                f"max_position_embeddings={max_positions}; lower it (or null)"
            )
        self.seq_length = cfg.seq_length or max_positions
        self.dtype = getattr(torch, cfg.dtype)

    def setup(self) -> None:
        """Build the model (`model_provider`), shard it, build AdamW, and restore `load` when it
        is a checkpoint of this class. Override to add work around it and call `super().setup()`."""
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        cfg = self.config
        model = self.model_provider()
        # vLLM's Transformers backend (olmo2 and smollm3 on vLLM 0.32) swaps the __call__ of
        # transformers' base model classes for its compiling one, which reads this attribute: a
        # trainer sharing an engine's process (colocated) would fail on it. True runs the plain
        # forward.
        for module in model.modules():
            module.do_not_compile = True
        # LoRA (chatgen/training/fsdp_lora.py): PEFT's layers injected before sharding
        self.lora_targets = attach(model, cfg.lora, self.name) if cfg.lora.rank else []
        if cfg.activation_recompute == "full":  # each layer's forward again in the backward
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        if cfg.context_parallel_size > 1:
            mesh, self.cp_mesh = cp_meshes(self.device.type, self.dp, cfg.context_parallel_size)
        else:
            mesh = torch.distributed.device_mesh.init_device_mesh(self.device.type, (self.dp,))
        policy = MixedPrecisionPolicy(
            param_dtype=None if self.dtype == torch.float32 else self.dtype,
            reduce_dtype=torch.float32,
        )
        kwargs = dict(mesh=mesh, mp_policy=policy, reshard_after_forward=cfg.reshard_after_forward)
        for layer in decoder_layers(model):
            fully_shard(layer, **kwargs)
        self.model = fully_shard(model, **kwargs)
        if cfg.optimizer == "muon":  # Muon on the hidden matrices, AdamW on the rest
            self.optimizer = muon.build(
                self.model.named_parameters(),
                lr=cfg.lr,
                weight_decay=cfg.weight_decay,
                adam_betas=(cfg.adam_beta1, cfg.adam_beta2),
                adam_eps=cfg.adam_eps,
            )
        else:
            self.optimizer = torch.optim.AdamW(
                [p for p in self.model.parameters() if p.requires_grad],
                lr=cfg.lr,
                betas=(cfg.adam_beta1, cfg.adam_beta2),
                eps=cfg.adam_eps,
                weight_decay=cfg.weight_decay,
            )
        if (Path(cfg.load) / FSDP_META).is_file():
            self.load_checkpoint(cfg.load)

    @property
    def torch_optimizers(self) -> list:
        """The torch optimizers `optimizer` steps: [AdamW], or Muon's and AdamW's
        (chatgen.training.muon.MuonAdamW); what checkpoints and offloading walk."""
        return getattr(self.optimizer, "optimizers", [self.optimizer])

    def shutdown(self) -> None:
        """Release the model and the process group, so that this process can start another model.
        Safe to call twice."""
        self.model = self.optimizer = None
        if dist.is_initialized():
            dist.destroy_process_group()

    # ---- user hooks
    # -------------------------------------------------------------------------------

    def model_provider(self) -> torch.nn.Module:
        """Build the whole model on this rank, in float32 (the weights FSDP shards and AdamW
        updates; a bfloat16 `dtype` computes in bf16 through FSDP's mixed precision); called once
        by `setup()`. Default: `AutoModelForCausalLM` from `config.load` (a checkpoint of this
        class: built from its config.json, its weights restored after sharding)."""
        from transformers import AutoConfig, AutoModelForCausalLM

        load = self.config.load
        if (Path(load) / FSDP_META).is_file():
            model = AutoModelForCausalLM.from_config(
                AutoConfig.from_pretrained(load), dtype=torch.float32
            )
        else:
            model = AutoModelForCausalLM.from_pretrained(load, dtype=torch.float32)
        return model.to(self.device)

    def token_outputs(self, logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """Hook: the per-token outputs from the model's logits (b, T, V) and input_ids (b, T):
        (b, T-1) float32, entry t belongs to token t+1. Default: its log-prob under
        softmax(logits / temperature) (MegatronModule's, without vocab parallelism). Override for
        a head that is not a token distribution (a critic:
        chatgen.training.critic.FSDPCriticModule)."""
        logits = logits[:, :-1].float()
        if self.logits_temperature != 1.0:
            logits = logits / self.logits_temperature
        labels = input_ids[:, 1:]
        if self.truncates:  # top-k / top-p sampling: the engine's renormalised distribution
            logits = self.truncate(logits, labels)
        b, t = labels.shape
        return -torch.nn.functional.cross_entropy(
            logits.reshape(b * t, -1), labels.reshape(-1), reduction="none"
        ).view(b, t)

    @remote("split")
    @torch.no_grad()
    def forward_tokens(self, data: dict) -> torch.Tensor:
        """The model's per-token outputs for a batch, without gradient
        (MegatronModule.forward_tokens). data: {"input_ids": (B, T), optional "attention_mask":
        (B, T)}; returns (B, T-1) float32."""
        self.onload(("params",))
        self.model.eval()
        batch = {k: data[k] for k in ("input_ids", "attention_mask") if data.get(k) is not None}
        if self.cp_mesh is not None:  # a CP group scores its ranks' samples together
            n, r = batch["input_ids"].shape[0], self.cp_mesh.get_local_rank()
            batch = group_batch(batch, self.cp_mesh)
        plan = self.micro_batch_plan(batch, dp_group=dist.group.WORLD)
        out = [self._outputs(mb, first=0)[0] for mb in plan.micro_batches]
        if self.config.max_tokens_per_micro_batch is None:
            out = torch.cat(out)
        else:
            width = max(o.shape[1] for o in out)
            out = plan.assemble(torch.cat([pad_to(o, width) for o in out]))
        return (out if self.cp_mesh is None else out[r * n : (r + 1) * n]).cpu()  # own samples

    @remote("split")
    def train_step(self, data: dict, loss_fn) -> dict:
        """One optimizer step on `data` (this DP rank's share of the global batch), split in
        micro-batches: MegatronModule.train_step's contract (the loss averaged over micro-batches
        and DP ranks; logits only from the first position a "loss_mask" marks; returns the
        loss_fn metrics reduced over micro-batches and ranks plus "grad_norm" before clipping,
        "lr" and "skipped_step")."""
        gbs, n = self.config.global_batch_size, data["input_ids"].shape[0]
        if gbs and n * self.dp != gbs:
            raise ValueError(
                f"{self.name}.train_step: {n} samples x {self.dp} data-parallel ranks != "
                f"global_batch_size={gbs}; pass {gbs // self.dp} samples per rank or change the key"
            )
        if self.cp_mesh is not None:  # a CP group scores its ranks' samples together
            data = group_batch(data, self.cp_mesh)
        plan = self.micro_batch_plan(data, loss_fn, packs=True, dp_group=dist.group.WORLD)
        micro_batches = plan.micro_batches
        weights = self.loss_weights(plan, loss_fn, dist.group.WORLD)
        self.onload()
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        collected, padding = [], 0
        for i, mb in enumerate(micro_batches):
            mb = _on_device(mb, self.device)
            logprobs, pad = self._outputs(mb, first=first_scored_position(mb.get("loss_mask")))
            loss, metrics = loss_fn(logprobs, mb)
            (loss / len(micro_batches) if weights is None else loss * weights[i]).backward()
            padding += pad
            collected.append(
                {
                    k: float(v.detach() if torch.is_tensor(v) else v)
                    for k, v in {"loss": loss, **metrics}.items()
                }
            )
        metrics = (
            reduce_metrics(collected) if weights is None else weighted_metrics(collected, weights)
        )
        metrics["padding_tokens_trained"] = float(padding)
        if self.dp > 1:
            parts = [None] * self.dp
            dist.all_gather_object(parts, metrics)
            metrics = reduce_metrics(parts)
            metrics["padding_tokens_trained"] = sum(p["padding_tokens_trained"] for p in parts)
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)
        grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        lr = self.config.lr * lr_factor(self.config, self.iteration)
        if not math.isfinite(grad_norm):  # a NaN/inf grad would poison the weights and the engine
            self.optimizer.zero_grad(set_to_none=True)
            self.skipped_steps += 1
            metrics.update(grad_norm=grad_norm, lr=lr, skipped_step=1.0)
            return metrics
        if self.config.clip_grad > 0:
            torch.nn.utils.clip_grads_with_norm_(params, self.config.clip_grad, norm)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)  # no gradient held between steps
        self.iteration += 1
        metrics.update(grad_norm=grad_norm, lr=lr, skipped_step=0.0)
        return metrics

    def _outputs(self, mb: dict, first: int) -> tuple:
        """token_outputs (b, T-1) of a micro-batch, the logits computed from position `first` on
        (the entries before it are 0: no loss reads them), and the positions without a token the
        model ran. A token micro-batch with a loss mask runs packed in one row (its samples side
        by side, each attending only to itself and its group's shared prompt)."""
        ids = _on_device(mb, self.device)["input_ids"]
        mask = mb.get("attention_mask")
        if self.seq_length and ids.shape[1] > self.seq_length:
            raise ValueError(
                f"{self.name}: a batch of {ids.shape[1]} tokens per sample is longer than seq_length="
                f"{self.seq_length}; raise seq_length in this model's config (up to the model's "
                "max_position_embeddings) or cut prompts / responses"
            )
        mask = None if mask is None else mask.to(ids.device)
        if self.cp_mesh is not None:
            return cp_token_outputs(self, ids, mask, self.cp_mesh), padding_positions(mb)
        budget = self.config.max_tokens_per_micro_batch
        if budget and mb.get("loss_mask") is not None:
            plan = pack_shared_prefix(ids, mask, mb.get("loss_mask"), budget)
            if plan is not None:
                return self._packed_outputs(plan), padding_positions(mb, plan)
        position_ids = positions_and_mask(ids, mask)[0] if mask is not None else None
        logits = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=position_ids,
            logits_to_keep=ids.shape[1] - first,
            use_cache=False,
        ).logits
        out = self.token_outputs(logits, ids[:, first:])
        return (torch.nn.functional.pad(out, (first, 0)) if first else out), padding_positions(mb)

    def _packed_outputs(self, plan) -> torch.Tensor:
        """token_outputs (b, T-1) of a packed micro-batch (chatgen.training.prefix_packing): the
        model on its rows under the plan's block mask (a 4D additive mask, which transformers
        takes as it is) and per-sample positions, logits at the positions a loss reads."""
        blocked = torch.zeros(plan.attention_mask.shape, dtype=self.dtype, device=self.device)
        blocked = blocked.masked_fill(plan.attention_mask, torch.finfo(self.dtype).min)
        logits = self.model(
            input_ids=plan.input_ids,
            attention_mask=blocked,
            position_ids=plan.position_ids,
            use_cache=False,
        ).logits  # (P, S, V)
        at = plan.logit_positions  # (P, K + 1)
        logits = logits.gather(1, at.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))
        return plan.unpack(self.token_outputs(logits, plan.labels))

    # ---- weights, checkpoints, memory
    # -------------------------------------------------------------

    def hf_weights(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> FSDPWeights:
        """This model's weights as HF-named full tensors, bucket by bucket
        (chatgen/training/fsdp_weights.py): the weight source of chatgen.param_sync. Collective."""
        self.onload(("params",))
        return (FSDPMergedWeights if self.config.lora.rank else FSDPWeights)(self, bucket_bytes)

    def hf_state_dict(self) -> dict:
        """The whole model as an HF state dict (a full copy; for tests and exports). Collective."""
        return {name: t.clone() for bucket in self.hf_weights().buckets() for name, t in bucket}


def decoder_layers(model: torch.nn.Module) -> list:
    """The modules FSDP wraps one by one: those of the classes transformers names as never to
    split (`_no_split_modules`, e.g. LlamaDecoderLayer), else the children of the model's
    `layers` list."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if layers:
        return layers
    found = [m for n, m in model.named_modules() if n.endswith(".layers")]
    if not found:
        raise ValueError(
            f"{type(model).__name__}: no decoder layers found to shard (no _no_split_modules and no "
            "`layers` list); override FSDPModule.model_provider or use another model"
        )
    return list(found[0])


def pad_to(out: torch.Tensor, width: int) -> torch.Tensor:
    """(b, w) outputs right-padded with 0 to (b, width)."""
    return torch.nn.functional.pad(out, (0, width - out.shape[1]))


def _on_device(mb, device):
    """A micro-batch with its tensors on `device` (on the CPU: the micro-batch itself)."""
    if device.type == "cpu":
        return mb
    if hasattr(mb, "to"):
        return mb.to(device)
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in mb.items()}


def fsdp_movers(module) -> dict:
    """How an FSDPModule's pieces move (MemoryHandoff): AdamW's moments to pinned host memory and
    back; the weight shards with the model."""
    host = {}  # the optimizer's host copies, kept across offloads

    def optimizer(to_host: bool):
        move_optimizer_state(module.torch_optimizers, host, to_host, set(), module.device, pin=True)

    return {
        "optimizer": (lambda: optimizer(True), lambda: optimizer(False)),
        "params": (lambda: module.model.to("cpu"), lambda: module.model.to(module.device)),
    }
