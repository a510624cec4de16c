"""chatgen/core/dcp.py reads a distributed checkpoint without running code it carries: its pickled
index (`.metadata`) builds checkpoint-metadata classes only, whatever a tampered file asks for.

    python -m pytest tests/unit/test_dist_checkpoint.py
"""

import pickle

import pytest
import torch

from chatgen.core.dcp import read_full_tensors


@pytest.fixture
def checkpoint(tmp_path):
    from torch.distributed import checkpoint as dcp

    state = {
        "embedding.word_embeddings.weight": torch.arange(12.0).view(3, 4),
        "decoder.layers.mlp.linear_fc1.weight": torch.ones(2, 3, 4, dtype=torch.bfloat16),
        "optimizer.state.exp_avg.embedding.word_embeddings.weight": torch.zeros(3, 4),
    }
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "ckpt")), no_dist=True)
    return tmp_path / "ckpt", state


class _Calls:
    """A pickle that calls `fn(*args)` when it is loaded."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def test_tensors_come_back_whole_and_the_skipped_prefix_stays_out(checkpoint):
    path, state = checkpoint
    got = read_full_tensors(path, skip=("optimizer.",))
    assert sorted(got) == [
        "decoder.layers.mlp.linear_fc1.weight",
        "embedding.word_embeddings.weight",
    ]
    assert all(torch.equal(got[k], state[k]) and got[k].dtype == state[k].dtype for k in got)


@pytest.mark.faults
@pytest.mark.parametrize(
    "gadget", ["os.system", "torch.distributed.checkpoint.format_utils.torch_save_to_dcp"]
)
def test_a_tampered_index_is_refused_without_running_anything(checkpoint, tmp_path, gadget):
    import importlib

    path, _ = checkpoint
    module, name = gadget.rsplit(".", 1)
    marker = tmp_path / "ran"
    # os.system writes the marker; torch_save_to_dcp would torch.load(weights_only=False) a file of the attacker's
    payload = _Calls(
        getattr(importlib.import_module(module), name),
        *((f"touch {marker}",) if name == "system" else (str(path / "evil.pt"), str(marker))),
    )
    (path / ".metadata").write_bytes(pickle.dumps(payload))
    with pytest.raises(
        pickle.UnpicklingError, match=rf"names [\w.]+\.{name}, which is not checkpoint metadata"
    ):
        read_full_tensors(path)
    assert not marker.exists()
