"""HF <-> Megatron parameter layouts under tensor (TP) and pipeline (PP) parallelism: pure tensor
functions.

Layout kinds (a family's `param_mappings`, e.g. chatgen/models/llama.py, names one per Megatron
parameter):

    replicated  same tensor on every TP rank (RMSNorm weights)
    column      split along dim 0 (output features)
    row         split along dim 1 (input features: linear_proj, linear_fc2)
    vocab       rows padded with zeros to the padded vocab size, then split along dim 0
    qkv         HF q, k, v interleaved per query group, [q_1..q_{np/ng}, k, v] x ng, then split along dim 0.
                Megatron splits the fused tensor evenly over TP whether num_query_groups >= TP (each rank
                holds ng/TP whole groups) or < TP (a rank holds part of one group's block; attention
                all-gathers it), so one rule covers both.
    gate_up     HF gate and up each split along dim 0; TP rank r holds [gate_r; up_r]

Expert parallelism (EP, mixture-of-experts models): EP rank r holds experts [r*E/EP, (r+1)*E/EP) of
every layer under local names `mlp.experts.local_experts.{0..E/EP-1}`; the rest of the model is
replicated over EP (megatron carves EP out of the data-parallel ranks), and each expert is split
over TP like a dense MLP. A checkpoint (`hf_to_megatron`, `chatgen convert`,
`MegatronModule.save_checkpoint`) always holds every expert of a stage: EP is a runtime layout, like
DP.

Pipeline stage p of PP holds layers [p*L/PP, (p+1)*L/PP) under local names
`decoder.layers.{0..L/PP-1}`, the embedding on the first stage and the final norm + output layer on
the last. With tied embeddings and PP > 1 the last stage keeps its own copy of the embedding as
`output_layer.weight` (kept equal by training); HF -> Megatron fills it, Megatron -> HF reads the
embedding from the first stage.

Every function here is index arithmetic only, so HF -> Megatron -> HF gives back the same bits
(tests/unit/test_convert.py). Imports neither Megatron nor vLLM.
"""

import dataclasses

import torch

from chatgen.models import family
from chatgen.models.spec import ModelSpec, ParamMapping


def _split(t: torch.Tensor, n: int, dim: int, what: str) -> list[torch.Tensor]:
    if t.shape[dim] % n:
        raise ValueError(f"{what}: dim {dim} of shape {tuple(t.shape)} is not divisible by TP={n}")
    return list(t.chunk(n, dim=dim))


# ---- one parameter
# ------------------------------------------------------------------------------------


def qkv_to_megatron(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_query_groups: int
) -> torch.Tensor:
    """HF q (np*hn, ...), k, v (ng*hn, ...) -> Megatron fused ((np + 2ng)*hn, ...), grouped per
    query group."""
    ng, rest = num_query_groups, q.shape[1:]
    return torch.cat(
        [q.reshape(ng, -1, *rest), k.reshape(ng, -1, *rest), v.reshape(ng, -1, *rest)], dim=1
    ).reshape(-1, *rest)


def qkv_to_hf(
    fused: torch.Tensor, spec: ModelSpec
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of qkv_to_megatron on the full (TP-merged) fused tensor."""
    ng, hn, rest = spec.num_query_groups, spec.head_dim, fused.shape[1:]
    per_group = spec.num_attention_heads // ng * hn
    q, k, v = fused.reshape(ng, per_group + 2 * hn, *rest).split([per_group, hn, hn], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def to_megatron_shards(
    kind: str, hf: list[torch.Tensor], spec: ModelSpec, tp: int, padded_vocab: int, what: str = ""
) -> list[torch.Tensor]:
    """HF tensors of one mapping -> the TP shards of the Megatron parameter (views where
    possible)."""
    if kind == "replicated":
        return [hf[0]] * tp
    if kind == "column":
        return _split(hf[0], tp, 0, what)
    if kind == "row":
        return _split(hf[0], tp, 1, what)
    if kind == "vocab":
        t = hf[0]
        if t.shape[0] > padded_vocab:
            raise ValueError(
                f"{what}: {t.shape[0]} vocab rows do not fit the padded vocab {padded_vocab}"
            )
        padded = (
            torch.cat([t, t.new_zeros(padded_vocab - t.shape[0], *t.shape[1:])])
            if padded_vocab > t.shape[0]
            else t
        )
        return _split(padded, tp, 0, what)
    if kind == "qkv":
        return _split(qkv_to_megatron(*hf, spec.num_query_groups), tp, 0, what)
    if kind == "gate_up":
        gates, ups = _split(hf[0], tp, 0, what), _split(hf[1], tp, 0, what)
        return [torch.cat([g, u]) for g, u in zip(gates, ups)]
    raise ValueError(f"{what}: unknown layout kind {kind!r}")


def to_hf(kind: str, shards: list[torch.Tensor], spec: ModelSpec) -> list[torch.Tensor]:
    """The TP shards of one Megatron parameter -> its HF tensors (inverse of to_megatron_shards)."""
    if kind == "replicated":
        return [shards[0]]
    if kind == "column":
        return [torch.cat(shards) if len(shards) > 1 else shards[0]]
    if kind == "row":
        return [torch.cat(shards, dim=1) if len(shards) > 1 else shards[0]]
    if kind == "vocab":
        full = torch.cat(shards) if len(shards) > 1 else shards[0]
        return [full[: spec.vocab_size]]
    if kind == "qkv":
        return list(qkv_to_hf(torch.cat(shards) if len(shards) > 1 else shards[0], spec))
    if kind == "gate_up":
        halves = [s.chunk(2) for s in shards]
        if len(shards) == 1:
            return list(halves[0])
        return [torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])]
    raise ValueError(f"unknown layout kind {kind!r}")


# ---- whole model
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StageParam:
    """One Megatron parameter of one pipeline stage, with the HF tensors it maps to."""

    local_name: str  # name in that stage's state dict
    hf: dict  # {HF name: shape}, in the order the layout kind expects
    kind: str
    duplicate: bool = (
        False  # tied output_layer copy on the last stage: not part of the HF checkpoint
    )
    expert: int | None = None  # the global expert number of an expert's weight; None elsewhere

    @property
    def hf_names(self) -> tuple:
        return tuple(self.hf)


def check_layout(spec: ModelSpec, tp: int, pp: int, ep: int = 1) -> None:
    """Raise one error listing every way TP/PP/EP does not fit the model's shapes (Megatron's own
    rules)."""
    what = f"layout TP={tp} PP={pp}" + (f" EP={ep}" if ep != 1 else "")
    if tp < 1 or pp < 1 or ep < 1:
        raise ValueError(f"{what}: tensor, pipeline and expert parallel sizes must be at least 1")
    errors = []
    if spec.num_attention_heads % tp:
        errors.append(f"num_attention_heads={spec.num_attention_heads} is not divisible by TP={tp}")
    if spec.num_query_groups % tp and tp % spec.num_query_groups:
        errors.append(
            f"num_key_value_heads={spec.num_query_groups} must be a multiple or a divisor of TP={tp}"
        )
    if spec.is_moe:
        if spec.moe_ffn_hidden_size % tp:
            errors.append(
                f"the experts' intermediate size {spec.moe_ffn_hidden_size} is not divisible by TP={tp}"
            )
        if spec.num_experts % ep:
            errors.append(
                f"expert_model_parallel_size={ep} must divide the {spec.num_experts} experts"
            )
    else:
        if spec.ffn_hidden_size % tp:
            errors.append(f"intermediate_size={spec.ffn_hidden_size} is not divisible by TP={tp}")
        if ep != 1:
            errors.append(f"expert_model_parallel_size={ep}: a model without experts needs 1")
    if spec.num_layers % pp:
        errors.append(f"pipeline_model_parallel_size={pp} must divide num_layers={spec.num_layers}")
    if errors:
        raise ValueError(f"{what} does not fit this {spec.family} model: " + "; ".join(errors))


def stage_layers(spec: ModelSpec, pp: int, pp_rank: int) -> range:
    if spec.num_layers % pp:
        raise ValueError(
            f"pipeline_model_parallel_size={pp} must divide num_layers={spec.num_layers}"
        )
    n = spec.num_layers // pp
    return range(pp_rank * n, (pp_rank + 1) * n)


def stage_params(
    spec: ModelSpec, pp: int, pp_rank: int, ep: int = 1, ep_rank: int = 0
) -> list[StageParam]:
    """The parameters stage `pp_rank` (and expert-parallel rank `ep_rank` of EP) holds, in HF
    checkpoint order; with EP = 1 every expert, under its global number."""
    model, layer = family(spec).param_mappings(spec)
    by_name = {m.megatron: m for m in model}
    first, last = pp_rank == 0, pp_rank == pp - 1
    local_experts = spec.num_experts // ep
    out = []

    def add(
        m: ParamMapping,
        local: int | None = None,
        layer_id: int | None = None,
        duplicate=False,
        expert: int | None = None,
    ):
        local_expert = None if expert is None else expert - ep_rank * local_experts
        out.append(
            StageParam(
                m.megatron.format(i=local, e=local_expert),
                {h.format(i=layer_id, e=expert): tuple(shape) for h, shape in m.hf.items()},
                m.kind,
                duplicate,
                expert,
            )
        )

    if first:
        add(by_name["embedding.word_embeddings.weight"])
    for local, layer_id in enumerate(stage_layers(spec, pp, pp_rank)):
        for m in layer:
            if not m.expert:
                add(m, local, layer_id)
                continue
            for expert in range(ep_rank * local_experts, (ep_rank + 1) * local_experts):
                add(m, local, layer_id, expert=expert)
    if last:
        add(by_name["decoder.final_layernorm.weight"])
        if "output_layer.weight" in by_name:
            add(by_name["output_layer.weight"])
        elif not first:  # tied embeddings, PP > 1: the last stage's copy of the embedding
            add(
                ParamMapping(
                    "output_layer.weight", by_name["embedding.word_embeddings.weight"].hf, "vocab"
                ),
                duplicate=True,
            )
    return out


def hf_to_megatron(hf_state: dict, spec: ModelSpec, tp: int, pp: int, padded_vocab: int) -> dict:
    """HF state dict -> {(pp_rank, tp_rank): Megatron state dict of that rank} (tensors may be
    views)."""
    check_layout(spec, tp, pp)
    out = {}
    for p in range(pp):
        for sp in stage_params(spec, pp, p):
            missing = [n for n in sp.hf_names if n not in hf_state]
            if missing:
                raise KeyError(
                    f"HF checkpoint lacks {missing} (needed for Megatron {sp.local_name}, stage {p})"
                )
            shards = to_megatron_shards(
                sp.kind,
                [hf_state[n] for n in sp.hf_names],
                spec,
                tp,
                padded_vocab,
                what=f"{sp.hf_names[0]}",
            )
            for t, shard in enumerate(shards):
                out.setdefault((p, t), {})[sp.local_name] = shard
    return out


def megatron_to_hf(shards: dict, spec: ModelSpec, tp: int, pp: int) -> dict:
    """{(pp_rank, tp_rank): Megatron state dict} -> HF state dict (inverse of hf_to_megatron)."""
    hf = {}
    for p in range(pp):
        for sp in stage_params(spec, pp, p):
            if sp.duplicate:
                continue
            try:
                tensors = to_hf(sp.kind, [shards[(p, t)][sp.local_name] for t in range(tp)], spec)
            except KeyError as e:
                raise KeyError(
                    f"Megatron checkpoint stage {p} lacks {sp.local_name} ({e})"
                ) from None
            hf.update(zip(sp.hf_names, tensors))
    return hf


def hf_param_shapes(spec: ModelSpec) -> dict[str, tuple]:
    """Every HF tensor name -> shape, in checkpoint order (embedding, layers, final norm, head)."""
    return {name: shape for sp in stage_params(spec, 1, 0) for name, shape in sp.hf.items()}
