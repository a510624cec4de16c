"""`MegatronModule`'s model and optimizer: the layer spec (local or Transformer Engine),
megatron-core's DistributedDataParallel and distributed optimizer, and the learning-rate schedule.

`ModelBuild` is a mixin of `chatgen.training.megatron_module.MegatronModule`; `setup()` calls it.
"""

import math

import torch

from chatgen.training import cpu_compat


def recompute_kwargs(mode: str, num_layers: int | None = None) -> dict:
    """megatron-core TransformerConfig keys for `activation_recompute` and
    `recompute_num_layers` (verl: override_transformer_config's recompute_granularity /
    recompute_method / recompute_num_layers)."""
    if mode == "full" and num_layers is not None:  # the first num_layers of each stage
        return dict(
            recompute_granularity="full", recompute_method="block", recompute_num_layers=num_layers
        )
    if mode == "full":  # every layer's input is kept, its forward run again in the backward
        return dict(
            recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
        )
    # megatron's default modules: the core attention (scores, softmax, dropout)
    if mode == "selective":
        return dict(recompute_granularity="selective")
    return {}


def skip_single_rank_collectives(ddp) -> int:
    """Where megatron-core's DDP would reduce-scatter the grads and all-gather the params over a
    group of one rank (DP 1, not overlapped), do what those collectives leave behind without
    running them: the grads scaled by the bucket's factor (and megatron's NaN / large-grad check
    when configured), the params as they are. Over one rank a sum or average is the input and a
    gather is the input, so the bits are the same; gloo's one-rank reduce-scatter and all-gather
    each copy the whole buffer through a fresh temporary, for SmolLM2 2 x 540 MB a train step,
    ~0.28 M page faults (docs/long_context.md, "SmolLM2's episode, per phase"). Returns how many
    bucket groups take the short path (megatron's `_ParamAndGradBucketGroup` internals:
    tests/integration/test_single_rank_collectives.py fails if they change)."""
    skipped = 0
    for group in [*ddp.bucket_groups, *ddp.expert_parallel_bucket_groups]:
        cfg = group.ddp_config
        if (
            not cfg.use_distributed_optimizer
            or group.intra_distributed_optimizer_instance_size != 1
            or cfg.num_distributed_optimizer_instances != 1
            or cfg.overlap_grad_reduce
            or cfg.overlap_param_gather
        ):
            continue
        group.start_grad_sync = _scale_grads_only.__get__(group)
        group.start_param_sync = _params_gathered.__get__(group)
        skipped += 1
    return skipped


def _scale_grads_only(group, force_all_reduce: bool = False) -> None:
    # megatron's start_grad_sync up to its collective
    cfg = group.ddp_config
    if cfg.check_for_nan_in_grad or cfg.check_for_large_grads:
        group.check_grads(
            check_for_nan_or_inf=cfg.check_for_nan_in_grad,
            check_for_large=cfg.check_for_large_grads,
        )
    for bucket in group.buckets:
        if bucket.gradient_scaling_factor != 1.0:
            bucket.grad_data *= bucket.gradient_scaling_factor
    group.grad_reduce_handle = None


def _params_gathered(group, force_sync: bool = False) -> None:
    # megatron's start_param_sync after a synchronous gather
    group.param_gather_handle = None
    group.param_gather_dispatched = True


class ModelBuild:
    """_layer_spec / _build_optimizer / _lr_factor."""

    def _build_optimizer(self) -> None:
        """megatron-core's DistributedDataParallel around the model and its distributed optimizer
        over it.

        DDP keeps the gradients in contiguous buffers (fp32 under bf16/fp16, so that micro-batches
        accumulate without rounding) and reduce-scatters them over DP in buckets, overlapped with
        the backward when `overlap_grad_reduce`; `finalize_model_grads` (called by the pipeline
        schedule) also sums the tied embedding across the first and last stage and QK-norm weights
        over TP. The optimizer is Adam(W) on fp32 main parameters (bf16/fp16 weights cannot take
        small updates: lr 1e-6 on a weight of 0.02 is below half a bf16 step) whose state and
        masters are sharded over the DP ranks; after each step every DP rank gathers the updated
        weights.
        """
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.optimizer import (
            OptimizerConfig,
            ParamKey,
            ParamPredicate,
            get_megatron_optimizer,
        )

        cfg, tconfig = self.config, self.model.config
        low_precision = self.dtype != torch.float32
        self.ddp = DistributedDataParallel(
            tconfig,
            DistributedDataParallelConfig(
                grad_reduce_in_fp32=low_precision and cfg.grad_reduce_dtype in (None, "float32"),
                overlap_grad_reduce=cfg.overlap_grad_reduce,
                use_distributed_optimizer=True,
            ),
            self.model,
        )
        tconfig.finalize_model_grads_func = finalize_model_grads
        skip_single_rank_collectives(self.ddp)
        # the schedule holds the reduce back until the last micro-batch's backward
        if cfg.overlap_grad_reduce:
            tconfig.no_sync_func = self.ddp.no_sync
        # One param group per dtype (megatron's local RMSNorm keeps fp32 weights in a bf16 model):
        # megatron 0.16's distributed optimizer maps a mixed group's Adam states to the wrong
        # parameters in its checkpoints.
        fp32 = ParamKey(
            predicate=ParamPredicate(name="fp32", fn=lambda p: p.dtype == torch.float32)
        )
        opt_config = OptimizerConfig(
            optimizer="adam",
            lr=cfg.lr,
            min_lr=cfg.min_lr,
            weight_decay=cfg.weight_decay,
            adam_beta1=cfg.adam_beta1,
            adam_beta2=cfg.adam_beta2,
            adam_eps=cfg.adam_eps,
            clip_grad=cfg.clip_grad,
            params_dtype=self.dtype,
            bf16=self.dtype == torch.bfloat16,
            fp16=self.dtype == torch.float16,
            use_distributed_optimizer=True,
        )
        with cpu_compat.cuda_type_names():
            self.optimizer = get_megatron_optimizer(
                opt_config,
                [self.ddp],
                config_overrides={fp32: {"wd_mult": 1.0}} if low_precision else {},
            )
        # the loss is scaled by the optimizer's (dynamic) loss scale
        if self.dtype == torch.float16:
            tconfig.grad_scale_func = self.optimizer.scale_loss

    def _layer_spec(self, tconfig):
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        if torch.cuda.is_available():
            try:
                import transformer_engine  # noqa: F401
                from megatron.core.models.gpt.gpt_layer_specs import (
                    get_gpt_layer_with_transformer_engine_spec,
                )

                return get_gpt_layer_with_transformer_engine_spec(
                    num_experts=tconfig.num_moe_experts, qk_layernorm=tconfig.qk_layernorm
                )
            except ImportError:
                pass
        spec = get_gpt_layer_local_spec(
            num_experts=tconfig.num_moe_experts,
            normalization="RMSNorm",
            qk_layernorm=tconfig.qk_layernorm,
        )
        # torch's norms, marked for megatron's TP reduction of their grads
        if tconfig.sequence_parallel:
            from chatgen.training.sequence_parallel import with_sequence_parallel_norms

            return with_sequence_parallel_norms(spec, tconfig, self.pp_rank)
        return spec

    def _lr_factor(self, step: int) -> float:
        return lr_factor(self.config, step)


def lr_factor(cfg, step: int) -> float:
    """The learning rate's factor at optimizer step `step`: linear warm-up over lr_warmup_iters,
    then a cosine from lr to min_lr over lr_decay_iters (constant without it). Every trainer
    backend's schedule."""
    if cfg.lr_warmup_iters and step < cfg.lr_warmup_iters:
        return (step + 1) / cfg.lr_warmup_iters
    decay = getattr(cfg, "lr_decay_iters", None)
    if not decay:
        return 1.0
    progress = min(1.0, (step - cfg.lr_warmup_iters) / decay)
    min_ratio = cfg.min_lr / cfg.lr
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
