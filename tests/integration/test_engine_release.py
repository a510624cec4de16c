"""release_during_training's engine side (chatgen.generation.vllm.adapter.cpu_release) on CPU with
real vLLM and megatron-core: a colocated engine put to sleep at level 2 frees its weights and its KV
cache (a fresh process's RSS drops by most of their bytes; the cache comes back zeroed) and refuses to
generate; after the full sync that follows a train step its greedy log-probs equal the trainer's as
before; a sync that misses a weight fails, and the engine refuses to generate until a full one.

    python -m pytest tests/integration/test_engine_release.py
"""

import json
import os
from pathlib import Path

import pytest
import torch
from helpers import SYNC_PROMPTS, engine, fresh_interpreters, generate, worst_abs_diff
from timeouts import scaled

pytestmark = pytest.mark.integration

from chatgen.param_sync import sync_weights

TOL = 1e-4
KV_BYTES = 32 << 20  # helpers.engine's kv_cache_memory_bytes


# Run in a fresh interpreter after `model_dir = ...`: an engine is built, generates (its KV cache
# written), and sleeps at level 2; it prints how many bytes the process's RSS dropped by (as JSON,
# its last line).
RELEASE_SCRIPT = """
import ctypes, json
from helpers import engine, generate
from chatgen.core.process_tuning import resident_bytes
llm = engine(model_dir)
generate(llm)
ctypes.CDLL(None).malloc_trim(0)  # only what the release frees counts
before = resident_bytes()
llm.sleep(2)
print(json.dumps(dict(dropped=before - resident_bytes())))
llm.shutdown()
"""


@pytest.fixture(scope="module")
def model_dir(make_tiny):
    """A tiny Llama wide enough that its linear layers get oneDNN handlers (> 1 MiB each) and its
    weights (47 MiB) stand out of the RSS."""
    return make_tiny("tiny_llama", hidden_size=512, intermediate_size=1408, num_hidden_layers=4)


@pytest.fixture(scope="module")
def release_process(request, model_dir):
    """RELEASE_SCRIPT in a process of its own, started when the module begins (beside this
    process's engine start): in this process glibc's heap history from earlier tests keeps part of
    what a release frees (0.79 of it once in the whole suite, 0.90 after two files)."""
    tests = Path(__file__).resolve().parents[1]  # helpers.py
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tests), os.environ.get("PYTHONPATH", "")]),
    }
    code = f"model_dir = {str(model_dir)!r}\n{RELEASE_SCRIPT}"
    codes = {"test_released_engine_frees_memory_and_a_full_sync_brings_it_back": code}
    yield from fresh_interpreters(request, __file__, codes, env=env)


@pytest.fixture(scope="module")
def pair(model_dir, release_process):
    """An engine on random weights and its trainer."""
    from chatgen.training.megatron_module import MegatronModule

    llm = engine(model_dir)
    yield llm, MegatronModule({"load": str(model_dir), "lr": 1e-2}).start()
    llm.shutdown()


def diff_vs_trainer(trainer, llm) -> float:
    return worst_abs_diff(
        trainer.forward_tokens({"input_ids": torch.tensor([prompt + ids])})[0, len(prompt) - 1 :]
        - torch.tensor(lp)
        for prompt, (ids, lp) in zip(SYNC_PROMPTS, generate(llm))
    )


def kv_cache_written(llm) -> bool:
    """Whether any byte of the engine's KV cache is nonzero."""

    def written(worker) -> bool:
        return any(bool(t.any()) for t in worker.model_runner.kv_caches)

    return any(llm.engine_loop.call(lambda: llm.engine.collective_rpc(written)))


def train_step(trainer) -> None:
    trainer.train_step(
        {"input_ids": torch.tensor([SYNC_PROMPTS[1] * 2])}, lambda lp, mb: (-lp.mean(), {})
    )


def test_released_engine_frees_memory_and_a_full_sync_brings_it_back(pair, release_process):
    llm, trainer = pair
    sync_weights(trainer, llm, validate=True)
    assert diff_vs_trainer(trainer, llm) < TOL
    assert kv_cache_written(llm)
    weight_bytes = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    proc = release_process["test_released_engine_frees_memory_and_a_full_sync_brings_it_back"]
    out, err = proc.communicate(timeout=scaled(120))
    assert proc.returncode == 0, err[-3000:]
    dropped = json.loads(out.strip().splitlines()[-1])["dropped"]
    # the packed weights, the embeddings and norms, and the KV cache: all of them (99.96%) in a
    # process of its own; 0.8 fails when either part stays (the weights are 0.595 of the sum)
    assert dropped > 0.8 * (weight_bytes + KV_BYTES), (dropped, weight_bytes)
    llm.sleep(2)
    llm.wake_up(["weights"])  # as chatgen.rlhf.weight_links does: weights, sync, then the cache
    train_step(trainer)  # the engine must follow the new weights, not the ones it let go of
    sync_weights(trainer, llm)
    llm.wake_up(["kv_cache"])
    assert not kv_cache_written(llm)  # what the release let go of comes back zeroed
    assert diff_vs_trainer(trainer, llm) < TOL
    # a second round: what the reload built is released again
    llm.sleep(2)
    llm.wake_up()
    with pytest.raises(RuntimeError, match="weights were released"):  # awake, but nothing synced
        generate(llm)
    train_step(trainer)
    sync_weights(trainer, llm, bucket_bytes=300_000)  # several buckets
    assert diff_vs_trainer(trainer, llm) < TOL


@pytest.mark.parametrize(
    "left_out, named",
    [
        ("model.layers.1.mlp.down_proj.weight", "model.layers.1.mlp.down_proj"),  # oneDNN handler
        ("model.norm.weight", "model.norm.weight"),  # a tensor of its own
    ],
)
def test_a_sync_that_misses_a_weight_fails_and_the_engine_refuses(pair, left_out, named):
    from chatgen.training.hf_export import HFWeights

    llm, trainer = pair
    weights = [(name, t.clone()) for bucket in HFWeights(trainer).buckets() for name, t in bucket]
    llm.sleep(2)
    llm.wake_up()
    with pytest.raises(RuntimeError, match=f"not all written again: {named}"):
        llm.load_weights([[(n, t) for n, t in weights if n != left_out]])
    with pytest.raises(RuntimeError, match="not all written again"):
        generate(llm)
    llm.load_weights([weights])  # the full set repairs it
    assert diff_vs_trainer(trainer, llm) < TOL
