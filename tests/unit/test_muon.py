"""Muon as an optimizer choice (chatgen.training.muon): torch.optim.Muon on the hidden matrices, AdamW
on embeddings, head, norms and biases; an update of a matrix is orthogonalised; megatron refuses
`optimizer: muon` naming the key, and a torch without Muon is refused with the fix.

    pytest tests/unit/test_muon.py
"""

import pytest
import torch

from chatgen.training import muon
from chatgen.training.config import MegatronConfig


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(11, 8)
        self.up = torch.nn.Linear(8, 16)
        self.down = torch.nn.Linear(16, 8, bias=False)
        self.norm = torch.nn.LayerNorm(8)
        self.lm_head = torch.nn.Linear(8, 11, bias=False)

    def forward(self, ids):
        h = self.embed_tokens(ids)
        return self.lm_head(self.norm(h + self.down(torch.relu(self.up(h)))))


def test_split_matrices_from_the_rest():
    model = Tiny()
    model.norm.weight.requires_grad_(False)  # a frozen parameter is in neither
    matrices, others = muon.split(model.named_parameters())
    assert [n for n, _ in matrices] == ["up.weight", "down.weight"]
    assert [n for n, _ in others] == [
        "embed_tokens.weight",
        "up.bias",
        "norm.bias",
        "lm_head.weight",
    ]


@pytest.mark.skipif(not muon.available(), reason="this torch has no torch.optim.Muon")
def test_one_step_moves_every_parameter_and_orthogonalises_a_matrix_update():
    torch.manual_seed(0)
    model = Tiny()
    optimizer = muon.build(model.named_parameters(), lr=0.01)
    assert isinstance(optimizer.optimizers[0], torch.optim.Muon)
    assert isinstance(optimizer.optimizers[1], torch.optim.AdamW)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = torch.randint(0, 11, (4, 5))
    loss = torch.nn.functional.cross_entropy(model(ids).reshape(-1, 11), ids.reshape(-1))
    loss.backward()
    grad = model.up.weight.grad.clone()
    optimizer.step()
    for name, p in model.named_parameters():
        assert not torch.equal(p, before[name]), name
    # Muon: the update's singular values are close to one another (Newton-Schulz), the gradient's
    # are not; AdamW's first step is lr * sign(grad) per entry instead
    update = (before["up.weight"] - model.up.weight.detach()).double()
    s_update, s_grad = torch.linalg.svdvals(update), torch.linalg.svdvals(grad.double())
    assert s_update.min() / s_update.max() > 0.5 > s_grad.min() / s_grad.max()
    optimizer.zero_grad()
    assert model.up.weight.grad is None
    state = optimizer.state_dict()
    again = muon.build(model.named_parameters(), lr=0.01)
    again.load_state_dict(state)
    assert len(again.param_groups) == 2


def test_a_torch_without_muon_is_refused_with_the_fix(monkeypatch):
    monkeypatch.delattr(torch.optim, "Muon", raising=False)
    with pytest.raises(ValueError, match="optimizer: muon needs torch.optim.Muon.*optimizer: adam"):
        muon.build(Tiny().named_parameters(), lr=0.01)


def test_megatron_refuses_muon_naming_the_key():
    assert not list(MegatronConfig().check())
    problems = dict(MegatronConfig(optimizer="muon").check())
    assert "distributed optimizer" in problems["optimizer"]
    assert "optimizer: adam" in problems["optimizer"] and "backend: fsdp" in problems["optimizer"]
    from chatgen.training.config import FSDPConfig

    assert "optimizer" not in dict(FSDPConfig(optimizer="muon").check())  # its trainer takes it
