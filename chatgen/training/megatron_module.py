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
of chatgen/models), converted on the fly. The optimizer is plain `torch.optim.AdamW` over this rank's shards
(gradients averaged over DP and the tied embedding summed across the first and last pipeline stage by
`_finalize_grads`; fp32 master copies when the model is bf16/fp16), which runs the same on CPU and GPU;
docs/megatron_module.md says more.
"""
import gc
import json
import math
import os
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from chatgen import models
from chatgen.checkpoint_io import (
    begin_directory,
    commit_directory,
    megatron_shard_file,
    read_hf_config,
    read_hf_safetensors,
    read_megatron_meta,
    read_megatron_shard,
    staging_path,
    write_megatron_meta,
)
from chatgen.config import MegatronConfig
from chatgen.distributed import free_port, init_process_group
from chatgen.models import layout
from chatgen.module import Module
from chatgen.rlhf.losses import reduce_metrics
from chatgen.training import cpu_compat
from chatgen.training.hf_export import DEFAULT_BUCKET_BYTES, HFWeights, unflatten
from chatgen.training.prefix_packing import pack_shared_prefix


def init_distributed(tp: int, pp: int, ep: int = 1) -> None:
    """Join (or start, for a single process) torch.distributed and build megatron-core's parallel groups (EP:
    expert-parallel ranks of a mixture-of-experts model, carved out of the data-parallel ones)."""
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
            init_process_group(backend, 0, 1, "127.0.0.1", free_port())
    world = dist.get_world_size()
    if world % (tp * pp * ep):
        raise ValueError(f"world size {world} is not divisible by tensor_model_parallel_size={tp} x "
                         f"pipeline_model_parallel_size={pp} x expert_model_parallel_size={ep}; launch a multiple of "
                         f"{tp * pp * ep} ranks")
    if ps.model_parallel_is_initialized():
        have = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
                ps.get_expert_model_parallel_world_size())
        if have != (tp, pp, ep):
            raise RuntimeError(f"megatron parallel state already built with TP, PP, EP = {have}, not {(tp, pp, ep)}; "
                               "call megatron.core.parallel_state.destroy_model_parallel() first")
        return
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 expert_model_parallel_size=ep)


class MegatronModule(Module):
    """Trainer-side base class: a megatron-core GPTModel sharded over TP x PP x DP, with an optimizer.

    Lifecycle (chatgen.module): `MegatronModule(config, name=...)` checks the config; `init()` joins
    torch.distributed and builds megatron-core's parallel groups; `setup()` builds the model with
    `model_provider` and the optimizer, and loads `config.load` (weights; from a chatgen checkpoint also
    iteration, optimizer and LR schedule). `start()` does both. Then `forward_tokens` / `train_step` per
    batch, `save_checkpoint` when asked, `hf_weights()` for a weight sync.
    """

    config_class = MegatronConfig

    def __init__(self, config=None, *, name: str = "policy_trainer", config_dialect: str = "chatgen"):
        super().__init__(config, name=name, config_dialect=config_dialect)
        self.model = None  # this rank's GPTModel chunk
        self.optimizer = None
        self._masters = None  # fp32 master copies of the trainable params when dtype is not float32
        self.iteration = 0  # optimizer steps taken
        self.skipped_steps = 0  # train steps skipped for a NaN/inf gradient

    # ---- lifecycle --------------------------------------------------------------------------------

    def init(self) -> None:
        """Framework: join torch.distributed and build the TP x PP x DP groups; read the model's architecture."""
        from megatron.core import parallel_state as ps

        cfg = self.config
        if cfg.load is None:
            raise ValueError(f"{self.name}: `load` is required (an HF model directory or a chatgen checkpoint)")
        self.tp, self.pp = cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size
        self.ep = cfg.expert_model_parallel_size
        init_distributed(self.tp, self.pp, self.ep)
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
        """Build this rank's model (`model_provider`) and optimizer, then load `config.load` into them.

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
        self._train_params = [p for p in self.model.parameters() if p.requires_grad]
        # bf16/fp16 weights cannot take small updates (lr 1e-6 on a weight of 0.02 is below half its bf16 step, so
        # it rounds away): AdamW then steps fp32 master copies, with fp32 moments, and the model gets them cast
        # back after every step (as megatron's mixed-precision optimizer does). None in fp32.
        self._masters = None if self.dtype == torch.float32 else [p.detach().float() for p in self._train_params]
        self.optimizer = torch.optim.AdamW(
            self._masters or self._train_params, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
            eps=cfg.adam_eps, weight_decay=cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        self.load_checkpoint(cfg.load)  # after the optimizer: a chatgen checkpoint restores its state and LR step

    def shutdown(self) -> None:
        """Release the model and megatron-core's parallel groups (and torch.distributed), so that this process can
        start another model, e.g. the next run of a test session. Safe to call twice."""
        from megatron.core import parallel_state as ps

        self.model = self.optimizer = self._masters = None
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
        `_max`: chatgen.rlhf.losses.reduce_metrics), plus "grad_norm", "lr" and
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
        self.model.train()
        self.model.zero_grad(set_to_none=True)
        self.optimizer.zero_grad(set_to_none=True)
        metrics = self._run_schedule(micro_batches, loss_fn, forward_only=False)
        if self.spec.is_moe:
            metrics.update(self._moe_metrics(len(micro_batches)))
        grad_norm = self._finalize_grads()
        if not math.isfinite(grad_norm):  # a NaN/inf grad would poison the weights, and vLLM after the sync
            self.model.zero_grad(set_to_none=True)
            self.skipped_steps += 1
            metrics.update(grad_norm=grad_norm, lr=self.optimizer.param_groups[0]["lr"], skipped_step=1.0)
            return metrics
        if self._masters is not None:  # grads into the fp32 masters; clipping and the step happen there
            for master, p in zip(self._masters, self._train_params):
                master.grad = None if p.grad is None else p.grad.float()
        if self.config.clip_grad > 0 and grad_norm > self.config.clip_grad:
            for p in self.optimizer.param_groups[0]["params"]:
                if p.grad is not None:
                    p.grad.mul_(self.config.clip_grad / (grad_norm + 1e-6))
        self.optimizer.step()
        if self._masters is not None:
            with torch.no_grad():
                for master, p in zip(self._masters, self._train_params):
                    p.copy_(master)
        self.scheduler.step()
        self.iteration += 1
        metrics.update(grad_norm=grad_norm, lr=self.optimizer.param_groups[0]["lr"], skipped_step=0.0)
        return metrics

    def save_checkpoint(self, path) -> str:
        """Write model shards (+ optimizer state) to directory `path` atomically; returns the path.

        Layout: chatgen_megatron.json (HF config, TP, PP, iteration), model_tp{t}_pp{p}.safetensors,
        optim_tp{t}_pp{p}.pt (torch.save of tensors only; read back with weights_only=True). Ranks write into
        the staging directory of chatgen.checkpoint_io, then rank 0 moves it into place, so a crash never
        leaves a half-written `path`.
        """
        path = Path(path)
        if dist.get_rank() == 0:
            begin_directory(path)
        dist.barrier()
        tmp = staging_path(path)
        state = self._canonical_state()  # collective over EP
        if self.dp_rank == 0:
            save_file({k: v.detach().contiguous().cpu() for k, v in state.items()},
                      str(megatron_shard_file(tmp, self.tp_rank, self.pp_rank)))
        if self._optimizer_file(tmp) is not None:
            torch.save({"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                        "master_params": self._masters}, self._optimizer_file(tmp))
        if dist.get_rank() == 0:
            write_megatron_meta(tmp, self.hf_config, self.tp, self.pp, self.padded_vocab_size, self.iteration,
                                optimizer=True, ep=self.ep)
        dist.barrier()
        if dist.get_rank() == 0:
            commit_directory(path)
        dist.barrier()
        return str(path)

    def load_checkpoint(self, path) -> None:
        """Load weights from an HF directory (converted to this rank's shard) or a chatgen checkpoint.

        A chatgen checkpoint must have this run's TP and PP (convert it with `chatgen convert` otherwise);
        its optimizer state is restored when an optimizer exists.
        """
        path = Path(path)
        meta = read_megatron_meta(path)
        if meta is not None:
            have = (meta["tensor_model_parallel_size"], meta["pipeline_model_parallel_size"])
            if have != (self.tp, self.pp):
                raise ValueError(f"{path}: checkpoint has TP, PP = {have} but this run uses {(self.tp, self.pp)}; "
                                 f"reshard it: chatgen convert --to hf --input {path} --output HF_DIR")
            self._load_canonical_state(_read_checkpoint_file(read_megatron_shard, path, self.tp_rank, self.pp_rank),
                                       source=str(path))
            self.iteration = meta.get("iteration", 0)
            if self.optimizer is not None and meta.get("optimizer"):  # saved with one: it must come back
                saved_ep = meta.get("expert_model_parallel_size", 1)
                if saved_ep != self.ep:
                    raise ValueError(f"{path}: its optimizer state was saved at expert_model_parallel_size={saved_ep}, "
                                     f"this run uses {self.ep}; resume with {saved_ep} (the weights alone load at "
                                     "any EP: convert the checkpoint to HF and start from that)")
                optim = self._optimizer_file(path, reading=True)
                if not optim.exists():
                    raise FileNotFoundError(
                        f"{optim} is missing: this checkpoint was saved with its optimizer state, and training on "
                        "without it would restart AdamW's moments and LR schedule (a much larger first update); "
                        "restore the file, or resume from an earlier checkpoint")
                saved = _read_checkpoint_file(torch.load, optim, weights_only=True)
                self.optimizer.load_state_dict(saved["optimizer"])
                self.scheduler.load_state_dict(saved["scheduler"])
                if self._masters is not None and saved.get("master_params") is not None:
                    with torch.no_grad():  # the fp32 masters keep the bits the bf16 weights lost
                        for master, value in zip(self._masters, saved["master_params"]):
                            master.copy_(value)
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

    # ---- library API ------------------------------------------------------------------------------

    def hf_weights(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> HFWeights:
        """This model's weights as HF-named full tensors (gathered over TP, broadcast over PP), bucket by bucket:
        the trainer's one public way out for its weights (chatgen/training/hf_export.py). Collective: call on
        every rank; at most about two buckets of extra memory, never a copy of the model."""
        return HFWeights(self, bucket_bytes)

    def hf_state_dict(self) -> dict:
        """The whole model as an HF state dict (a full copy; for tests and `chatgen convert`). Collective."""
        return {name: t.clone() for bucket in self.hf_weights().buckets() for name, t in bucket}

    # ---- internals --------------------------------------------------------------------------------

    def _layer_spec(self, tconfig):
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        if torch.cuda.is_available():
            try:
                from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
                import transformer_engine  # noqa: F401

                return get_gpt_layer_with_transformer_engine_spec(num_experts=tconfig.num_moe_experts,
                                                                  qk_layernorm=tconfig.qk_layernorm)
            except ImportError:
                pass
        return get_gpt_layer_local_spec(num_experts=tconfig.num_moe_experts, normalization="RMSNorm",
                                        qk_layernorm=tconfig.qk_layernorm)

    # Transformer Engine fuses the norms into the next linear; chatgen's mappings use the local-spec names.
    _TE_NAMES = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
                 "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}

    def _to_module_name(self, name: str) -> str:
        for local, te in self._TE_NAMES.items():
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

    def _optimizer_file(self, directory, reading: bool = False):
        """Where this rank's optimizer state goes in a checkpoint directory; None when another rank writes it (one
        writer per TP x PP x EP coordinate: the expert-data-parallel rank 0)."""
        from megatron.core import parallel_state as ps

        if not reading and ps.get_expert_data_parallel_rank() != 0:
            return None
        return Path(directory) / (f"optim_tp{self.tp_rank}_pp{self.pp_rank}"
                                  + (f"_ep{self.ep_rank}" if self.ep > 1 else "") + ".pt")

    def _canonical_state(self) -> dict:
        """This stage's weights under their checkpoint names; with EP > 1 the other EP ranks' experts are
        all-gathered (collective over the EP group) so the checkpoint holds every expert."""
        state = {canonical: self.local_param(sp.local_name) for sp, canonical in self._stage_params()}
        if self.ep > 1:
            from megatron.core import parallel_state as ps

            mine = [state[canonical] for sp, canonical in self._stage_params() if sp.expert is not None]
            flat = torch.cat([t.detach().reshape(-1) for t in mine])
            gathered = torch.empty(self.ep * flat.numel(), dtype=flat.dtype, device=flat.device)
            dist.all_gather_into_tensor(gathered, flat, group=ps.get_expert_model_parallel_group())
            for rank, piece in enumerate(gathered.view(self.ep, -1)):
                experts = [canonical for sp, canonical in self._stage_params(rank) if sp.expert is not None]
                state.update(zip(experts, unflatten(piece, [t.shape for t in mine])))
        return state

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
        if getattr(self, "_masters", None) is not None:  # the optimizer steps the masters: refresh them too
            for master, p in zip(self._masters, self._train_params):
                master.copy_(p)

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
            forward_step_func=forward_step_func, data_iterator=iter(zip(micro_batches, plans)), model=[self.model],
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

    @torch.no_grad()
    def _finalize_grads(self) -> float:
        """Sum QK-norm grads over TP, average grads over DP, sum the tied embedding's grads across first/last
        stage; return the global grad norm (counting TP-replicated params once)."""
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.tp > 1 and self.spec.qk_norm:
            # q/k_layernorm weights are replicated but each TP rank normalises only its own heads, so each holds
            # part of the gradient (megatron-core's finalize_model_grads sums them over TP the same way)
            for name, p in self.model.named_parameters():
                if p.grad is not None and ("q_layernorm" in name or "k_layernorm" in name):
                    dist.all_reduce(p.grad, group=ps.get_tensor_model_parallel_group())
        if self.dp > 1:
            for p in params:
                # an expert's weights (EP > 1: megatron marks them allreduce=False) exist once per EP group, and its
                # grad already sums the tokens of every EP rank: summed over the expert-data-parallel replicas
                expert = not getattr(p, "allreduce", True)
                group = ps.get_expert_data_parallel_group() if expert else ps.get_data_parallel_group()
                if dist.get_world_size(group) > 1:
                    dist.all_reduce(p.grad, group=group)
                p.grad /= self.dp
        if self.pp > 1 and self.spec.tie_word_embeddings and (self.is_first_stage or self.is_last_stage):
            w = self.model.shared_embedding_or_output_weight()
            if w.grad is None:
                w.grad = torch.zeros_like(w)
            dist.all_reduce(w.grad, group=ps.get_embedding_group())
        sq = torch.zeros(2, dtype=torch.float64, device=self.device)  # [every other param, EP-sharded experts]
        for p in params:
            if param_is_not_tensor_parallel_duplicate(p) and not (getattr(p, "shared_embedding", False)
                                                                  and not self.is_first_stage):
                sq[int(not getattr(p, "allreduce", True))] += p.grad.double().pow(2).sum()
        dist.all_reduce(sq[:1], group=ps.get_model_parallel_group())
        if self.ep > 1:  # the experts differ across EP ranks too
            dist.all_reduce(sq[1:], group=ps.get_expert_tensor_model_pipeline_parallel_group())
        return float(sq.sum().sqrt())


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
    except Exception as e:  # noqa: BLE001 - safetensors / torch.load raise many types for a truncated file
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
