"""`chatgen.MegatronModule`: the trainer side of chatgen, a megatron-core GPTModel with RLHF-shaped hooks.

    from chatgen import MegatronModule
    trainer = MegatronModule(dict(load="outputs/tiny-llama", tensor_model_parallel_size=1, lr=1e-5))
    trainer.start()                                             # init(): distributed; setup(): model + optimizer
    logprobs = trainer.forward_tokens({"input_ids": ids})    # (B, T) -> (B, T-1) log-probs
    metrics = trainer.train_step(batch, loss_fn)                # one optimizer step
    for bucket in trainer.hf_weights().buckets(): ...           # weights as HF tensors (chatgen.param_sync)

Run with several ranks (`torchrun`, `chatgen.training.launcher.run_distributed`, or Ray actors setting RANK /
WORLD_SIZE / MASTER_ADDR / MASTER_PORT): `init()` joins torch.distributed (gloo on CPU, NCCL on GPU) and
builds megatron-core's TP x PP x DP groups, DP = world / (TP * PP). Every method is collective: call it on
every rank with that rank's data (ranks of one DP replica get the same batch).

Subclass and override the hooks (`model_provider`, `setup`, `token_outputs`, `train_step`,
`save_checkpoint`, `load_checkpoint`); the default model is the HF checkpoint in `config.load` (any family
of chatgen/models), converted on the fly. Training uses megatron-core's own machinery, on CPU (gloo) as on
GPU: its `DistributedDataParallel` (gradients in contiguous buffers, reduced over DP in buckets; its
`finalize_model_grads` also sums the tied embedding across pipeline stages and QK-norm weights over TP) and its
distributed optimizer (Adam moments and, under bf16/fp16, fp32 master weights sharded over DP ranks).
Checkpoints are megatron-core distributed checkpoints: every rank writes its own shards, and a checkpoint
loads at another TP x PP x DP. `offload()` / `onload()` move the training state to host memory and back
while a colocated engine generates. docs/megatron_module.md says more.
"""
import gc
import math
import os
from pathlib import Path

import torch
import torch.distributed as dist

from chatgen import models
from chatgen.core.checkpoint_io import (
    begin_directory,
    commit_directory,
    copy_hf_side_files,
    read_hf_config,
    read_hf_safetensors,
    read_megatron_meta,
    read_megatron_shard,
    staging_path,
    write_megatron_meta,
)
from chatgen.core.distributed import init_process_group
from chatgen.core.metrics import reduce_metrics
from chatgen.core.tensors import DEFAULT_BUCKET_BYTES
from chatgen.models import layout
from chatgen.models.convert import TE_NORM_NAMES
from chatgen.module import Module
from chatgen.training import cpu_compat, dist_checkpoint
from chatgen.training.config import MegatronConfig
from chatgen.training.hf_export import HFWeights
from chatgen.training.prefix_packing import pack_shared_prefix


def init_distributed(tp: int, pp: int, dp: int | None = None, ep: int = 1) -> None:
    """Join (or start, for a single process) torch.distributed and build megatron-core's parallel groups; `dp`
    (the data_parallel_size key), when given, must be what the world makes of TP x PP; EP: expert-parallel ranks
    of a mixture-of-experts model, carved out of the data-parallel ones."""
    from megatron.core import parallel_state as ps

    cpu_compat.apply()
    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if "RANK" in os.environ and "MASTER_PORT" in os.environ:  # launched: env:// semantics, loopback-safe
            env = os.environ
            init_process_group(backend, int(env["RANK"]), int(env["WORLD_SIZE"]),
                               env.get("MASTER_ADDR", "127.0.0.1"), int(env["MASTER_PORT"]))
        else:  # a single process: a private one-rank world
            init_process_group(backend, 0, 1, "127.0.0.1", 0)  # the port picked as it is bound
    world = dist.get_world_size()
    if world % (tp * pp * ep):
        raise ValueError(f"world size {world} is not divisible by tensor_model_parallel_size={tp} x "
                         f"pipeline_model_parallel_size={pp} x expert_model_parallel_size={ep}; launch a multiple of "
                         f"{tp * pp * ep} ranks")
    if dp is not None and world != tp * pp * dp:
        raise ValueError(f"data_parallel_size={dp} needs {tp * pp * dp} ranks (TP {tp} x PP {pp} x DP {dp}), but "
                         f"{world} were launched; set data_parallel_size: {world // (tp * pp)} or null, or launch "
                         f"{tp * pp * dp} ranks")
    if ps.model_parallel_is_initialized() and not _groups_alive(ps):
        ps.destroy_model_parallel()  # the groups of a world that has ended (a vLLM engine's teardown ends it): rebuild
    if ps.model_parallel_is_initialized():
        have = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
                ps.get_expert_model_parallel_world_size())
        if have != (tp, pp, ep):
            raise RuntimeError(f"megatron parallel state already built with TP, PP, EP = {have}, not {(tp, pp, ep)}; "
                               "call megatron.core.parallel_state.destroy_model_parallel() first")
        return
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 expert_model_parallel_size=ep)


def _groups_alive(ps) -> bool:
    """Whether megatron's parallel groups still belong to the current torch.distributed world."""
    try:
        dist.get_rank(group=ps.get_model_parallel_group())  # checks the group is registered in this world
        return True
    except (ValueError, RuntimeError):  # "not registered": created in a world that was destroyed since
        return False


class MegatronModule(Module):
    """Trainer-side base class: a megatron-core GPTModel sharded over TP x PP x DP, with an optimizer.

    Lifecycle (chatgen.module): `MegatronModule(config, name=...)` checks the config; `init()` joins
    torch.distributed and builds megatron-core's parallel groups; `setup()` builds the model with
    `model_provider`, megatron's DDP and optimizer, and loads `config.load` (weights; from a chatgen checkpoint
    also iteration and optimizer state, hence the LR schedule). `start()` does both. Then `forward_tokens` /
    `train_step` per batch, `save_checkpoint` when asked, `hf_weights()` for a weight sync, `offload()` /
    `onload()` around a colocated engine's turn on the GPU.
    """

    config_class = MegatronConfig

    def __init__(self, config=None, *, name: str = "policy_trainer", config_dialect: str = "chatgen"):
        super().__init__(config, name=name, config_dialect=config_dialect)
        self.model = None  # this rank's GPTModel chunk
        self.ddp = None  # megatron-core's DistributedDataParallel around it (owns the grad buffers)
        self.optimizer = None  # megatron-core's distributed optimizer
        self.iteration = 0  # optimizer steps taken
        self.skipped_steps = 0  # train steps skipped for a NaN/inf gradient
        self._offloaded = ()  # what offload() moved to host memory
        self._memory_peaks = {}  # phase -> peak bytes allocated (memory_stats)

    # ---- lifecycle --------------------------------------------------------------------------------

    def init(self) -> None:
        """Framework: join torch.distributed and build the TP x PP x DP groups; read the model's architecture."""
        from megatron.core import parallel_state as ps

        cfg = self.config
        if cfg.load is None:
            raise ValueError(f"{self.name}: `load` is required (an HF model directory or a chatgen checkpoint)")
        self.tp, self.pp = cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size
        self.ep = cfg.expert_model_parallel_size
        init_distributed(self.tp, self.pp, cfg.data_parallel_size, self.ep)
        cpu_compat.initialize_rng(cfg.seed)
        self.tp_rank, self.pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
        self.ep_rank = ps.get_expert_model_parallel_rank()
        self.dp_rank, self.dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.hf_config = read_hf_config(cfg.load)
        self.spec = models.spec_from_hf_config(self.hf_config)
        layout.check_layout(self.spec, self.tp, self.pp, self.ep)
        if cfg.moe_routing_replay and not self.spec.is_moe:
            raise ValueError(f"{self.name}: moe_routing_replay is true but {cfg.load} has no experts; set it to false")
        self.padded_vocab_size = self.spec.padded_vocab_size(self.tp, cfg.make_vocab_size_divisible_by)
        max_positions = self.hf_config.get("max_position_embeddings")
        if cfg.seq_length and max_positions and cfg.seq_length > max_positions:
            raise ValueError(f"{self.name}: seq_length={cfg.seq_length} is longer than the model's "
                             f"max_position_embeddings={max_positions}; lower it (or null)")
        self.seq_length = cfg.seq_length or max_positions  # longest batch forward_tokens / train_step accept
        self.dtype = getattr(torch, cfg.dtype)
        self.is_first_stage, self.is_last_stage = self.pp_rank == 0, self.pp_rank == self.pp - 1

    def setup(self) -> None:
        """Build this rank's model (`model_provider`), DDP and optimizer, then load `config.load` into them.

        Override to add work around it (datasets, metrics, extra modules) and call `super().setup()`.
        """
        cfg = self.config
        with cpu_compat.building_model():
            self.model = self.model_provider(pre_process=self.is_first_stage, post_process=self.is_last_stage)
        if torch.cuda.is_available():
            self.model.cuda()
        self._logits_from, self._slices_logits, self._rope_positions = 0, False, None
        from megatron.core.transformer.moe.router import TopKRouter

        self._routers = [m for m in self.model.modules() if isinstance(m, TopKRouter)]  # this stage's, layer order
        self._expert_tokens = None  # (E,) tokens routed to each expert by this train_step's forwards (this stage)
        for router in self._routers:
            router.register_forward_hook(self._count_routed_tokens)
            if cfg.moe_routing_replay:
                router.router_replay = RoutingReplay()
        output_layer = getattr(self.model, "output_layer", None) if self.is_last_stage else None
        if output_layer is not None:  # train_step computes logits only where a loss reads them
            output_layer.register_forward_pre_hook(self._select_logit_positions)
            self._slices_logits = True
        # shared-prefix packing needs the output layer's position selection (last stage), attention that reads the
        # explicit mask (megatron's own; Transformer Engine's fused kernels may apply their causal type instead: not
        # verified, so not packed) and rotary embeddings that follow position ids: all stages must decide alike. Not
        # with EP > 1 (the EP ranks exchange tokens in equal shares: micro-batches keep one shape) nor with
        # moe_routing_replay (the replayed experts belong to the tokens of the unpacked rows)
        self._packs = cfg.pack_shared_prefix and self._attention_reads_the_mask() and (
            self._slices_logits or not self.is_last_stage) and self._rope_follows_position_ids() and (
            self.ep == 1 and not cfg.moe_routing_replay)
        if self.pp > 1:
            from megatron.core import parallel_state as ps

            flag = torch.tensor([float(self._packs)], device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=ps.get_pipeline_model_parallel_group())
            self._packs = bool(flag.item())
        self._build_optimizer()
        self.load_checkpoint(cfg.load)  # after the optimizer: a chatgen checkpoint restores its state and LR step

    def _build_optimizer(self) -> None:
        """megatron-core's DistributedDataParallel around the model and its distributed optimizer over it.

        DDP keeps the gradients in contiguous buffers (fp32 under bf16/fp16, so that micro-batches accumulate
        without rounding) and reduce-scatters them over DP in buckets, overlapped with the backward when
        `overlap_grad_reduce`; `finalize_model_grads` (called by the pipeline schedule) also sums the tied
        embedding across the first and last stage and QK-norm weights over TP. The optimizer is Adam(W) on fp32
        main parameters (bf16/fp16 weights cannot take small updates: lr 1e-6 on a weight of 0.02 is below half a
        bf16 step) whose state and masters are sharded over the DP ranks; after each step every DP rank gathers
        the updated weights.
        """
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.optimizer import OptimizerConfig, ParamKey, ParamPredicate, get_megatron_optimizer

        cfg, tconfig = self.config, self.model.config
        low_precision = self.dtype != torch.float32
        self.ddp = DistributedDataParallel(tconfig, DistributedDataParallelConfig(
            grad_reduce_in_fp32=low_precision, overlap_grad_reduce=cfg.overlap_grad_reduce,
            use_distributed_optimizer=True), self.model)
        tconfig.finalize_model_grads_func = finalize_model_grads
        if cfg.overlap_grad_reduce:  # the schedule holds the reduce back until the last micro-batch's backward
            tconfig.no_sync_func = self.ddp.no_sync
        # One param group per dtype (megatron's local RMSNorm keeps fp32 weights in a bf16 model): megatron 0.16's
        # distributed optimizer maps a mixed group's Adam states to the wrong parameters in its checkpoints.
        fp32 = ParamKey(predicate=ParamPredicate(name="fp32", fn=lambda p: p.dtype == torch.float32))
        opt_config = OptimizerConfig(
            optimizer="adam", lr=cfg.lr, min_lr=cfg.min_lr, weight_decay=cfg.weight_decay, adam_beta1=cfg.adam_beta1,
            adam_beta2=cfg.adam_beta2, adam_eps=cfg.adam_eps, clip_grad=cfg.clip_grad, params_dtype=self.dtype,
            bf16=self.dtype == torch.bfloat16, fp16=self.dtype == torch.float16, use_distributed_optimizer=True)
        with cpu_compat.cuda_type_names():
            self.optimizer = get_megatron_optimizer(opt_config, [self.ddp],
                                                    config_overrides={fp32: {"wd_mult": 1.0}} if low_precision else {})
        if self.dtype == torch.float16:  # the loss is scaled by the optimizer's (dynamic) loss scale
            tconfig.grad_scale_func = self.optimizer.scale_loss

    def shutdown(self) -> None:
        """Release the model and megatron-core's parallel groups (and torch.distributed), so that this process can
        start another model, e.g. the next run of a test session. Safe to call twice."""
        from megatron.core import parallel_state as ps

        self.model = self.ddp = self.optimizer = None
        self.__dict__.pop("_param_cache", None)  # (model, its parameters by name): would keep the model alive
        gc.unfreeze()  # what start() froze (chatgen.module.startup_gc) is collectable again: the model's cycles too
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()

    # ---- user hooks -------------------------------------------------------------------------------

    def model_provider(self, pre_process: bool, post_process: bool):
        """Build this rank's model chunk; called once by `setup()`.

        pre_process: this pipeline stage holds the embedding; post_process: the final norm + output layer.
        Must return a megatron-core `GPTModel` whose parameter names follow the local layer spec (the names
        the parameter mapping in chatgen/models/<family>.py uses). Default: the `config.load` architecture,
        local spec on CPU, Transformer Engine spec where TE is installed.
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
            **(dict(expert_model_parallel_size=self.ep,
                    # the all-gather dispatcher runs on gloo (all-gather + reduce-scatter); megatron's all-to-all
                    # one needs CUDA streams. Every EP rank must then route the same number of tokens per micro-batch
                    moe_token_dispatcher_type="allgather",
                    moe_router_load_balancing_type="aux_loss" if cfg.moe_aux_loss_coeff > 0 else "none",
                    moe_aux_loss_coeff=cfg.moe_aux_loss_coeff) if self.spec.is_moe else {}),
        )
        return GPTModel(tconfig, self._layer_spec(tconfig), vocab_size=self.padded_vocab_size,
                        pre_process=pre_process, post_process=post_process, **fam.gpt_model_kwargs(self.spec))

    @torch.no_grad()
    def forward_tokens(self, data: dict) -> torch.Tensor:
        """The model's per-token outputs for a batch, without gradient: what the framework asks a trainer or
        a reference for (old / reference log-probs; a critic's values, see `token_outputs`).

        data: {"input_ids": (B, T) long, optional "attention_mask": (B, T) 1 = token, 0 = padding, optional
        "routed_experts": (B, T, layers, k) the experts the engine chose (read with moe_routing_replay)}.
        Returns (B, T-1) float32 on every rank: entry t belongs to token t+1 (for the default head,
        log p(input_ids[:, t+1] | input_ids[:, :t+1])).
        """
        self.onload(("params",))
        self.model.eval()
        mbs = self.config.micro_batch_size or data["input_ids"].shape[0]
        batch = {k: data[k] for k in ("input_ids", "attention_mask", "routed_experts") if data.get(k) is not None}
        return self._run_schedule(_split_batch(batch, mbs), loss_fn=None, forward_only=True)

    def train_step(self, data: dict, loss_fn) -> dict:
        """One optimizer step on `data` (this DP rank's share of the global batch), split in micro-batches.

        data: {"input_ids": (B, T) long, optional "attention_mask": (B, T), plus any per-sample tensors
        (B, ...) the loss needs, e.g. "old_logprobs" (B, T-1), "advantages" (B,), "loss_mask" (B, T-1)}.
        loss_fn(logprobs (b, T-1) float32 with grad, micro_batch: dict of (b, ...) slices) -> (loss scalar,
        {name: scalar tensor}); the loss is averaged over micro-batches and DP ranks. With a "loss_mask", the
        logits of positions before the first one it marks in the micro-batch are not computed: logprobs is 0
        there (a loss reads only masked positions).
        Returns {metric: float} over micro-batches and DP ranks (the mean; the largest for a name ending in
        `_max`: chatgen.core.metrics.reduce_metrics), plus "grad_norm" (before clipping), "lr" (this step's) and
        "skipped_step": 1.0 when the gradient was NaN/inf, in which case no weight, optimizer state, LR or
        iteration changes (`self.skipped_steps` counts them); else 0.0.
        """
        gbs, n = self.config.global_batch_size, data["input_ids"].shape[0]
        if self.spec.is_moe and self.tp > 1:
            raise ValueError(f"{self.name}.train_step: a mixture-of-experts model trains at "
                             f"tensor_model_parallel_size=1 (megatron-core trains MoE at TP > 1 only with sequence "
                             f"parallelism, which chatgen's trainer does not run; TP={self.tp} still serves "
                             "forward_tokens and weight syncs); spread the experts with expert_model_parallel_size "
                             "instead")
        if gbs and n * self.dp != gbs:
            raise ValueError(f"{self.name}.train_step: {n} samples x {self.dp} data-parallel ranks != "
                             f"global_batch_size={gbs}; pass {gbs // self.dp} samples per rank or change the key")
        mbs = self.config.micro_batch_size or n
        micro_batches = _split_batch(data, mbs)
        self.onload()  # a no-op unless offload() moved the training state to the host
        self.model.train()
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        metrics = self._run_schedule(micro_batches, loss_fn, forward_only=False)  # grads reduced over DP, PP, TP
        if self.spec.is_moe:
            metrics.update(self._moe_metrics(len(micro_batches)))
        lr = self.config.lr * self._lr_factor(self.iteration)
        with cpu_compat.cuda_type_names():
            found_inf = self.optimizer.prepare_grads()  # grads -> the fp32 main grads (fp16: unscaled, inf checked)
            grad_norm = math.inf if found_inf else self.optimizer.get_grad_norm()
            if not math.isfinite(grad_norm):  # a NaN/inf grad would poison the weights, and vLLM after the sync
                self.skipped_steps += 1
                metrics.update(grad_norm=grad_norm, lr=lr, skipped_step=1.0)
                return metrics
            if self.config.clip_grad > 0:
                from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

                for optimizer in self.optimizer.chained_optimizers:
                    clip_grad_by_total_norm_fp32(optimizer.get_parameters(), self.config.clip_grad, grad_norm)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step_with_ready_grads()  # Adam on this rank's shard, then the weights gathered over DP
        self.iteration += 1
        metrics.update(grad_norm=grad_norm, lr=lr, skipped_step=0.0)
        return metrics

    def save_checkpoint(self, path) -> str:
        """Write weights + optimizer state to directory `path` atomically, as a megatron-core distributed
        checkpoint: each rank writes its own shards, and `load_checkpoint` reads it back at any TP x PP x DP
        (chatgen/training/dist_checkpoint.py). Returns the path.

        Layout: chatgen_megatron.json (HF config, TP, PP, DP, padded vocab, iteration) beside megatron's files
        (metadata.json, .metadata, __<rank>_<n>.distcp, common.pt), and the tokenizer / generation files of
        `load` (chatgen.core.checkpoint_io.HF_SIDE_FILES), so `chatgen serve` and `convert --to hf` need no other. Ranks write into the staging directory of
        chatgen.core.checkpoint_io, then rank 0 moves it into place, so a crash never leaves a half-written `path`.
        A model that has not stepped yet has no optimizer state to save: its checkpoint holds the weights.
        """
        path = Path(path)
        if dist.get_rank() == 0:
            begin_directory(path)
        dist.barrier()
        tmp = staging_path(path)
        stepped = self.iteration > 0
        self.onload()
        dist_checkpoint.save(self._sharded_state_dict(optimizer=stepped, loading=False), tmp)
        if dist.get_rank() == 0:
            write_megatron_meta(tmp, self.hf_config, self.tp, self.pp, self.padded_vocab_size, self.iteration,
                                optimizer=stepped, distributed=True, dp=self.dp, ep=self.ep)
            if self.config.load:  # its tokenizer and generation files: it serves and exports whole
                copy_hf_side_files(self.config.load, tmp)
        dist.barrier()
        if dist.get_rank() == 0:
            commit_directory(path)
        dist.barrier()
        return str(path)

    def load_checkpoint(self, path) -> None:
        """Load weights from an HF directory (converted to this rank's shard) or a chatgen Megatron checkpoint.

        A checkpoint this trainer saved loads at any TP x PP x DP (the padded vocab must agree: it depends on TP
        and make_vocab_size_divisible_by) and restores iteration and optimizer state with the weights; one written
        by `chatgen convert --to megatron` (weights only) must have this run's TP and PP.
        """
        path = Path(path)
        meta = read_megatron_meta(path)
        self.onload()
        if meta is not None and meta.get("distributed"):
            if meta["padded_vocab_size"] != self.padded_vocab_size:
                raise ValueError(
                    f"{path}: saved with the vocab padded to {meta['padded_vocab_size']} rows (TP "
                    f"{meta['tensor_model_parallel_size']}), this run pads it to {self.padded_vocab_size} (TP "
                    f"{self.tp}, make_vocab_size_divisible_by={self.config.make_vocab_size_divisible_by}); set "
                    "make_vocab_size_divisible_by so that both agree, or go through HF: chatgen convert --to hf")
            stepped = bool(meta.get("optimizer"))
            wanted = self._sharded_state_dict(optimizer=stepped, loading=True)
            state = _read_checkpoint_file(lambda directory: dist_checkpoint.load(wanted, directory), path)
            self.model.load_state_dict(state["model"])
            if stepped:
                self.optimizer.load_state_dict(state["optimizer"])
            else:
                self.optimizer.reload_model_params()  # the fp32 main weights follow the loaded ones
            self.iteration = meta.get("iteration", 0)
            return
        if meta is not None:
            have = (meta["tensor_model_parallel_size"], meta["pipeline_model_parallel_size"])
            if have != (self.tp, self.pp):
                raise ValueError(f"{path}: checkpoint has TP, PP = {have} but this run uses {(self.tp, self.pp)}; "
                                 f"reshard it: chatgen convert --to hf --input {path} --output HF_DIR")
            if meta.get("optimizer"):  # written by chatgen before megatron's optimizer: plain AdamW's state
                raise ValueError(f"{path}: its optimizer state (optim_tp*_pp*.pt) is the format of an older chatgen, "
                                 "which this trainer cannot continue; start from its weights: chatgen convert --to hf "
                                 f"--input {path} --output HF_DIR, then load HF_DIR")
            self._load_canonical_state(_read_checkpoint_file(read_megatron_shard, path, self.tp_rank, self.pp_rank),
                                       source=str(path))
            self.iteration = meta.get("iteration", 0)
            return
        state = {}
        params = self._stage_params()
        names = {n for sp, _ in params for n in sp.hf_names}
        hf = read_hf_safetensors(path, self.spec.tie_word_embeddings, names=names)
        for sp, canonical in params:
            missing = [n for n in sp.hf_names if n not in hf]
            if missing:
                raise KeyError(f"{path}: HF checkpoint lacks {missing} (Megatron {sp.local_name})")
            shards = layout.to_megatron_shards(sp.kind, [hf[n] for n in sp.hf_names], self.spec, self.tp,
                                               self.padded_vocab_size, what=sp.hf_names[0])
            state[canonical] = shards[self.tp_rank]
        self._load_canonical_state(state, source=str(path))

    # ---- memory handoff -------------------------------------------------------------------------------

    def offload(self, params: bool = True) -> None:
        """Before a colocated engine takes the GPU: move the training state the config names to host memory
        (`offload_grads`: the gradient buffers are freed, they hold nothing between steps; `offload_optimizer`:
        fp32 main weights and Adam moments; `offload_params`, when `params`: the weights) and return the cached
        blocks to the device (torch.cuda.empty_cache), so the engine can use the memory. Every method that needs
        the state brings it back first (`onload`). A no-op without CUDA: everything already lives in host memory.
        Not collective."""
        if not torch.cuda.is_available():
            return
        cfg, moved = self.config, set(self._offloaded)
        torch.cuda.synchronize()
        if cfg.offload_grads and "grads" not in moved:
            self.ddp.offload_grad_buffers(synchronize=False, empty_cache=False)
            moved.add("grads")
        if cfg.offload_optimizer and "optimizer" not in moved:
            self.optimizer.offload_to_cpu()
            moved.add("optimizer")
        if params and cfg.offload_params and "params" not in moved:
            for buffer in self.ddp.buffers:  # the weights are views of these buffers
                buffer.offload_to_cpu(move_params=True, move_grads=False)
            moved.add("params")
        torch.cuda.synchronize()
        if moved and not self._offloaded:  # the peak of the phase that ends here: this model's own
            self._memory_peaks["trainer"] = max(self._memory_peaks.get("trainer", 0), torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()
        self._offloaded = tuple(sorted(moved))
        torch.cuda.empty_cache()

    def onload(self, pieces=("params", "grads", "optimizer")) -> None:
        """Bring back to the GPU what `offload` moved of `pieces` (gradient buffers come back zeroed): a forward
        pass or a weight sync needs only the params. Not collective."""
        back = [piece for piece in self._offloaded if piece in pieces]
        if not back:
            return
        if len(back) == len(self._offloaded) or "params" in back:  # the offloaded phase ends here
            self._memory_peaks["offloaded"] = max(self._memory_peaks.get("offloaded", 0),
                                                  torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()
        if "params" in back:
            for buffer in self.ddp.buffers:
                buffer.reload_from_cpu(move_params=True, move_grads=False)
        if "optimizer" in back:
            self.optimizer.restore_from_cpu()
        if "grads" in back:
            self.ddp.restore_grad_buffers(synchronize=False)
        torch.cuda.synchronize()
        self._offloaded = tuple(piece for piece in self._offloaded if piece not in back)

    def memory_stats(self) -> dict:
        """`memory/*` figures since the last call (then reset), in GiB. On GPU, this process's peak of memory
        allocated through torch: `memory/trainer_peak_gib` while this model held its state (forward passes,
        training, the sync), `memory/offloaded_peak_gib` while it was offloaded (a colocated engine generating;
        what vLLM allocates through torch), and `memory/device_used_gib` now (the whole device, every process).
        Without CUDA: `memory/host_peak_rss_gib`, the process's peak resident memory so far."""
        if not torch.cuda.is_available():
            import resource

            return {"memory/host_peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
        peaks, now = self._memory_peaks, "offloaded" if self._offloaded else "trainer"  # (the phase still running)
        peaks[now] = max(peaks.get(now, 0), torch.cuda.max_memory_allocated())
        torch.cuda.reset_peak_memory_stats()
        self._memory_peaks = {}
        free, total = torch.cuda.mem_get_info()
        return {**{f"memory/{phase}_peak_gib": v / 2**30 for phase, v in peaks.items()},
                "memory/device_used_gib": (total - free) / 2**30}

    def _sharded_state_dict(self, optimizer: bool, loading: bool) -> dict:
        """What a distributed checkpoint holds: the model's megatron ShardedTensors (global names and offsets, so
        any layout can read them) and, with `optimizer`, the distributed optimizer's state in the same model
        space (`fully_reshardable`: gathered to the DP group's first rank, through host memory, when saved)."""
        model = self.model.sharded_state_dict()
        state = {"model": model}
        if optimizer:
            if loading:  # megatron asks the optimizer for its state dict first: AdamW's state must exist
                for chained in self.optimizer.chained_optimizers:
                    chained._init_optimizer_states_with_dummy_values()  # megatron's way; overwritten by the load
            state["optimizer"] = self.optimizer.sharded_state_dict(model, is_loading=loading, metadata={
                "distrib_optim_sharding_type": "fully_reshardable",
                "distrib_optim_fully_reshardable_mem_efficient": True})
        return state

    # ---- library API ------------------------------------------------------------------------------

    def hf_weights(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> HFWeights:
        """This model's weights as HF-named full tensors (gathered over TP, broadcast over PP), bucket by bucket:
        the trainer's one public way out for its weights (chatgen/training/hf_export.py). Collective: call on
        every rank; at most about two buckets of extra memory, never a copy of the model."""
        self.onload(("params",))
        return HFWeights(self, bucket_bytes)

    def hf_state_dict(self) -> dict:
        """The whole model as an HF state dict (a full copy; for tests and `chatgen convert`). Collective."""
        return {name: t.clone() for bucket in self.hf_weights().buckets() for name, t in bucket}

    # ---- internals --------------------------------------------------------------------------------

    def _layer_spec(self, tconfig):
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        if torch.cuda.is_available():
            try:
                import transformer_engine  # noqa: F401
                from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

                return get_gpt_layer_with_transformer_engine_spec(num_experts=tconfig.num_moe_experts,
                                                                  qk_layernorm=tconfig.qk_layernorm)
            except ImportError:
                pass
        return get_gpt_layer_local_spec(num_experts=tconfig.num_moe_experts, normalization="RMSNorm",
                                        qk_layernorm=tconfig.qk_layernorm)

    def _to_module_name(self, name: str) -> str:
        for local, te in TE_NORM_NAMES.items():  # the Transformer Engine spec's names
            if name.endswith(local) and name not in self._params:
                return name[: -len(local)] + te
        return name

    @property
    def _params(self) -> dict:
        if getattr(self, "_param_cache", (None,))[0] is not self.model:
            self._param_cache = (self.model, dict(self.model.named_parameters()))
        return self._param_cache[1]

    def local_param(self, canonical_name: str) -> torch.Tensor:
        """This rank's shard of a Megatron parameter by its local-spec name (used by param_sync)."""
        params = self._params
        name = canonical_name if canonical_name in params else self._to_module_name(canonical_name)
        return params[name]

    def _stage_params(self, ep_rank: int | None = None) -> list:
        """[(layout.StageParam, its name in a checkpoint)] of this rank's stage at EP rank `ep_rank` (this rank's
        by default). A checkpoint holds every expert of a stage, numbered globally (the layout at EP = 1)."""
        everything = {sp.hf_names[0]: sp.local_name for sp in layout.stage_params(self.spec, self.pp, self.pp_rank)}
        rank = self.ep_rank if ep_rank is None else ep_rank
        return [(sp, everything[sp.hf_names[0]])
                for sp in layout.stage_params(self.spec, self.pp, self.pp_rank, self.ep, rank)]

    @torch.no_grad()
    def _load_canonical_state(self, state: dict, source: str) -> None:
        params = self._params
        expected = {self._to_module_name(sp.local_name): canonical for sp, canonical in self._stage_params()}
        missing = sorted(set(params) - set(expected))
        if missing:
            raise RuntimeError(f"{source}: model parameters {missing} have no mapping in chatgen/models/"
                               f"{self.spec.family}.py; extend its param_mappings")
        for module_name, canonical in expected.items():
            if canonical not in state:
                raise KeyError(f"{source}: no tensor for {canonical} (stage {self.pp_rank}, TP rank {self.tp_rank})")
            src, dst = state[canonical], params[module_name]
            if tuple(src.shape) != tuple(dst.shape):
                raise ValueError(f"{source}: {canonical} has shape {tuple(src.shape)}, the model expects "
                                 f"{tuple(dst.shape)} (TP={self.tp}, PP={self.pp})")
            dst.copy_(src)
        if self.optimizer is not None:  # the optimizer steps fp32 main weights: they follow the loaded ones
            self.optimizer.reload_model_params()

    def _lr_factor(self, step: int) -> float:
        cfg = self.config
        if cfg.lr_warmup_iters and step < cfg.lr_warmup_iters:
            return (step + 1) / cfg.lr_warmup_iters
        decay = getattr(cfg, "lr_decay_iters", None)
        if not decay:
            return 1.0
        progress = min(1.0, (step - cfg.lr_warmup_iters) / decay)
        min_ratio = cfg.min_lr / cfg.lr
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    @property
    def device(self) -> torch.device:
        """Where this rank's parameters live (the current CUDA device, or the CPU)."""
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

    def _run_schedule(self, micro_batches: list, loss_fn, forward_only: bool):
        """Run megatron's pipeline schedule over micro-batches (all the same T).

        forward_only: returns logprobs (B, T-1) gathered over micro-batches, on every rank.
        Otherwise runs backward too and returns the loss_fn metrics averaged over micro-batches and DP.
        """
        from megatron.core import parallel_state as ps
        from megatron.core.pipeline_parallel import get_forward_backward_func

        t = micro_batches[0]["input_ids"].shape[1]
        if self.seq_length and t > self.seq_length:
            raise ValueError(f"{self.name}: a batch of {t} tokens per sample is longer than seq_length="
                             f"{self.seq_length}; raise seq_length in this model's config (up to the model's "
                             "max_position_embeddings) or cut prompts / responses")
        device = self.device
        micro_batches = [{k: v.to(device) if torch.is_tensor(v) else v for k, v in mb.items()} for mb in micro_batches]
        b, t = micro_batches[0]["input_ids"].shape
        plans = self._pack(micro_batches) if self._packs and not forward_only else [None] * len(micro_batches)
        if plans[0] is not None:  # the pipeline schedule exchanges (T, b, H) activations of the packed shape
            b, t = plans[0].input_ids.shape
        collected = []

        def forward_step_func(data_iterator, model):
            mb, plan = next(data_iterator)
            if plan is not None:  # shared-prefix packing: each prompt once (chatgen.training.prefix_packing)
                self._logits_from, self._rope_positions = plan.logit_positions, plan.position_ids
                moe = {"padding_mask": plan.segments < 0} if self.spec.is_moe else {}  # no pad in the router's figures
                try:
                    logits = model(plan.input_ids, plan.position_ids, plan.attention_mask, **moe)
                finally:  # a later plain call of the model computes every position at 0..T-1
                    self._logits_from, self._rope_positions = 0, None
                if not self.is_last_stage:
                    return logits, None
                logprobs = plan.unpack(self.token_outputs(logits, plan.labels))  # (b, T-1), 0 where unread
                return logprobs, loss_func_for(mb)
            ids = mb["input_ids"]
            position_ids, mask = _positions_and_mask(ids, mb.get("attention_mask"))
            moe = {}
            if self.spec.is_moe and mb.get("attention_mask") is not None:  # no pad in the router's figures
                moe["padding_mask"] = ~mb["attention_mask"].bool()
            if self.config.moe_routing_replay:
                self._replay_routing(mb.get("routed_experts"), ids.shape)
            # Training: no logits before the first position any row's loss reads (the prompt); the output layer
            # is the largest matmul of a small model and its (b, T, vocab) result the largest tensor.
            first = _first_scored_position(mb.get("loss_mask")) if self._slices_logits and not forward_only else 0
            self._logits_from = first
            try:
                logits = model(ids, position_ids, mask, **moe)
            finally:
                self._logits_from = 0
            if not self.is_last_stage:
                return logits, None
            logprobs = self.token_outputs(logits, ids[:, first:])  # (b, T-1-first): as if the rows began there
            if first:
                logprobs = torch.nn.functional.pad(logprobs, (first, 0))  # (b, T-1), 0 where no loss reads
            return logprobs, loss_func_for(mb)

        def loss_func_for(mb):
            def loss_func(output):
                if loss_fn is None:
                    collected.append(output.detach())
                    return output.sum() * 0, {}
                loss, metrics = loss_fn(output, mb)
                collected.append({k: float(v.detach() if torch.is_tensor(v) else v)
                                  for k, v in {"loss": loss, **metrics}.items()})
                return loss, {}

            return loss_func

        get_forward_backward_func()(
            forward_step_func=forward_step_func, data_iterator=iter(zip(micro_batches, plans)), model=[self.ddp],
            num_microbatches=len(micro_batches), seq_length=t, micro_batch_size=b, forward_only=forward_only)

        if forward_only:  # logprobs live on the last stage: send them to every stage
            out = torch.cat(collected) if self.is_last_stage else torch.empty(
                sum(mb["input_ids"].shape[0] for mb in micro_batches), t - 1, dtype=torch.float32, device=device)
            if self.pp > 1:
                dist.broadcast(out, ps.get_pipeline_model_parallel_last_rank(),
                               group=ps.get_pipeline_model_parallel_group())
            return out.cpu()
        metrics = reduce_metrics(collected) if collected else None
        if self.pp > 1:  # metrics live on the last stage
            box = [metrics]
            dist.broadcast_object_list(box, ps.get_pipeline_model_parallel_last_rank(),
                                       group=ps.get_pipeline_model_parallel_group())
            metrics = box[0]
        if self.dp > 1:
            parts = [None] * self.dp
            dist.all_gather_object(parts, metrics, group=ps.get_data_parallel_group())
            metrics = reduce_metrics(parts)
        return metrics

    def _pack(self, micro_batches: list) -> list:
        """Shared-prefix plans for the micro-batches (chatgen.training.prefix_packing), all of one shape when
        pipeline stages exchange activations; [None, ...] (train unpacked) unless every micro-batch packs."""
        plans = [pack_shared_prefix(mb["input_ids"], mb.get("attention_mask"), mb.get("loss_mask"))
                 for mb in micro_batches]
        if any(plan is None for plan in plans):
            return [None] * len(plans)
        if self.pp > 1:
            rows = max(plan.input_ids.shape[0] for plan in plans)
            length = max(plan.input_ids.shape[1] for plan in plans)
            plans = [plan.padded(rows, length) for plan in plans]
        return plans

    def _select_logit_positions(self, _layer, args):
        """Forward pre-hook of the output layer: its input hidden states (T, b, H), sequence first, only where
        logits are needed: from position `self._logits_from` on when it is an int (0 = all), or at the positions
        of a (b, K) tensor, per row (shared-prefix packing). Set per micro-batch by `_run_schedule`."""
        at = self._logits_from
        if torch.is_tensor(at):
            hidden = args[0]
            return (hidden.gather(0, at.t().unsqueeze(-1).expand(-1, -1, hidden.shape[-1])), *args[1:])
        if at:
            return (args[0][at:], *args[1:])
        return None

    def _attention_reads_the_mask(self) -> bool:
        """Every layer's core attention is megatron's DotProductAttention (the local spec), which applies the
        explicit attention mask it is given."""
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        layers = getattr(getattr(self.model, "decoder", None), "layers", [])
        return all(type(layer.self_attention.core_attention) is DotProductAttention for layer in layers)

    def _rope_follows_position_ids(self) -> bool:
        """Make the model's rotary embedding honour the position ids (megatron's uses 0..T-1 whatever the ids),
        so that packed rows keep their own positions; False for a model whose positions cannot follow them."""
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

        kind = getattr(self.model, "position_embedding_type", None)
        if kind == "learned_absolute":  # the embedding reads position_ids itself
            return True
        if kind != "rope" or type(getattr(self.model, "rotary_pos_emb", None)) is not RotaryEmbedding:
            return False
        # one hook per model: setup() calls this once for each model it builds
        self.model.rotary_pos_emb.register_forward_hook(self._rope_at_positions)
        return True

    def _rope_at_positions(self, _module, _args, emb):
        """Forward hook of the rotary embedding: (T, 1, 1, D) for positions 0..T-1 -> (T, b, 1, D) at each row's
        `self._rope_positions` (b, T) while a packed micro-batch runs; unchanged otherwise."""
        if self._rope_positions is None:
            return None
        return emb[:, 0, 0][self._rope_positions.t()].unsqueeze(2)

    def token_outputs(self, logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """Hook: the model's per-token outputs, from its logits. Called on the last pipeline stage by
        `forward_tokens` and `train_step` (with gradient).

        logits: (b, T, V/TP) vocab-parallel (this rank's vocab shard); input_ids: (b, T).
        Returns (b, T-1) float32: entry t belongs to token t+1. Default: its log-prob (vocab-parallel
        log-softmax; padded vocab rows, ids >= the HF vocab, are masked so the distribution is HF's).
        Override for a head that is not a token distribution, e.g. a PPO critic (chatgen/training/critic.py).
        """
        from megatron.core import tensor_parallel

        logits = logits[:, :-1].float()
        shard = logits.shape[-1]
        first = self.tp_rank * shard
        if first + shard > self.spec.vocab_size:
            col = torch.arange(first, first + shard, device=logits.device)
            logits = logits.masked_fill(col >= self.spec.vocab_size, -1e30)
        labels = input_ids[:, 1:].contiguous()
        return -tensor_parallel.vocab_parallel_cross_entropy(logits.contiguous(), labels)

    def _replay_routing(self, routed: torch.Tensor | None, shape) -> None:
        """Make this stage's MoE layers use the experts the engine chose (moe_routing_replay) in the next forward.

        routed: (b, T, num_layers, k) long, the batch's `routed_experts` (chatgen.rollout.RolloutBatch); -1 where
        the engine routed nothing (padding, a sample's last token), where the router chooses itself."""
        if routed is None:
            raise ValueError(f"{self.name}: moe_routing_replay is true but the batch has no routed_experts; have the "
                             "engine record them (return_routed_experts: true on the vllm model) or set "
                             "moe_routing_replay: false")
        k = self.spec.moe_router_topk
        if tuple(routed.shape) != (*shape, self.spec.num_layers, k):
            raise ValueError(f"{self.name}: routed_experts has shape {tuple(routed.shape)}, the batch needs "
                             f"{(*shape, self.spec.num_layers, k)} (samples, tokens, layers, experts per token)")
        layers = layout.stage_layers(self.spec, self.pp, self.pp_rank)
        routed = routed[:, :, layers.start:layers.stop].transpose(0, 1)  # (T, b, layers, k): megatron's token order
        for j, router in enumerate(self._routers):
            router.router_replay.target = routed[:, :, j].reshape(-1, k)

    def _count_routed_tokens(self, _router, args, output):
        """Forward hook of every MoE router: add, while training, how many real tokens (not padding: the router's
        second argument, True = pad) each expert got to `self._expert_tokens`."""
        if not (self.model.training and torch.is_grad_enabled()):
            return
        routing_map = output[1].detach()  # (tokens, E) bool: the experts each token goes to
        if len(args) > 1 and args[1] is not None:
            routing_map = routing_map[~args[1].reshape(-1)]
        counts = routing_map.sum(dim=0).double()
        self._expert_tokens = counts if self._expert_tokens is None else self._expert_tokens + counts

    @torch.no_grad()
    def _moe_metrics(self, num_micro_batches: int) -> dict:
        """This train_step's router figures, over every layer, micro-batch and data-parallel rank:
        moe/expert_usage/<e> = expert e's share of the routed token slots (1/E each when balanced) and, with
        moe_aux_loss_coeff > 0, moe/load_balancing_loss (megatron's aux loss before its coefficient, layer mean).
        Collective over PP and DP."""
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

        counts = self._expert_tokens if self._expert_tokens is not None else torch.zeros(
            self.spec.num_experts, dtype=torch.float64, device=self.device)
        self._expert_tokens = None
        tracker = get_moe_layer_wise_logging_tracker().get("load_balancing_loss")
        loss = (tracker["values"].double().sum() if tracker else torch.zeros((), dtype=torch.float64,
                                                                            device=self.device)).view(1)
        clear_aux_losses_tracker()
        both = torch.cat([counts.to(self.device), loss])
        if self.pp > 1:  # each stage holds its own layers
            dist.all_reduce(both, group=ps.get_pipeline_model_parallel_group())
        if self.dp > 1:
            dist.all_reduce(both, group=ps.get_data_parallel_group())
        counts, loss = both[:-1], both[-1]
        metrics = {f"moe/expert_usage/{e}": float(c) for e, c in enumerate(counts / counts.sum().clamp(min=1))}
        if self.config.moe_aux_loss_coeff > 0:
            metrics["moe/load_balancing_loss"] = float(loss / (self.spec.num_layers * num_micro_batches * self.dp))
        return metrics


class RoutingReplay:
    """A router's top-k from recorded experts (moe_routing_replay): megatron-core's TopKRouter asks its
    `router_replay` for the top-k (`get_replay_topk`, the interface of megatron's RouterReplay); this one answers
    with `target` (tokens, k), each token's recorded experts, and with the router's own choice on rows of -1
    (nothing recorded). The router then takes its probabilities at those experts, so gradients flow as usual."""

    target = None  # (tokens, k) long, set before each forward by MegatronModule._replay_routing

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        probs, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if self.target is None:
            return probs, own
        chosen = torch.where(self.target[:, :1] >= 0, self.target.to(own.device), own)
        return scores.gather(1, chosen), chosen


def _read_checkpoint_file(read, path, *args, **kwargs):
    """`read(path, ...)` with a damaged file reported by its name rather than by the reader's internals."""
    try:
        return read(path, *args, **kwargs)
    except FileNotFoundError:
        raise
    except Exception as e:  # noqa: BLE001 - safetensors / torch.distributed.checkpoint raise many types for a damaged file
        raise ValueError(f"{path}: cannot be read, the checkpoint is damaged ({type(e).__name__}: {e}); resume from "
                         "an earlier checkpoint or restore the file") from e


def _split_batch(data: dict, micro_batch_size: int) -> list[dict]:
    n = data["input_ids"].shape[0]
    if n % micro_batch_size:
        raise ValueError(f"batch of {n} samples is not a multiple of micro_batch_size={micro_batch_size}")
    return [{k: (v[i:i + micro_batch_size] if torch.is_tensor(v) and v.dim() > 0 and v.shape[0] == n else v)
             for k, v in data.items()} for i in range(0, n, micro_batch_size)]


def _first_scored_position(loss_mask: torch.Tensor | None) -> int:
    """The first position t whose entry (b, T-1) loss_mask[:, t] is 1 in any row (entry t scores token t+1,
    predicted from position t); 0 without a mask or when it is empty."""
    if loss_mask is None:
        return 0
    scored = loss_mask.any(dim=0).nonzero()
    return int(scored[0]) if len(scored) else 0


def _positions_and_mask(input_ids: torch.Tensor, attention_mask: torch.Tensor | None):
    """Position ids (b, T) and megatron's boolean mask (b, 1, T, T), True = do not attend: causal, plus
    padding keys when attention_mask is given (positions then count real tokens, so left padding works)."""
    b, t = input_ids.shape
    causal = torch.triu(torch.ones(t, t, dtype=torch.bool, device=input_ids.device), diagonal=1)
    if attention_mask is None:
        return torch.arange(t, device=input_ids.device).expand(b, t), causal.view(1, 1, t, t)
    keep = attention_mask.bool()
    positions = (keep.long().cumsum(-1) - 1).clamp(min=0)
    mask = causal.view(1, 1, t, t) | ~keep.view(b, 1, 1, t)
    return positions, mask
