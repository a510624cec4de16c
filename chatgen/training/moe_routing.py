"""`MegatronModule`'s mixture-of-experts routing: replaying the experts the engine chose
(moe_routing_replay, `RoutingReplay`), counting the tokens each expert gets, and the `moe/*`
metrics.

`MoERouting` is a mixin of `chatgen.training.megatron_module.MegatronModule` (its routers, set up in
`setup()`).
"""

import torch
import torch.distributed as dist

from chatgen.models import layout


class MoERouting:
    """The routers' forward hooks and figures for train_step."""

    def _replay_routing(self, routed: torch.Tensor | None, shape) -> None:
        """Make this stage's MoE layers use the experts the engine chose (moe_routing_replay) in
        the next forward.

        routed: (b, T, num_layers, k) long, the batch's `routed_experts`
        (chatgen.rollout.RolloutBatch); -1 where the engine routed nothing (padding, a sample's
        last token), where the router chooses itself."""
        if routed is None:
            raise ValueError(
                f"{self.name}: moe_routing_replay is true but the batch has no routed_experts; have the "
                "engine record them (return_routed_experts: true on the vllm model) or set "
                "moe_routing_replay: false"
            )
        k = self.spec.moe_router_topk
        if tuple(routed.shape) != (*shape, self.spec.num_layers, k):
            raise ValueError(
                f"{self.name}: routed_experts has shape {tuple(routed.shape)}, the batch needs "
                f"{(*shape, self.spec.num_layers, k)} (samples, tokens, layers, experts per token)"
            )
        layers = layout.stage_layers(self.spec, self.pp, self.pp_rank)
        # (T, b, layers, k): megatron's token order
        routed = routed[:, :, layers.start : layers.stop].transpose(0, 1)
        for j, router in enumerate(self._routers):
            router.router_replay.target = routed[:, :, j].reshape(-1, k)

    def _count_routed_tokens(self, _router, args, output):
        """Forward hook of every MoE router: add, while training, how many real tokens (not
        padding: the router's second argument, True = pad) each expert got to
        `self._expert_tokens`."""
        if not (self.model.training and torch.is_grad_enabled()):
            return
        routing_map = output[1].detach()  # (tokens, E) bool: the experts each token goes to
        if len(args) > 1 and args[1] is not None:
            routing_map = routing_map[~args[1].reshape(-1)]
        counts = routing_map.sum(dim=0).double()
        self._expert_tokens = (
            counts if self._expert_tokens is None else self._expert_tokens + counts
        )

    @torch.no_grad()
    def _moe_metrics(self, num_micro_batches: int) -> dict:
        """This train_step's router figures, over every layer, micro-batch and data-parallel
        rank: moe/expert_usage/<e> = expert e's share of the routed token slots (1/E each when
        balanced) and, with moe_aux_loss_coeff > 0, moe/load_balancing_loss (megatron's aux loss
        before its coefficient, layer mean). Collective over PP and DP."""
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.moe.moe_utils import (
            clear_aux_losses_tracker,
            get_moe_layer_wise_logging_tracker,
        )

        counts = (
            self._expert_tokens
            if self._expert_tokens is not None
            else torch.zeros(self.spec.num_experts, dtype=torch.float64, device=self.device)
        )
        self._expert_tokens = None
        tracker = get_moe_layer_wise_logging_tracker().get("load_balancing_loss")
        loss = (
            tracker["values"].double().sum()
            if tracker
            else torch.zeros((), dtype=torch.float64, device=self.device)
        ).view(1)
        clear_aux_losses_tracker()
        both = torch.cat([counts.to(self.device), loss])
        if self.pp > 1:  # each stage holds its own layers
            dist.all_reduce(both, group=ps.get_pipeline_model_parallel_group())
        if self.dp > 1:
            dist.all_reduce(both, group=ps.get_data_parallel_group())
        counts, loss = both[:-1], both[-1]
        metrics = {
            f"moe/expert_usage/{e}": float(c)
            for e, c in enumerate(counts / counts.sum().clamp(min=1))
        }
        if self.config.moe_aux_loss_coeff > 0:
            metrics["moe/load_balancing_loss"] = float(
                loss / (self.spec.num_layers * num_micro_batches * self.dp)
            )
        return metrics


class RoutingReplay:
    """A router's top-k from recorded experts (moe_routing_replay): megatron-core's TopKRouter
    asks its `router_replay` for the top-k (`get_replay_topk`, the interface of megatron's
    RouterReplay); this one answers with `target` (tokens, k), each token's recorded experts, and
    with the router's own choice on rows of -1 (nothing recorded). The router then takes its
    probabilities at those experts, so gradients flow as usual."""

    target = None  # (tokens, k) long, set before each forward by MegatronModule._replay_routing

    def get_replay_topk(
        self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None
    ):
        probs, own = default_compute_topk(
            scores, topk, num_groups=num_groups, group_topk=group_topk
        )
        if self.target is None:
            return probs, own
        chosen = torch.where(self.target[:, :1] >= 0, self.target.to(own.device), own)
        return scores.gather(1, chosen), chosen
