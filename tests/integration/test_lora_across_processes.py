"""Adapter-only LoRA sync across processes: a LoRA trainer sends its adapter alone into a `chatgen serve
--control` process (enable_lora) through the group and the shared-memory transports, with the full sync's
checks; the server's log-probs then equal the trainer's within 1e-4 (fp32, real megatron-core and vLLM).

    python -m pytest tests/integration/test_lora_across_processes.py   # ~1 min on 2 idle CPU cores
"""

import pytest
import torch
from helpers import SYNC_PROMPTS, batch, build, chatgen_serve, nll_loss, wait_until_serving
from timeouts import scaled

pytestmark = pytest.mark.integration

KEY = "test-key"
TOL = 1e-4
SOME = dict(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"])


@pytest.fixture(scope="module")
def llama(make_tiny):
    return make_tiny("tiny_llama")


@pytest.fixture(scope="module")
def lora_server(llama):
    """`chatgen serve --control` on the base weights, taking adapters of rank <= 8."""
    from chatgen.core.distributed import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = chatgen_serve(
        llama,
        port,
        "--api-key",
        KEY,
        "--control",
        "dtype=float32",
        "enable_lora=true",
        "max_lora_rank=8",
        "logprobs_mode=raw",
        "seq_length=64",
        "max_new_tokens=16",
        "enforce_eager=true",
        "kv_cache_memory_bytes=33554432",
    )
    wait_until_serving(proc, url, scaled(240), KEY)
    yield url
    proc.terminate()
    proc.wait(timeout=30)


def server_vs_trainer(client, trainer) -> float:
    """Largest |server log-prob - trainer log-prob| over the greedy completions of SYNC_PROMPTS."""
    prompts, completions, logprobs = client.generate(SYNC_PROMPTS, greedy=True)
    worst = 0.0
    for prompt, ids, lp in zip(prompts, completions, logprobs):
        mine = trainer.forward_tokens({"input_ids": torch.tensor([prompt + ids])})[
            0, len(prompt) - 1 :
        ]
        worst = max(worst, (mine - torch.tensor(lp)).abs().max().item())
    return worst


@pytest.mark.parametrize("transport", ["group", "shm"])
def test_adapter_only_sync_into_a_served_engine(llama, lora_server, transport):
    from chatgen import VLLMGeneration
    from chatgen.param_sync import SyncError
    from chatgen.training import lora

    ids = batch()
    trainer = build(llama, lr=1e-2, lora=SOME)
    for _ in range(2):
        trainer.train_step({"input_ids": ids}, nll_loss)
    client = VLLMGeneration(
        llama,
        "server",
        server_base_url=lora_server,
        api_key=KEY,
        max_completion_length=6,
        weight_transport=transport,
    )
    report = client.sync_weights(trainer.adapter_weights())
    assert report.tensors == 2 * 4 * 2  # A, B x 4 targets x 2 layers: the adapter only
    full = sum(t.numel() * t.element_size() for t in trainer.hf_state_dict().values())
    assert report.bytes < 0.05 * full
    assert server_vs_trainer(client, trainer) < TOL
    trainer.train_step({"input_ids": ids}, nll_loss)
    assert server_vs_trainer(client, trainer) > TOL  # stale until the next sync
    client.sync_weights(trainer.adapter_weights())  # swapped in place
    assert server_vs_trainer(client, trainer) < TOL

    # a NaN adapter is refused before anything changes: the server keeps serving the last one
    before = client.generate(SYNC_PROMPTS, greedy=True)
    pair = lora.adapters(trainer.model)[0].pairs["q_proj"]
    kept = pair.lora_B.detach().clone()
    with torch.no_grad():
        pair.lora_B[0, 0] = float("nan")
    with pytest.raises(SyncError, match=r"NaN or inf"):
        client.sync_weights(trainer.adapter_weights())
    with torch.no_grad():
        pair.lora_B.copy_(kept)
    assert client.generate(SYNC_PROMPTS, greedy=True) == before
    client.sync_weights(trainer.adapter_weights())  # the channel still works
    assert server_vs_trainer(client, trainer) < TOL
