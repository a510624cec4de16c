"""The adapter-only transport's own logic (chatgen/param_sync/adapter_sync.py) against a stand-in engine: what it
checks before the engine is touched (manifest, rank, finiteness, the engine's support), what it hands over, and
that a refused adapter leaves the engine untouched. The real vLLM and hf engines: tests/integration/test_lora.py.

    python -m pytest tests/unit/test_adapter_sync.py
"""

import pytest
import torch

from chatgen.models.lora_format import peft_config, peft_name, split_name
from chatgen.param_sync import AdapterSender, GroupSender, SyncError, sync_adapter

Q, UP = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.up_proj.weight"
MANIFEST = {Q: (8, 8), UP: (16, 8), "model.embed_tokens.weight": (32, 8)}


class Engine:
    """A generation module of this process that takes adapters: records what it was given."""

    class config:
        enable_lora = True

    def __init__(self):
        self.loaded = []

    def weight_manifest(self):
        return MANIFEST

    def load_lora_tensors(self, config, tensors):
        self.loaded.append((config, tensors))
        return len(self.loaded)


def adapter(rank=2, **changes):
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for hf, (out, n_in) in ((Q, (8, 8)), (UP, (16, 8))):
        tensors[peft_name(hf, "lora_A")] = torch.randn(rank, n_in, generator=g)
        tensors[peft_name(hf, "lora_B")] = torch.randn(out, rank, generator=g)
    tensors.update(changes)
    return peft_config(rank, 2.0 * rank, 0.0, ["q_proj", "up_proj"], "base"), tensors


def test_an_adapter_reaches_the_engine_checked_and_whole():
    engine = Engine()
    config, tensors = adapter()
    report = sync_adapter((config, tensors), engine, validate=True)
    assert report.validated and report.tensors == 4 and report.buckets == 1
    assert report.bytes == sum(t.numel() * 4 for t in tensors.values())
    ((got_config, got),) = engine.loaded
    assert got_config == config and got.keys() == tensors.keys()
    assert all(torch.equal(got[k], tensors[k]) for k in tensors)
    assert split_name(peft_name(Q, "lora_B")) == (Q, "lora_B")


@pytest.mark.parametrize(
    "changes, message",
    [
        (
            {peft_name(UP, "lora_B"): torch.zeros(15, 2)},
            r"up_proj.weight: the adapter is for shape \(15, 8\)",
        ),
        ({peft_name(Q, "lora_A"): torch.zeros(3, 8)}, r"q_proj.weight: rank 3 / 2 .* r=2"),
        (
            {peft_name("model.layers.0.mlp.gate_proj.weight", "lora_A"): torch.zeros(2, 8)},
            r"gate_proj.weight: the adapter sends \['lora_A'\] only",
        ),
        (
            {peft_name(Q, "lora_B"): torch.full((8, 2), float("nan"))},
            r"NaN or inf: base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight",
        ),
        (
            {"model.layers.0.self_attn.q_proj.weight": torch.zeros(8, 8)},
            "not a PEFT LoRA tensor name",
        ),
    ],
)
def test_a_bad_adapter_is_refused_before_the_engine_is_touched(changes, message):
    engine = Engine()
    with pytest.raises(SyncError, match="the engine keeps its") as e:
        sync_adapter(adapter(**changes), engine)
    assert e.match(message) and engine.loaded == []


def test_an_engine_without_adapters_or_a_sender_as_target_is_refused_naming_the_fix():
    class Plain(Engine):
        class config:
            enable_lora = False

    with pytest.raises(SyncError, match="set enable_lora: true"):
        AdapterSender(Plain())
    # a transport's sender carries the adapter itself (sender.send(adapter)), it is no engine
    with pytest.raises(SyncError, match=r"GroupSender is a sender; send the adapter through it"):
        sync_adapter(adapter(), GroupSender.__new__(GroupSender))
    with pytest.raises(SyncError, match="set lora.rank > 0"):
        sync_adapter(torch.nn.Linear(2, 2), Engine())


def test_an_engine_that_refuses_the_adapter_keeps_its_own():
    class Refusing(Engine):
        def load_lora_tensors(self, config, tensors):
            raise ValueError("LoRA rank 2 is greater than max_lora_rank 1")

    with pytest.raises(SyncError, match="engine refused it: ValueError: LoRA rank 2 is greater"):
        sync_adapter(adapter(), Refusing())
