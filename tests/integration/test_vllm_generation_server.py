"""`chatgen.VLLMGeneration` in server mode against a live `chatgen serve --control --api-key` (its own process):
the control endpoints need the key, colocate and server give the same greedy outputs, log-probs equal a
transformers forward pass after a sync over the network, a refused sync keeps the server's weights,
pause / resume, and examples/grpo_with_hf_trainer.py --mode server.

    python -m pytest tests/integration/test_vllm_generation_server.py
"""
import os
import subprocess
import sys
import threading
import time

import pytest
import requests
import torch

pytestmark = pytest.mark.integration

from test_vllm_generation import TOL, max_diff_vs_hf, perturbed, quick_warm_start  # noqa: E402

KEY = "test-key"
CONTROL = ["/control/pause", "/control/resume", "/control/weights/begin", "/control/weights/finish",
           "/control/reset_prefix_cache"]
ENGINE = dict(seq_length=128, logprobs_mode="raw", enforce_eager=True, block_size=32, kv_cache_memory_bytes=16 << 20)
PROMPTS = [list(range(10, 80)), [5, 17, 99, 200, 301, 7]]


@pytest.fixture(scope="module")
def data_and_model(tiny_llama_dir, tmp_path_factory):
    from chatgen.rlhf import tasks

    tmp = tmp_path_factory.mktemp("vgen-server")
    tasks.main(["--output", str(tmp / "data"), "--n-train", "64", "--n-eval", "8"])
    return tmp / "data", quick_warm_start(tiny_llama_dir, tasks.read_jsonl(tmp / "data" / "sft.jsonl"), tmp / "model")


@pytest.fixture(scope="module")
def server(data_and_model):
    from chatgen.distributed import free_port

    url = f"http://127.0.0.1:{free_port()}"
    proc = subprocess.Popen([sys.executable, "-m", "chatgen.cli", "serve", "--model", str(data_and_model[1]),
                             "--port", url.rsplit(":", 1)[1], "--api-key", KEY, "--control", "max_new_tokens=16",
                             *(f"{k}={v}" for k, v in ENGINE.items())],
                            env=dict(os.environ, VLLM_LOGGING_LEVEL="ERROR"), stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while True:
        assert proc.poll() is None and time.time() < deadline, "chatgen serve did not start"
        try:
            if requests.get(f"{url}/health", headers={"Authorization": f"Bearer {KEY}"}).ok:
                break
        except requests.ConnectionError:
            time.sleep(0.3)
    yield url
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def remote(server, data_and_model):
    from chatgen import VLLMGeneration

    return VLLMGeneration(data_and_model[1], "server", server_base_url=server, api_key=KEY, max_completion_length=8)


@pytest.fixture(scope="module")
def local(data_and_model):
    from chatgen import VLLMGeneration

    g = VLLMGeneration(data_and_model[1], max_completion_length=8, max_model_length=ENGINE["seq_length"],
                       **{k: v for k, v in ENGINE.items() if k != "seq_length"})
    yield g
    g.shutdown()


@pytest.mark.parametrize("path", CONTROL)
def test_control_endpoints_need_the_api_key(server, path):
    assert requests.post(server + path).status_code == 401
    assert requests.post(server + path, headers={"Authorization": "Bearer wrong"}).status_code == 401


def test_control_endpoints_refuse_a_public_bind_without_a_key():
    from chatgen.serving.control import control_router

    with pytest.raises(ValueError, match="--control on --host 0.0.0.0 without --api-key"):
        control_router(None, api_key=None, host="0.0.0.0")


def test_colocate_and_server_agree_and_match_transformers_after_a_sync(remote, local, data_and_model):
    from transformers import AutoModelForCausalLM

    model = perturbed(AutoModelForCausalLM.from_pretrained(data_and_model[1], dtype=torch.float32).eval(), seed=4)
    before = remote.generate(PROMPTS, greedy=True)
    remote.sync_weights(model)
    local.sync_weights(model)
    after = remote.generate(PROMPTS, greedy=True)
    assert after[2] != before[2]  # the server's weights changed
    assert after[:2] == local.generate(PROMPTS, greedy=True)[:2]  # same greedy tokens
    assert max_diff_vs_hf(model, *after) < TOL
    assert max_diff_vs_hf(model, *remote.generate(PROMPTS, num_generations=2)) < TOL  # sampled


def test_refused_sync_keeps_the_server_weights(remote, data_and_model):
    from transformers import AutoModelForCausalLM

    from chatgen.param_sync import SyncError

    before = remote.generate(PROMPTS, greedy=True)
    model = AutoModelForCausalLM.from_pretrained(data_and_model[1], dtype=torch.float32).eval()
    state = dict(perturbed(model, seed=5).named_parameters())
    state["model.norm.weight"] = torch.ones(7)
    with pytest.raises(SyncError, match=r"model.norm.weight: trainer sends shape \(7,\), the engine expects"):
        remote.sync_weights(list(state.items()))
    assert remote.generate(PROMPTS, greedy=True) == before
    model = perturbed(model, seed=6)
    remote.sync_weights(model)  # the channel is still usable
    assert max_diff_vs_hf(model, *remote.generate(PROMPTS, greedy=True)) < TOL


def test_pause_holds_requests_until_resume(remote, server, data_and_model):
    from transformers import AutoModelForCausalLM

    auth = {"Authorization": f"Bearer {KEY}"}
    assert requests.post(server + "/control/pause", headers=auth).json() == {"paused": True}
    done = []
    worker = threading.Thread(target=lambda: done.append(remote.generate(PROMPTS, greedy=True)))
    worker.start()
    worker.join(timeout=2)
    assert not done  # waiting while paused
    model = perturbed(AutoModelForCausalLM.from_pretrained(data_and_model[1], dtype=torch.float32).eval(), seed=7)
    with pytest.raises(RuntimeError, match='the engine is paused, and mode "wait"'):
        remote.sync_weights(model)
    remote.sync_weights(model, mode="keep")  # weights can change while paused
    assert requests.post(server + "/control/resume", headers=auth).json() == {"paused": False}
    worker.join(timeout=60)
    assert max_diff_vs_hf(model, *done[0]) < TOL  # the held request ran under the new weights
    assert requests.post(server + "/control/reset_prefix_cache", headers=auth).json() == {"reset": True}


def _trainer_rank(rank, url, model_dir, port, seed, results):
    """One rank of a 2-process torch.distributed trainer that syncs the same model through server mode."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from chatgen import VLLMGeneration
    from chatgen.distributed import init_process_group

    init_process_group("gloo", rank, 2, "127.0.0.1", port)
    model = perturbed(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), seed)
    gen = VLLMGeneration(model_dir, "server", server_base_url=url, api_key=KEY)
    results.put((rank, gen.sync_weights(model).tensors))
    dist.destroy_process_group()


def test_a_two_rank_trainer_syncs_through_rank_0(remote, server, data_and_model):
    import torch.multiprocessing as mp
    from transformers import AutoModelForCausalLM

    from chatgen.distributed import free_port

    ctx, port = mp.get_context("spawn"), free_port()
    results = ctx.Queue()
    ranks = [ctx.Process(target=_trainer_rank, args=(r, server, str(data_and_model[1]), port, 8, results))
             for r in range(2)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(timeout=120)
    assert [p.exitcode for p in ranks] == [0, 0]
    assert sorted(results.get(timeout=5) for _ in ranks) == [(0, 21), (1, 21)]
    model = perturbed(AutoModelForCausalLM.from_pretrained(data_and_model[1], dtype=torch.float32).eval(), seed=8)
    assert max_diff_vs_hf(model, *remote.generate(PROMPTS, greedy=True)) < TOL


def test_grpo_with_hf_trainer_example_in_server_mode(server, data_and_model):
    from examples.grpo_with_hf_trainer import main

    data, model = data_and_model
    history = main(["--mode", "server", "--server-url", server, "--api-key", KEY, "--model", str(model),
                    "--data", str(data), "--steps", "2", "--prompts", "4", "--group", "4", "--eval-every", "1",
                    "--eval-prompts", "8"])
    assert [r["step"] for r in history] == [0, 1, 2]
    assert history[0]["loss"] != 0 and all(r["synced_tensors"] == 21 for r in history[:2])
    assert history[1]["logprob_mismatch"] < TOL  # the server generated with the weights trained at step 0
