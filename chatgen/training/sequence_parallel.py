"""`sequence_parallel` with megatron-core's local layer spec (no Transformer Engine, no Apex: CPU,
or a GPU without them): the norms become ones whose weights megatron knows to reduce over TP.

Under sequence parallelism each TP rank holds 1/TP of the tokens between the attention and MLP
blocks, so each rank's gradient of a norm weight covers its tokens only; megatron sums those over TP
(finalize_model_grads) for weights marked `sequence_parallel`. Its fallback norm
(`WrappedTorchNorm`) refuses sequence parallelism instead of marking them; `SequenceParallelNorm` is
torch's norm with the mark. Transformer Engine's and Apex's norms do this themselves.
"""

import dataclasses

import torch


class SequenceParallelNorm:
    """What megatron's WrappedTorchNorm builds (torch's RMSNorm / LayerNorm, same parameter
    names), with the weight (and bias) marked `sequence_parallel` as megatron's own norms mark
    theirs."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_):
        norm = {"RMSNorm": torch.nn.RMSNorm, "LayerNorm": torch.nn.LayerNorm}[config.normalization]
        module = norm(hidden_size, eps=eps)
        for param in module.parameters():
            param.sequence_parallel = config.sequence_parallel
        return module


def with_sequence_parallel_norms(spec, tconfig, pp_rank: int):
    """The local layer `spec` with every WrappedTorchNorm replaced by SequenceParallelNorm, as
    the block spec that also names the final norm (a layer spec alone gets megatron's default
    final norm, the refusing one)."""
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    def swap(node):
        if node is WrappedTorchNorm:
            return SequenceParallelNorm
        if isinstance(node, ModuleSpec):
            return dataclasses.replace(
                node, module=swap(node.module), submodules=swap(node.submodules)
            )
        if dataclasses.is_dataclass(node) and not isinstance(node, type):
            return dataclasses.replace(
                node,
                **{f.name: swap(getattr(node, f.name)) for f in dataclasses.fields(node) if f.init},
            )
        return node

    layer = swap(spec)
    return TransformerBlockSubmodules(
        layer_specs=[layer] * get_num_layers_to_build(tconfig, pp_rank=pp_rank),
        layer_norm=SequenceParallelNorm,
    )
