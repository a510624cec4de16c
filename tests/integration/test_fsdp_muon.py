"""`optimizer: muon` on the fsdp trainer: torch.optim.Muon on the hidden matrices (FSDP2's sharded
DTensors), AdamW on the embedding, head and norms (chatgen.training.muon).

    python -m pytest tests/integration/test_fsdp_muon.py

It trains (the loss falls, differently from AdamW) and a checkpoint resumes bit for bit (both
optimizers' state). One data-parallel rank (two: docs/algorithms.md, Muon, measured once).
"""

import pytest
from helpers import masked_batch, masked_nll
import torch

pytestmark = pytest.mark.integration


MUON = dict(lr=1e-3, micro_batch_size=2, optimizer="muon")


def _train(model_dir, steps: int, config=MUON):
    from chatgen.training.fsdp_module import FSDPModule

    trainer = FSDPModule(dict(load=str(model_dir), **config)).start()
    losses = [trainer.train_step(masked_batch(), masked_nll)["loss"] for _ in range(steps)]
    trainer.shutdown()
    return losses


def test_muon_trains_other_steps_than_adamw(tiny_llama_dir):
    muon = _train(tiny_llama_dir, 3)
    adam = _train(tiny_llama_dir, 3, {**MUON, "optimizer": "adam"})
    assert muon[0] == adam[0]  # the same model and batch before the first step
    assert muon[2] < muon[0] and muon[2] != pytest.approx(adam[2], rel=1e-4)


def test_muon_checkpoint_resumes_bit_for_bit(tiny_llama_dir, tmp_path):
    from chatgen.training.fsdp_module import FSDPModule

    batch = masked_batch()
    trainer = FSDPModule(dict(load=str(tiny_llama_dir), **MUON)).start()
    for _ in range(2):
        trainer.train_step(batch, masked_nll)
    trainer.save_checkpoint(tmp_path / "ckpt")
    straight = trainer.train_step(batch, masked_nll)
    weights = trainer.hf_state_dict()
    trainer.shutdown()
    resumed = FSDPModule(dict(load=str(tmp_path / "ckpt"), **MUON)).start()
    again = resumed.train_step(batch, masked_nll)
    other = resumed.hf_state_dict()
    resumed.shutdown()
    assert again == straight
    assert all(torch.equal(weights[k], other[k]) for k in weights)
