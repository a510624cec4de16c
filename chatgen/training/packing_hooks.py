"""The model hooks behind `MegatronModule`'s shared-prefix packing and logit slicing: which positions the
output layer computes, and rotary embeddings that follow each packed row's position ids
(the plans themselves: chatgen/training/prefix_packing.py).

`PackingHooks` is a mixin of `chatgen.training.megatron_module.MegatronModule`.
"""

import torch

from chatgen.training.prefix_packing import pack_shared_prefix


class PackingHooks:
    """Set up by `setup()`, driven per micro-batch by `run_schedule`."""

    def _pack(self, micro_batches: list) -> list:
        """Shared-prefix plans for the micro-batches (chatgen.training.prefix_packing), all of one shape when
        pipeline stages exchange activations; [None, ...] (train unpacked) unless every micro-batch packs."""
        plans = [
            pack_shared_prefix(mb["input_ids"], mb.get("attention_mask"), mb.get("loss_mask"))
            for mb in micro_batches
        ]
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
        of a (b, K) tensor, per row (shared-prefix packing). Set per micro-batch by `run_schedule`."""
        at = self._logits_from
        if torch.is_tensor(at):
            hidden = args[0]
            return (
                hidden.gather(0, at.t().unsqueeze(-1).expand(-1, -1, hidden.shape[-1])),
                *args[1:],
            )
        if at:
            return (args[0][at:], *args[1:])
        return None

    def _attention_reads_the_mask(self) -> bool:
        """Every layer's core attention is megatron's DotProductAttention (the local spec), which applies the
        explicit attention mask it is given."""
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        layers = getattr(getattr(self.model, "decoder", None), "layers", [])
        return all(
            type(layer.self_attention.core_attention) is DotProductAttention for layer in layers
        )

    def _rope_follows_position_ids(self) -> bool:
        """Make the model's rotary embedding honour the position ids (megatron's uses 0..T-1 whatever the ids),
        so that packed rows keep their own positions; False for a model whose positions cannot follow them."""
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

        kind = getattr(self.model, "position_embedding_type", None)
        if kind == "learned_absolute":  # the embedding reads position_ids itself
            return True
        if (
            kind != "rope"
            or type(getattr(self.model, "rotary_pos_emb", None)) is not RotaryEmbedding
        ):
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
