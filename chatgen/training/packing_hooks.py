"""The model hooks behind `MegatronModule`'s shared-prefix packing and logit slicing: which
positions the output layer computes, and rotary embeddings that follow each packed row's position
ids (the plans themselves: chatgen/training/prefix_packing.py).

`PackingHooks` is an object `chatgen.training.megatron_module.MegatronModule` holds
(`self.packing`): it installs its hooks on the model once and keeps the positions they read while a
micro-batch runs (`positions`, set by `run_schedule`).
"""

import contextlib

import torch

from chatgen.training.prefix_packing import pack_shared_prefix


class PackingHooks:
    """One model chunk's logit slicing and shared-prefix packing (see the module docstring)."""

    def __init__(self, model, is_last_stage: bool, pp: int, wanted: bool):
        """Install the hooks on `model`; `wanted`: the config allows packing (pack_shared_prefix)
        and the model's other features do (no expert parallelism, no routing replay)."""
        self.pp = pp  # (the model is not kept: its hooks hold this object, not the other way round)
        self._logits_from, self._rope_positions = 0, None
        output_layer = getattr(model, "output_layer", None) if is_last_stage else None
        # train_step computes logits only where a loss reads them
        self.slices_logits = output_layer is not None
        if self.slices_logits:
            output_layer.register_forward_pre_hook(self._select_logit_positions)
        # shared-prefix packing needs the output layer's position selection (last stage), attention
        # that reads the explicit mask (megatron's own; Transformer Engine's fused kernels may apply
        # their causal type instead: not verified, so not packed) and rotary embeddings that follow
        # position ids; all pipeline stages must decide alike (MegatronModule.setup agrees them)
        self.packs = (
            wanted
            and self._attention_reads_the_mask(model)
            and (self.slices_logits or not is_last_stage)
            and self._rope_follows_position_ids(model)
        )

    @contextlib.contextmanager
    def positions(self, logits_from=0, rope_positions=None):
        """While a micro-batch runs: the output layer computes logits from position `logits_from`
        (an int, 0 = all; or (b, K) positions per row), the rotary embedding reads
        `rope_positions` (b, T) or its own 0..T-1; a later plain call of the model computes every
        position."""
        self._logits_from, self._rope_positions = logits_from, rope_positions
        try:
            yield
        finally:
            self._logits_from, self._rope_positions = 0, None

    def plans(self, micro_batches: list, capacity: int | None = None) -> list:
        """Shared-prefix plans for the micro-batches (chatgen.training.prefix_packing), all of
        one shape when pipeline stages exchange activations; [None, ...] (train unpacked) unless
        every micro-batch packs. `capacity`: token micro-batches' budget (every row packs)."""
        plans = [
            pack_shared_prefix(
                mb["input_ids"], mb.get("attention_mask"), mb.get("loss_mask"), capacity
            )
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
        """Forward pre-hook of the output layer: its input hidden states (T, b, H), sequence
        first, only where logits are needed: from position `self._logits_from` on when it is an
        int (0 = all), or at the positions of a (b, K) tensor, per row (shared-prefix packing).
        Set per micro-batch by `run_schedule`."""
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

    def _attention_reads_the_mask(self, model) -> bool:
        """Every layer's core attention is megatron's DotProductAttention (the local spec), which
        applies the explicit attention mask it is given."""
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        layers = getattr(getattr(model, "decoder", None), "layers", [])
        return all(
            type(layer.self_attention.core_attention) is DotProductAttention for layer in layers
        )

    def _rope_follows_position_ids(self, model) -> bool:
        """Make the model's rotary embedding honour the position ids (megatron's uses 0..T-1
        whatever the ids), so that packed rows keep their own positions; False for a model whose
        positions cannot follow them."""
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

        kind = getattr(model, "position_embedding_type", None)
        if kind == "learned_absolute":  # the embedding reads position_ids itself
            return True
        if kind != "rope" or type(getattr(model, "rotary_pos_emb", None)) is not RotaryEmbedding:
            return False
        # one hook per model: setup() calls this once for each model it builds
        model.rotary_pos_emb.register_forward_hook(self._rope_at_positions)
        return True

    def _rope_at_positions(self, _module, _args, emb):
        """Forward hook of the rotary embedding: (T, 1, 1, D) for positions 0..T-1 -> (T, b, 1,
        D) at each row's `self._rope_positions` (b, T) while a packed micro-batch runs; unchanged
        otherwise."""
        if self._rope_positions is None:
            return None
        return emb[:, 0, 0][self._rope_positions.t()].unsqueeze(2)
