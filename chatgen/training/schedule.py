"""How MegatronModule runs a batch: megatron-core's pipeline schedule over micro-batches (forward
only, for log-probs, or forward and backward, for a train step), and the micro-batches' positions
and masks.

A mixin of MegatronModule (chatgen.training.megatron_module), which calls `run_schedule` from
`forward_tokens` and `train_step`; the packing and logit-slicing hooks it drives per micro-batch are
the PackingHooks the module holds (packing_hooks.py).
"""

import torch
import torch.distributed as dist

from chatgen.core.metrics import reduce_metrics
from chatgen.core.train_batch import TrainBatch
from chatgen.training.micro_batches import padding_positions, weighted_metrics


class Schedule:
    """megatron-core's forward(-backward) schedule over micro-batches, for MegatronModule."""

    def run_schedule(self, micro_batches: list, loss_fn, forward_only: bool, weights=None):
        """Run megatron's pipeline schedule over micro-batches (all the same T, except token
        micro-batches, which run at pipeline_model_parallel_size 1).

        forward_only: returns logprobs (B, T-1) gathered over micro-batches (each right-padded
        with 0 to the widest), on every rank. Otherwise runs backward too and returns the loss_fn
        metrics averaged over micro-batches and DP, plus "padding_tokens_trained": positions
        without a token the model ran, over micro-batches and DP. `weights`: each micro-batch's
        loss weight (chatgen.training.micro_batches.loss_weights; None = their mean).
        """
        from megatron.core import parallel_state as ps
        from megatron.core.pipeline_parallel import get_forward_backward_func

        t = micro_batches[0]["input_ids"].shape[1]
        if self.seq_length and t > self.seq_length:
            raise ValueError(
                f"{self.name}: a batch of {t} tokens per sample is longer than seq_length="
                f"{self.seq_length}; raise seq_length in this model's config (up to the model's "
                "max_position_embeddings) or cut prompts / responses"
            )
        device = self.device
        micro_batches = [mb.to(device) for mb in micro_batches]
        b, t = micro_batches[0]["input_ids"].shape
        width = max(mb["input_ids"].shape[1] for mb in micro_batches)  # of the (B, T-1) outputs
        # forward only: packed when a loss mask says which outputs are read (forward_tokens)
        plans = (
            self.packing.plans(micro_batches, self.config.max_tokens_per_micro_batch)
            if self.packing.packs and (not forward_only or "loss_mask" in micro_batches[0])
            else [None] * len(micro_batches)
        )
        # the pipeline schedule exchanges (T, b, H) activations of the packed shape
        if plans[0] is not None:
            b, t = plans[0].input_ids.shape
        collected, padding = [], [0]
        # megatron divides each micro-batch's loss by their number: a weight w counts as w
        scales = [1.0] * len(micro_batches) if weights is None else weights
        scales = [w * len(micro_batches) for w in scales]

        def forward_step_func(data_iterator, model):
            mb, plan, scale = next(data_iterator)
            padding[0] += padding_positions(mb, plan)
            # shared-prefix packing: each prompt once (chatgen.training.prefix_packing)
            if plan is not None:
                # no pad in the router's figures
                moe = {"padding_mask": plan.segments < 0} if self.spec.is_moe else {}
                with self.packing.positions(plan.logit_positions, plan.position_ids):
                    logits = model(plan.input_ids, plan.position_ids, plan.attention_mask, **moe)
                if not self.is_last_stage:
                    return logits, None
                # (b, T-1), 0 where unread
                logprobs = plan.unpack(self.token_outputs(logits, plan.labels))
                return logprobs, loss_func_for(mb, scale)
            ids = mb["input_ids"]
            position_ids, mask = positions_and_mask(ids, mb.get("attention_mask"))
            moe = {}
            # no pad in the router's figures
            if self.spec.is_moe and mb.get("attention_mask") is not None:
                moe["padding_mask"] = ~mb["attention_mask"].bool()
            if self.config.moe_routing_replay:
                self._replay_routing(mb.get("routed_experts"), ids.shape)
            # Training: no logits before the first position any row's loss reads (the prompt); the
            # output layer is the largest matmul of a small model and its (b, T, vocab) result the
            # largest tensor.
            first = (
                first_scored_position(mb.get("loss_mask"))
                if self.packing.slices_logits and not forward_only
                else 0
            )
            with self.packing.positions(first):
                logits = model(ids, position_ids, mask, **moe)
            if not self.is_last_stage:
                return logits, None
            # (b, T-1-first): as if the rows began there
            logprobs = self.token_outputs(logits, ids[:, first:])
            if first:
                # (b, T-1), 0 where no loss reads
                logprobs = torch.nn.functional.pad(logprobs, (first, 0))
            return logprobs, loss_func_for(mb, scale)

        def loss_func_for(mb, scale):
            def loss_func(output):
                if loss_fn is None:
                    collected.append(output.detach())
                    return output.sum() * 0, {}
                loss, metrics = loss_fn(output, mb)
                collected.append(
                    {
                        k: float(v.detach() if torch.is_tensor(v) else v)
                        for k, v in {"loss": loss, **metrics}.items()
                    }
                )
                return (loss if weights is None else loss * scale), {}

            return loss_func

        get_forward_backward_func()(
            forward_step_func=forward_step_func,
            data_iterator=iter(zip(micro_batches, plans, scales)),
            model=[self.ddp],
            num_microbatches=len(micro_batches),
            seq_length=t,
            micro_batch_size=b,
            forward_only=forward_only,
        )

        if forward_only:  # logprobs live on the last stage: send them to every stage
            if any(o.shape[1] != width - 1 for o in collected):  # token micro-batches
                collected = [
                    torch.nn.functional.pad(o, (0, width - 1 - o.shape[1])) for o in collected
                ]
            out = (
                torch.cat(collected)
                if self.is_last_stage
                else torch.empty(
                    sum(mb["input_ids"].shape[0] for mb in micro_batches),
                    width - 1,
                    dtype=torch.float32,
                    device=device,
                )
            )
            if self.pp > 1:
                dist.broadcast(
                    out,
                    ps.get_pipeline_model_parallel_last_rank(),
                    group=ps.get_pipeline_model_parallel_group(),
                )
            return out.cpu()
        if not collected:
            metrics = None
        elif weights is None:
            metrics = reduce_metrics(collected)
        else:
            metrics = weighted_metrics(collected, weights)
        if self.pp > 1:  # metrics live on the last stage
            box = [metrics]
            dist.broadcast_object_list(
                box,
                ps.get_pipeline_model_parallel_last_rank(),
                group=ps.get_pipeline_model_parallel_group(),
            )
            metrics = box[0]
        if self.dp > 1:
            parts = [None] * self.dp
            dist.all_gather_object(parts, metrics, group=ps.get_data_parallel_group())
            metrics = reduce_metrics(parts)
        padding = torch.tensor(padding, dtype=torch.float64)
        if self.dp > 1:
            dist.all_reduce(padding, group=ps.get_data_parallel_group())
        return {**metrics, "padding_tokens_trained": float(padding)}


def split_batch(data, micro_batch_size: int) -> list:
    """`data` (a TrainBatch, or a dict of its fields and extras) as consecutive TrainBatch
    micro-batches of `micro_batch_size` rows."""
    return TrainBatch.of(data).split(micro_batch_size)


def first_scored_position(loss_mask: torch.Tensor | None) -> int:
    """The first position t whose entry (b, T-1) loss_mask[:, t] is 1 in any row (entry t scores
    token t+1, predicted from position t); 0 without a mask or when it is empty."""
    if loss_mask is None:
        return 0
    scored = loss_mask.any(dim=0).nonzero()
    return int(scored[0]) if len(scored) else 0


def positions_and_mask(input_ids: torch.Tensor, attention_mask: torch.Tensor | None):
    """Position ids (b, T) and megatron's boolean mask (b, 1, T, T), True = do not attend:
    causal, plus padding keys when attention_mask is given (positions then count real tokens, so
    left padding works)."""
    b, t = input_ids.shape
    causal = torch.triu(torch.ones(t, t, dtype=torch.bool, device=input_ids.device), diagonal=1)
    if attention_mask is None:
        return torch.arange(t, device=input_ids.device).expand(b, t), causal.view(1, 1, t, t)
    keep = attention_mask.bool()
    positions = (keep.long().cumsum(-1) - 1).clamp(min=0)
    mask = causal.view(1, 1, t, t) | ~keep.view(b, 1, 1, t)
    return positions, mask
