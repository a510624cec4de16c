"""Weights in and out of a running engine: `load_weights` (the reload every weight sync ends in) and
`expert_weights` (an MoE model's experts as the engine holds them, for `chatgen check-sync`).
"""

import re
from typing import Iterable

from vllm import LLM

from chatgen.generation.vllm.adapter import patches
from chatgen.generation.vllm.adapter.engine import in_process_workers


def load_weights(llm: LLM, named_tensors: Iterable, reset_prefix_cache: bool = True) -> None:
    """Write HF-format `(name, tensor)` pairs into the running engine, in place, on every rank.

    Names and layouts are those of the HF checkpoint (`model.layers.0.self_attn.q_proj.weight`,
    unfused q/k/v and gate/up, full unsharded tensors): vLLM's own loader fuses, shards and (on CPU)
    repacks them. With an in-process executor (uniproc, external_launcher) the iterable is consumed
    lazily, so a generator streams without holding a second copy; with the multiprocess executor it
    is materialised and pickled to each worker. A subset of the weights is fine. Afterwards a tied
    LM head is re-packed (CPU) and (reset_prefix_cache) the prefix cache is reset, so no KV computed
    with the old weights is reused; the engine loop passes False and keeps the cache apart itself
    (chatgen.generation.vllm.engine_loop).
    """
    weights = named_tensors if in_process_workers(llm) else list(named_tensors)
    past, held = LOADED_PAST_RELOAD.get(llm.llm_engine.model_config.hf_config.model_type), []
    if past is not None:
        weights = _withholding(weights, past, held)
        weights = weights if in_process_workers(llm) else list(weights)
    try:
        llm.collective_rpc(
            "reload_weights", kwargs=dict(weights_iterator=weights, is_checkpoint_format=True)
        )
        if held:
            llm.collective_rpc(_load_past_reload, kwargs=dict(weights=held))
    except BaseException:
        llm.collective_rpc(patches.abandon_reload)  # so that the next reload (the re-sync) can work
        raise
    llm.collective_rpc(patches.refresh_tied_lm_head)
    # vLLM refuses while requests hold cache blocks
    if reset_prefix_cache and llm.reset_prefix_cache() is False:
        raise RuntimeError(
            "weights were loaded but vLLM kept its prefix cache (requests still hold KV blocks), so "
            "cached prompts would reuse KV computed with the old weights; sync only between "
            "generation calls, when no request is running"
        )


# Checkpoint names that a family's vLLM loader copies into the parameters itself, not through their
# weight loaders: vLLM 0.32's layer-wise reload (its parameters on the meta device meanwhile) never
# sees them and puts the old tensors back. GPT-OSS: the experts' fused tensors and the attention
# sinks (a synced tiny GPT-OSS kept its random experts: 0.60 off in log-prob). They load after the
# reload, as a first load does.
LOADED_PAST_RELOAD = {"gpt_oss": re.compile(r"\.mlp\.experts\.|\.sinks$")}


def _withholding(weights, pattern, held: list):
    """`weights` without the names `pattern` finds, which go to `held` as the stream passes."""
    for name, tensor in weights:
        if pattern.search(name):
            held.append((name, tensor))
        else:
            yield name, tensor


def _load_past_reload(worker, weights) -> None:
    """In a worker: the model's own loader writes `weights` into the live parameters, then each
    mixture-of-experts layer redoes its post-load processing (the CPU backend's prepack of w13 /
    w2)."""
    model = worker.model_runner.get_model()
    model.load_weights(iter(weights))
    for module in model.modules():
        if hasattr(module, "w13_weight") and hasattr(module, "quant_method"):
            module.quant_method.process_weights_after_loading(module)


def expert_weights(llm: LLM) -> list:
    """Each MoE layer's expert weights as the engine holds them, in layer order: [(w13, w2)] with
    w13 (E, 2I, H) = [gate; up] per expert and w2 (E, H, I) = down (vLLM's fused expert layout,
    `FusedMoE.w13_weight` / `w2_weight`), put back together over the engine's TP ranks (each
    holds an I/TP slice of every expert). Empty for a dense model. Used by `chatgen check-sync`
    to check every expert weight after a sync."""
    import torch

    per_rank = llm.collective_rpc(_expert_weights)
    if len(per_rank) == 1:
        return per_rank[0]
    out = []
    for layer in zip(*per_rank):  # [(w13, w2) of each TP rank]
        gates, ups = zip(*(w13.chunk(2, dim=1) for w13, _ in layer))
        out.append((torch.cat([*gates, *ups], dim=1), torch.cat([w2 for _, w2 in layer], dim=2)))
    return out


def _expert_weights(worker) -> list:
    import torch

    out = []
    for m in worker.model_runner.get_model().modules():
        if isinstance(getattr(m, "w13_weight", None), torch.Tensor) and hasattr(m, "w2_weight"):
            w13, w2 = m.w13_weight.detach().cpu(), m.w2_weight.detach().cpu()
            experts = patches.cpu_experts(m)
            # undo the CPU prepack (see _unpacked); a padded intermediate size is cut back
            if experts is not None:
                size = m.moe_config.intermediate_size_per_partition
                w13, w2 = _unpacked(w13, experts.isa), _unpacked(w2, experts.isa)
                padded = w13.shape[1] // 2
                w13, w2 = (
                    torch.cat([w13[:, :size], w13[:, padded : padded + size]], dim=1),
                    w2[:, :, :size],
                )
            out.append((w13.clone(), w2.clone()))
    return out


def _unpacked(packed, isa: str):
    """Expert weights (E, N, K) as they were before the CPU backend's prepack. The prepack moves
    elements without changing them, the same way in every expert: prepacking one expert's element
    indices (in base-256 digits, which every float dtype holds exactly) says where each element
    went."""
    import torch
    from vllm import _custom_ops as ops

    n = packed[0].numel()
    index, source = torch.arange(n), torch.zeros(n, dtype=torch.long)
    for digit in range(max(1, (n.bit_length() + 7) // 8)):
        digits = ((index >> (8 * digit)) & 255).to(packed.dtype).view(1, *packed.shape[1:])
        source += ops.cpu_prepack_moe_weight(digits, isa).reshape(-1).long() << (8 * digit)
    out = torch.empty_like(packed).reshape(len(packed), -1)
    out[:, source] = packed.reshape(len(packed), -1)
    return out.view_as(packed)
