"""Muon as an optimizer choice: torch's own `torch.optim.Muon` (torch >= 2.9) on the hidden layers'
weight matrices, AdamW on every other parameter, in one optimizer object.

    from chatgen.training import muon
    optimizer = muon.build(model.named_parameters(), lr=5e-4)     # .step(), .zero_grad() as usual

Muon (Jordan et al. 2024; Liu et al. 2025, "Muon is Scalable for LLM Training") replaces each update
of a 2-D weight by the orthogonalised momentum (Newton-Schulz iterations: every singular value
pushed towards 1), which is defined for matrices only. The split (`split`):

    Muon:   every trainable 2-D weight of a hidden layer (attention q/k/v/o, MLP up/gate/down, router)
    AdamW:  the token embedding and the output head (a lookup table and a classifier, not linear maps
            between hidden states: Moonlight and the reference implementation keep them on AdamW, and a
            tied head is the embedding), norms' gains and biases (1-D), any other non-2-D tensor

Both share the learning rate: Muon's is scaled per matrix to AdamW's update RMS (adjust_lr_fn
"match_rms_adamw", Moonlight's rule), so an AdamW lr carries over. The fsdp trainer takes it
(`optimizer: muon`: FSDP2's sharded DTensors, whose matrix products see each whole matrix), and so
does a trainer of plain torch parameters (examples/grpo_with_hf_trainer.py --optimizer muon).
megatron's trainer does not (its distributed optimizer keeps each weight as flat slices over the
data-parallel ranks, where no matrix is whole; chatgen.training.config.MegatronConfig refuses
`optimizer: muon` naming the key and the fix).
"""

import torch

# names (substrings) of the 2-D parameters that are not hidden-layer matrices
NOT_HIDDEN = ("embed", "wte", "wpe", "lm_head", "output_layer", "word_embeddings")


def available() -> bool:
    return hasattr(torch.optim, "Muon")


def split(named_parameters) -> tuple:
    """(Muon's parameters, AdamW's parameters), each a list of (name, parameter) that requires
    grad."""
    matrices, others = [], []
    for name, p in named_parameters:
        if not p.requires_grad:
            continue
        hidden = p.ndim == 2 and not any(key in name for key in NOT_HIDDEN)
        (matrices if hidden else others).append((name, p))
    return matrices, others


class MuonAdamW:
    """torch.optim.Muon and torch.optim.AdamW stepping together (param_groups: Muon's, then
    AdamW's)."""

    def __init__(self, muon, adamw):
        self.optimizers = [o for o in (muon, adamw) if o is not None]

    @property
    def param_groups(self) -> list:
        return [g for o in self.optimizers for g in o.param_groups]

    def step(self, closure=None):
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True):
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"optimizers": [o.state_dict() for o in self.optimizers]}

    def load_state_dict(self, state: dict) -> None:
        for o, s in zip(self.optimizers, state["optimizers"], strict=True):
            o.load_state_dict(s)


def build(
    named_parameters,
    lr: float,
    weight_decay: float = 0.0,
    momentum: float = 0.95,
    adam_betas: tuple = (0.9, 0.999),
    adam_eps: float = 1e-8,
) -> MuonAdamW:
    """Muon on the hidden matrices, AdamW on the rest (`split`), one lr (module docstring)."""
    if not available():
        raise ValueError(
            f"optimizer: muon needs torch.optim.Muon, which torch {torch.__version__} lacks "
            "(torch >= 2.9 has it); upgrade torch or use optimizer: adam"
        )
    matrices, others = split(named_parameters)
    muon = (
        torch.optim.Muon(
            [p for _, p in matrices],
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            adjust_lr_fn="match_rms_adamw",
        )
        if matrices
        else None
    )
    adamw = (
        torch.optim.AdamW(
            [p for _, p in others], lr=lr, weight_decay=weight_decay, betas=adam_betas, eps=adam_eps
        )
        if others
        else None
    )
    return MuonAdamW(muon, adamw)
