"""`chatgen.MegatronModule`: the trainer side of chatgen, a megatron-core GPTModel with RLHF-shaped
hooks.

    from chatgen import MegatronModule
    trainer = MegatronModule(dict(load="outputs/tiny-llama", tensor_model_parallel_size=1, lr=1e-5))
    trainer.start()                                             # init(): distributed; setup(): model + optimizer
    logprobs = trainer.forward_tokens({"input_ids": ids})    # (B, T) -> (B, T-1) log-probs
    metrics = trainer.train_step(batch, loss_fn)                # one optimizer step
    for bucket in trainer.hf_weights().buckets(): ...           # weights as HF tensors (chatgen.param_sync)

Run with several ranks (`torchrun`, `chatgen.training.launcher.run_distributed`, or Ray actors
setting RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT): `init()` joins torch.distributed (gloo on
CPU, NCCL on GPU) and builds megatron-core's TP x PP x DP groups, DP = world / (TP * PP). Every
method is collective: call it on every rank with that rank's data (ranks of one DP replica get the
same batch).

Subclass and override the hooks (`model_provider`, `setup`, `token_outputs`, `train_step`,
`save_checkpoint`, `load_checkpoint`); the default model is the HF checkpoint in `config.load` (any
family of chatgen/models), converted on the fly. Training uses megatron-core's own machinery, on CPU
(gloo) as on GPU: its `DistributedDataParallel` (gradients in contiguous buffers, reduced over DP in
buckets; its `finalize_model_grads` also sums the tied embedding across pipeline stages and QK-norm
weights over TP) and its distributed optimizer (Adam moments and, under bf16/fp16, fp32 master
weights sharded over DP ranks). Checkpoints are megatron-core distributed checkpoints: every rank
writes its own shards, and a checkpoint loads at another TP x PP x DP. `offload()` / `onload()` move
the training state to host memory and back while a colocated engine generates.
docs/megatron_module.md says more.

The class keeps the lifecycle and the train/forward steps; its other jobs are mixins in sibling
files: checkpoints.py (three formats), memory.py (offload / onload / memory_stats), moe_routing.py
(routing replay, expert figures), hf_export.py (the weights as HF tensors), packing_hooks.py
(shared-prefix packing and logit slicing), model_build.py (layer spec, DDP + distributed optimizer,
LR schedule), schedule.py (megatron-core's pipeline schedule over micro-batches).
"""

import gc
import math

import torch
import torch.distributed as dist

from chatgen import models
from chatgen.core.checkpoint_io import read_hf_config, read_megatron_meta
from chatgen.core.distributed import join_world
from chatgen.core.imports import hidden_imports
from chatgen.models import layout
from chatgen.module import remote
from chatgen.training import cpu_compat, lora, lora_peft, tied_embedding_grad
from chatgen.training.checkpoints import Checkpoints
from chatgen.training.config import MegatronConfig
from chatgen.training.hf_export import HFExport
from chatgen.training.lora_hooks import LoRAHooks
from chatgen.training.memory import MemoryHandoff, megatron_movers
from chatgen.training.model_build import ModelBuild, recompute_kwargs
from chatgen.training.moe_routing import MoERouting, RoutingReplay
from chatgen.training.packing_hooks import PackingHooks
from chatgen.training.schedule import Schedule
from chatgen.training.token_scoring import TokenScoring
from chatgen.training.trainer import Trainer

# RoutingReplay: re-exported from moe_routing
__all__ = [
    "MegatronModule",
    "RoutingReplay",
    "init_distributed",
    "release_parallel_state",
]


def init_distributed(tp: int, pp: int, dp: int | None = None, ep: int = 1) -> None:
    """Join (or start, for a single process) torch.distributed and build megatron-core's parallel
    groups; `dp` (the data_parallel_size key), when given, must be what the world makes of TP x
    PP; EP: expert-parallel ranks of a mixture-of-experts model, carved out of the data-parallel
    ones."""
    from megatron.core import parallel_state as ps

    cpu_compat.apply()
    join_world()
    world = dist.get_world_size()
    if world % (tp * pp * ep):
        raise ValueError(
            f"world size {world} is not divisible by tensor_model_parallel_size={tp} x "
            f"pipeline_model_parallel_size={pp} x expert_model_parallel_size={ep}; launch a multiple of "
            f"{tp * pp * ep} ranks"
        )
    if dp is not None and world != tp * pp * dp:
        raise ValueError(
            f"data_parallel_size={dp} needs {tp * pp * dp} ranks (TP {tp} x PP {pp} x DP {dp}), but "
            f"{world} were launched; set data_parallel_size: {world // (tp * pp)} or null, or launch "
            f"{tp * pp * dp} ranks"
        )
    if ps.model_parallel_is_initialized() and not _groups_alive(ps):
        release_parallel_state()  # the groups of a world that has ended (a vLLM engine's teardown ends it): rebuild
    if ps.model_parallel_is_initialized():
        have = (
            ps.get_tensor_model_parallel_world_size(),
            ps.get_pipeline_model_parallel_world_size(),
            ps.get_expert_model_parallel_world_size(),
        )
        if have != (tp, pp, ep):
            raise RuntimeError(
                f"megatron parallel state already built with TP, PP, EP = {have}, not {(tp, pp, ep)}; "
                "call megatron.core.parallel_state.destroy_model_parallel() first"
            )
        return
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
    )


def release_parallel_state() -> None:
    """megatron-core's destroy_model_parallel, plus what it leaves holding process groups
    (megatron-core 0.16): parallel_state globals it does not reset
    (_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP and its gloo twin), the MoE loss tracker's groups
    and RotaryEmbedding.forward's lru_cache, which keeps every rotary embedding built, with its
    cp_group, alive. Each keeps its groups' gloo threads running after the world is destroyed: a
    test session that built a trainer per test ended holding 325 threads."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    ps.destroy_model_parallel()
    get_moe_layer_wise_logging_tracker().clear()  # holds the groups its losses reduce over
    for name, value in list(vars(ps).items()):
        if name.startswith("_") and isinstance(value, dist.ProcessGroup):
            setattr(ps, name, None)
    RotaryEmbedding.forward.cache_clear()


def _groups_alive(ps) -> bool:
    """Whether megatron's parallel groups still belong to the current torch.distributed world."""
    try:
        # checks the group is registered in this world
        dist.get_rank(group=ps.get_model_parallel_group())
        return True
    except (
        ValueError,
        RuntimeError,
    ):  # "not registered": created in a world that was destroyed since
        return False


class MegatronModule(
    Checkpoints,
    HFExport,
    MoERouting,
    ModelBuild,
    TokenScoring,
    Schedule,
    LoRAHooks,
    Trainer,
):
    """Trainer-side base class: a megatron-core GPTModel sharded over TP x PP x DP, with an
    optimizer.

    Lifecycle (chatgen.module): `MegatronModule(config, name=...)` checks the config; `init()` joins
    torch.distributed and builds megatron-core's parallel groups; `setup()` builds the model with
    `model_provider`, megatron's DDP and optimizer, and loads `config.load` (weights; from a chatgen
    checkpoint also iteration and optimizer state, hence the LR schedule). `start()` does both. Then
    `forward_tokens` / `train_step` per batch, `save_checkpoint` when asked, `hf_weights()` for a
    weight sync, `offload()` / `onload()` around a colocated engine's turn on the GPU.
    """

    config_class = MegatronConfig

    def __init__(
        self, config=None, *, name: str = "policy_trainer", config_dialect: str = "chatgen"
    ):
        super().__init__(config, name=name, config_dialect=config_dialect)
        self.model = None  # this rank's GPTModel chunk
        self.ddp = None  # megatron-core's DistributedDataParallel around it (owns the grad buffers)
        self.optimizer = None  # megatron-core's distributed optimizer
        self.iteration = 0  # optimizer steps taken
        self.skipped_steps = 0  # train steps skipped for a NaN/inf gradient
        # where the training state is between a colocated engine's turns
        # (chatgen/training/memory.py)
        self.memory = MemoryHandoff(self.config, megatron_movers(self))

    # ---- lifecycle
    # --------------------------------------------------------------------------------

    def init(self) -> None:
        """Framework: join torch.distributed and build the TP x PP x DP groups; read the model's
        architecture."""
        # megatron-core imports wandb for its dynamic inference context, which chatgen never runs:
        # ~0.5 s of CPU at start-up; a wandb logger (chatgen.rlhf.trackers) imports it as usual
        with hidden_imports(("wandb",)):
            from megatron.core import parallel_state as ps

        cfg = self.config
        if cfg.load is None:
            raise ValueError(
                f"{self.name}: `load` is required (an HF model directory or a chatgen checkpoint)"
            )
        self.tp, self.pp = cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size
        self.ep = cfg.expert_model_parallel_size
        init_distributed(self.tp, self.pp, cfg.data_parallel_size, self.ep)
        cpu_compat.initialize_rng(cfg.seed)
        self.tp_rank, self.pp_rank = (
            ps.get_tensor_model_parallel_rank(),
            ps.get_pipeline_model_parallel_rank(),
        )
        self.ep_rank = ps.get_expert_model_parallel_rank()
        self.dp_rank, self.dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.hf_config = read_hf_config(cfg.load)
        self.spec = models.spec_from_hf_config(self.hf_config)
        layout.check_layout(self.spec, self.tp, self.pp, self.ep)
        if cfg.moe_routing_replay and not self.spec.is_moe:
            raise ValueError(
                f"{self.name}: moe_routing_replay is true but {cfg.load} has no experts; set it to false"
            )
        self.padded_vocab_size = self.spec.padded_vocab_size(
            self.tp, cfg.make_vocab_size_divisible_by
        )
        max_positions = self.hf_config.get("max_position_embeddings")
        if cfg.seq_length and max_positions and cfg.seq_length > max_positions:
            raise ValueError(
                f"{self.name}: seq_length={cfg.seq_length} is longer than the model's "
                f"max_position_embeddings={max_positions}; lower it (or null)"
            )
        # longest batch forward_tokens / train_step accept
        self.seq_length = cfg.seq_length or max_positions
        self.dtype = getattr(torch, cfg.dtype)
        self.is_first_stage, self.is_last_stage = self.pp_rank == 0, self.pp_rank == self.pp - 1

    def setup(self) -> None:
        """Build this rank's model (`model_provider`), DDP and optimizer, then load `config.load`
        into them.

        Override to add work around it (datasets, metrics, extra modules) and call
        `super().setup()`.
        """
        cfg = self.config
        with cpu_compat.building_model():
            self.model = self.model_provider(
                pre_process=self.is_first_stage, post_process=self.is_last_stage
            )
        if torch.cuda.is_available():
            self.model.cuda()
        # adapters on the frozen base: before DDP and the optimizer see the parameters
        if cfg.lora.rank:
            self.lora_stats = lora.attach(self)
        from megatron.core.transformer.moe.router import TopKRouter

        # this stage's, layer order
        self._routers = [m for m in self.model.modules() if isinstance(m, TopKRouter)]
        self._expert_tokens = (
            None  # (E,) tokens routed to each expert by this train_step's forwards (this stage)
        )
        for router in self._routers:
            router.register_forward_hook(self._count_routed_tokens)
            if cfg.moe_routing_replay:
                router.router_replay = RoutingReplay()
        # packing keeps micro-batches of one shape with EP > 1 (the EP ranks exchange tokens in
        # equal shares) and with moe_routing_replay (the replayed experts are the unpacked rows'
        # tokens)
        if not cfg.lora.rank:  # the tied embedding's gradient summed in one tensor (same bits)
            tied_embedding_grad.install(self.model)
        self.packing = PackingHooks(
            self.model,
            self.is_last_stage,
            self.pp,
            cfg.pack_shared_prefix and self.ep == 1 and not cfg.moe_routing_replay,
        )
        if self.pp > 1:
            from megatron.core import parallel_state as ps

            flag = torch.tensor([float(self.packing.packs)], device=self.device)
            dist.all_reduce(
                flag, op=dist.ReduceOp.MIN, group=ps.get_pipeline_model_parallel_group()
            )
            self.packing.packs = bool(flag.item())
        self._build_optimizer()
        # after the optimizer: a chatgen checkpoint restores its state and LR step
        self.load_checkpoint(cfg.load)
        # a checkpoint holds its own adapter
        if cfg.lora.from_peft and read_megatron_meta(cfg.load) is None:
            lora_peft.load_peft(self, cfg.lora.from_peft)

    def shutdown(self) -> None:
        """Release the model and megatron-core's parallel groups (and torch.distributed), so that
        this process can start another model, e.g. the next run of a test session. Safe to call
        twice."""
        if self.ddp is not None:
            # megatron's DDP is held by the hooks on the parameters' gradient accumulators, which an
            # autograd graph stored in the model (an MoE dispatcher's routing probabilities) keeps
            # alive through C++, out of the collector's sight: emptied, it lets the model and its
            # groups go
            self.ddp.__dict__.clear()
        self.model = self.ddp = self.optimizer = None
        # (model, its parameters by name): would keep the model alive
        self.__dict__.pop("_param_cache", None)
        gc.unfreeze()  # what start() froze (chatgen.module.startup_gc) is collectable again: the model's cycles too
        release_parallel_state()
        if dist.is_initialized():
            dist.destroy_process_group()

    # ---- user hooks
    # -------------------------------------------------------------------------------

    def model_provider(self, pre_process: bool, post_process: bool):
        """Build this rank's model chunk; called once by `setup()`.

        pre_process: this pipeline stage holds the embedding; post_process: the final norm + output
        layer. Must return a megatron-core `GPTModel` whose parameter names follow the local layer
        spec (the names the parameter mapping in chatgen/models/<family>.py uses). Default: the
        `config.load` architecture, local spec on CPU, Transformer Engine spec where TE is
        installed.
        """
        from megatron.core.models.gpt import GPTModel
        from megatron.core.transformer import TransformerConfig

        fam, cfg = models.family(self.spec), self.config
        on_gpu = torch.cuda.is_available()
        tconfig = TransformerConfig(
            **fam.transformer_config_kwargs(self.spec),
            tensor_model_parallel_size=self.tp,
            pipeline_model_parallel_size=self.pp,
            params_dtype=self.dtype,
            pipeline_dtype=self.dtype,
            bf16=self.dtype == torch.bfloat16,
            fp16=self.dtype == torch.float16,
            use_cpu_initialization=not on_gpu,
            perform_initialization=True,  # also marks TP-sharded params (grad norm, optimizers rely on it)
            gradient_accumulation_fusion=False,
            bias_activation_fusion=False,
            masked_softmax_fusion=False,
            persist_layer_norm=False,
            bias_dropout_fusion=False,
            apply_rope_fusion=False,
            sequence_parallel=cfg.sequence_parallel,
            **recompute_kwargs(cfg.activation_recompute, cfg.recompute_num_layers),
            **(
                dict(
                    expert_model_parallel_size=self.ep,
                    # the all-gather dispatcher runs on gloo (all-gather + reduce-scatter);
                    # megatron's all-to-all one needs CUDA streams. Every EP rank must then route
                    # the same number of tokens per micro-batch
                    moe_token_dispatcher_type="allgather",
                    moe_router_load_balancing_type="aux_loss"
                    if cfg.moe_aux_loss_coeff > 0
                    else "none",
                    moe_aux_loss_coeff=cfg.moe_aux_loss_coeff,
                )
                if self.spec.is_moe
                else {}
            ),
        )
        return GPTModel(
            tconfig,
            self._layer_spec(tconfig),
            vocab_size=self.padded_vocab_size,
            pre_process=pre_process,
            post_process=post_process,
            **fam.gpt_model_kwargs(self.spec),
        )

    @remote("split")
    @torch.no_grad()
    def forward_tokens(self, data: dict) -> torch.Tensor:
        """The model's per-token outputs for a batch, without gradient: what the framework asks a
        trainer or a reference for (old / reference log-probs; a critic's values, see
        `token_outputs`).

        data: {"input_ids": (B, T) long, optional "attention_mask": (B, T) 1 = token, 0 = padding,
        optional "routed_experts": (B, T, layers, k) the experts the engine chose (read with
        moe_routing_replay), optional "loss_mask": (B, T-1) the entries the caller reads: rows that
        share their unscored prefix run it once and only those entries are computed, as in
        train_step (shared-prefix packing; an entry outside the mask is then 0, or computed where a
        micro-batch cannot pack)}. Returns (B, T-1) float32 on every rank: entry t belongs to token
        t+1 (for the default head, log p(input_ids[:, t+1] | input_ids[:, :t+1])).
        """
        from megatron.core import parallel_state as ps

        self.onload(("params",))
        self.model.eval()
        batch = {
            k: data[k]
            for k in ("input_ids", "attention_mask", "routed_experts", "loss_mask")
            if data.get(k) is not None
        }
        plan = self.micro_batch_plan(
            batch, packs=self.packing.packs, dp_group=ps.get_data_parallel_group()
        )
        out = self.run_schedule(plan.micro_batches, loss_fn=None, forward_only=True)
        return out if self.config.max_tokens_per_micro_batch is None else plan.assemble(out)

    @remote("split")
    def train_step(self, data: dict, loss_fn) -> dict:
        """One optimizer step on `data` (this DP rank's share of the global batch), split in
        micro-batches: of micro_batch_size samples, or of at most max_tokens_per_micro_batch tokens,
        whose losses are then weighted to the global batch's mean (chatgen.training.micro_batches).

        data: {"input_ids": (B, T) long, optional "attention_mask": (B, T), plus any per-sample
        tensors (B, ...) the loss needs, e.g. "old_logprobs" (B, T-1), "advantages" (B,),
        "loss_mask" (B, T-1)}. loss_fn(logprobs (b, T-1) float32 with grad, micro_batch: dict of (b,
        ...) slices) -> (loss scalar, {name: scalar tensor}); the loss is averaged over
        micro-batches and DP ranks. With a "loss_mask", the logits of positions before the first one
        it marks in the micro-batch are not computed: logprobs is 0 there (a loss reads only masked
        positions). Returns {metric: float} over micro-batches and DP ranks (the mean; the largest
        for a name ending in `_max`: chatgen.core.metrics.reduce_metrics), plus "grad_norm" (before
        clipping), "lr" (this step's) and "skipped_step": 1.0 when the gradient was NaN/inf, in
        which case no weight, optimizer state, LR or iteration changes (`self.skipped_steps` counts
        them); else 0.0.
        """
        gbs, n = self.config.global_batch_size, data["input_ids"].shape[0]
        if self.spec.is_moe and self.tp > 1:
            raise ValueError(
                f"{self.name}.train_step: a mixture-of-experts model trains at "
                f"tensor_model_parallel_size=1 (megatron-core trains MoE at TP > 1 only with sequence "
                f"parallelism, which chatgen's trainer does not run; TP={self.tp} still serves "
                "forward_tokens and weight syncs); spread the experts with expert_model_parallel_size "
                "instead"
            )
        if gbs and n * self.dp != gbs:
            raise ValueError(
                f"{self.name}.train_step: {n} samples x {self.dp} data-parallel ranks != "
                f"global_batch_size={gbs}; pass {gbs // self.dp} samples per rank or change the key"
            )
        from megatron.core import parallel_state as ps

        group = ps.get_data_parallel_group()
        plan = self.micro_batch_plan(data, loss_fn, packs=self.packing.packs, dp_group=group)
        micro_batches = plan.micro_batches
        self.onload()  # a no-op unless offload() moved the training state to the host
        self.model.train()
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        # grads reduced over DP, PP, TP
        metrics = self.run_schedule(
            micro_batches,
            loss_fn,
            forward_only=False,
            weights=self.loss_weights(plan, loss_fn, group),
        )
        if self.spec.is_moe:
            metrics.update(self._moe_metrics(len(micro_batches)))
        lr = self.config.lr * self._lr_factor(self.iteration)
        with cpu_compat.cuda_type_names():
            # grads -> the fp32 main grads (fp16: unscaled, inf checked)
            found_inf = self.optimizer.prepare_grads()
            grad_norm = math.inf if found_inf else self.optimizer.get_grad_norm()
            # a NaN/inf grad would poison the weights, and vLLM after the sync
            if not math.isfinite(grad_norm):
                self.skipped_steps += 1
                metrics.update(grad_norm=grad_norm, lr=lr, skipped_step=1.0)
                return metrics
            if self.config.clip_grad > 0:
                from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

                for optimizer in self.optimizer.chained_optimizers:
                    clip_grad_by_total_norm_fp32(
                        optimizer.get_parameters(), self.config.clip_grad, grad_norm
                    )
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step_with_ready_grads()  # Adam on this rank's shard, then the weights gathered over DP
        self.iteration += 1
        metrics.update(grad_norm=grad_norm, lr=lr, skipped_step=0.0)
        return metrics
