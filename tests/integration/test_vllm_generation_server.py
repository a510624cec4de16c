"""`chatgen.VLLMGeneration` in server mode against a live `chatgen serve --control --api-key` (its own process):
the control endpoints need the key, colocate and server give the same greedy outputs, log-probs equal a
transformers forward pass after a sync through shared memory and over a torch.distributed group, a refused
sync keeps the server's weights, no file stays in /dev/shm, pause / resume, and examples/grpo_with_hf_trainer.py
--mode server.

    python -m pytest tests/integration/test_vllm_generation_server.py
"""

import glob
import os
import shutil
import subprocess
import sys
import threading

import pytest
import requests
import torch

pytestmark = pytest.mark.integration

from helpers import (  # noqa: E402
    TOL,
    ListedWeights,
    assert_same_generation,
    chatgen_serve,
    max_diff_vs_hf,
    perturbed,
    quick_warm_start,
    wait_until_serving,
)
from timeouts import scaled  # noqa: E402

KEY = "test-key"
CONTROL = [
    "/control/pause",
    "/control/resume",
    "/control/weights/begin",
    "/control/weights/finish",
    "/control/reset_prefix_cache",
]
ENGINE = dict(
    seq_length=128,
    logprobs_mode="raw",
    enforce_eager=True,
    block_size=32,
    kv_cache_memory_bytes=16 << 20,
)
PROMPTS = [list(range(10, 80)), [5, 17, 99, 200, 301, 7]]


@pytest.fixture(scope="module")
def data_and_model(tiny_llama_dir, tmp_path_factory):
    from chatgen import tasks
    from chatgen.core.jsonl import read_prompt_records

    tmp = tmp_path_factory.mktemp("vgen-server")
    tasks.write_task_data(str(tmp / "data"), n_train=64, n_eval=8)
    return tmp / "data", quick_warm_start(
        tiny_llama_dir, read_prompt_records(tmp / "data" / "sft.jsonl"), tmp / "model"
    )


def shm_files(pid):
    """What a server process (pid) has in /dev/shm: its directory, and any file in it."""
    return sorted(
        glob.glob(f"/dev/shm/chatgen-weights-{pid}-*")
        + glob.glob(f"/dev/shm/chatgen-weights-{pid}-*/*")
    )


@pytest.fixture(scope="module")
def server_process(data_and_model):
    from chatgen.core.distributed import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = chatgen_serve(
        data_and_model[1],
        port,
        "--api-key",
        KEY,
        "--control",
        "max_new_tokens=16",
        *(f"{k}={v}" for k, v in ENGINE.items()),
    )
    wait_until_serving(proc, url, scaled(120), KEY)
    yield url, proc
    proc.terminate()
    proc.wait(timeout=30)
    assert shm_files(proc.pid) == []  # the server removed its /dev/shm directory on the way out


@pytest.fixture(scope="module")
def server(server_process):
    return server_process[0]


@pytest.fixture(scope="module")
def remote(server, data_and_model):
    from chatgen import VLLMGeneration

    return VLLMGeneration(
        data_and_model[1], "server", server_base_url=server, api_key=KEY, max_completion_length=8
    )


@pytest.fixture(scope="module")
def remote_group(server, data_and_model):
    from chatgen import VLLMGeneration

    return VLLMGeneration(
        data_and_model[1],
        "server",
        server_base_url=server,
        api_key=KEY,
        max_completion_length=8,
        weight_transport="group",
    )


@pytest.fixture(scope="module")
def local(data_and_model):
    from chatgen import VLLMGeneration

    g = VLLMGeneration(
        data_and_model[1],
        max_completion_length=8,
        max_model_length=ENGINE["seq_length"],
        **{k: v for k, v in ENGINE.items() if k != "seq_length"},
    )
    yield g
    g.shutdown()


@pytest.mark.parametrize("path", CONTROL)
def test_control_endpoints_need_the_api_key(server, path):
    assert requests.post(server + path).status_code == 401
    assert (
        requests.post(server + path, headers={"Authorization": "Bearer wrong"}).status_code == 401
    )


def test_control_endpoints_refuse_a_public_bind_without_a_key():
    from chatgen.serving.control import control_router

    with pytest.raises(ValueError, match="--control on --host 0.0.0.0 without an API key"):
        control_router(None, api_key=None, host="0.0.0.0")


def test_colocate_and_server_agree_and_match_transformers_after_a_sync(
    remote, local, server_process, data_and_model
):
    from transformers import AutoModelForCausalLM

    model = perturbed(
        AutoModelForCausalLM.from_pretrained(data_and_model[1], dtype=torch.float32).eval(), seed=4
    )
    before = remote.generate(PROMPTS, greedy=True)
    report = remote.sync_weights(model)
    assert remote._transport == "shm"  # auto, with a loopback server: shared memory
    assert report.tensors == 21 and report.bytes == sum(p.numel() * 4 for p in model.parameters())
    files = shm_files(server_process[1].pid)
    # the file was unlinked once mapped: only the directory
    assert len(files) == 1 and os.path.isdir(files[0])
    local.sync_weights(model)
    after = remote.generate(PROMPTS, greedy=True)
    assert after[2] != before[2]  # the server's weights changed
    assert after[:2] == local.generate(PROMPTS, greedy=True)[:2]  # same greedy tokens
    assert max_diff_vs_hf(model, *after) < TOL
    assert max_diff_vs_hf(model, *remote.generate(PROMPTS, num_generations=2)) < TOL  # sampled
    model, path = perturbed(model, seed=9), remote._shm.path
    remote.sync_weights(model)
    assert remote._shm.path == path  # the second sync rewrote the file both ends still map
    assert max_diff_vs_hf(model, *remote.generate(PROMPTS, greedy=True)) < TOL


def test_text_prompts_and_per_call_sampling_agree_with_colocate(remote, local):
    """The server tokenizes a string prompt (/tokenize) as colocate does; per-call settings reach the server (the
    two engines may hold different weights here: earlier tests synced the server)."""
    texts = ["Once upon a time", "The cat sat"]
    ids = [local.module.tokenizer.encode(t) for t in texts]
    # the same prompts
    assert remote.generate(texts, greedy=True) == remote.generate(ids, greedy=True)
    assert remote.generate(texts, greedy=True)[0] == ids
    # this call only: greedy, 3 tokens
    short = remote.generate(texts, temperature=0, max_completion_length=3)
    assert [len(c) for c in short[1]] == [3, 3] and short[1] == [
        c[:3] for c in remote.generate(ids, greedy=True)[1]
    ]
    assert [len(c) for c in local.generate(texts, temperature=0, max_completion_length=3)[1]] == [
        3,
        3,
    ]
    with pytest.raises(
        RuntimeError, match="/tokenize: HTTP 400: this model's tokenizer has no chat template"
    ):
        remote.generate([[{"role": "user", "content": "hi"}]])


def test_the_group_transport_matches_transformers_after_a_sync(remote_group, data_and_model):
    from transformers import AutoModelForCausalLM

    model = perturbed(
        AutoModelForCausalLM.from_pretrained(data_and_model[1], dtype=torch.float32).eval(), seed=10
    )
    assert remote_group.sync_weights(model).tensors == 21 and remote_group._transport == "group"
    assert max_diff_vs_hf(model, *remote_group.generate(PROMPTS, greedy=True)) < TOL


@pytest.mark.parametrize("transport", ["shm", "group"])
def test_refused_sync_keeps_the_server_weights(
    transport, remote, remote_group, server_process, data_and_model
):
    from transformers import AutoModelForCausalLM

    from chatgen.param_sync import SyncError

    client = {"shm": remote, "group": remote_group}[transport]
    before = client.generate(PROMPTS, greedy=True)
    model = AutoModelForCausalLM.from_pretrained(data_and_model[1], dtype=torch.float32).eval()
    state = dict(perturbed(model, seed=5).named_parameters())
    state["model.norm.weight"] = torch.ones(7)
    with pytest.raises(
        SyncError, match=r"model.norm.weight: trainer sends shape \(7,\), the engine expects"
    ):
        client.sync_weights(list(state.items()))
    assert_same_generation(client.generate(PROMPTS, greedy=True), before)
    model = perturbed(model, seed=6)
    client.sync_weights(model)  # the channel is still usable
    after = client.generate(PROMPTS, greedy=True)
    assert max_diff_vs_hf(model, *after) < TOL
    # same shapes, one NaN: the trainer writes it all (over the file the engine just loaded from), the server
    # refuses on the header; the engine read nothing in place, so it still generates what it did
    state = {name: p.detach().clone() for name, p in model.named_parameters()}
    state["model.layers.0.mlp.up_proj.weight"][0, 0] = float("nan")
    with pytest.raises(
        SyncError, match=r"1 parameter\(s\) hold NaN or inf: model.layers.0.mlp.up_proj.weight"
    ):
        client.sync_weights(list(state.items()))
    assert_same_generation(client.generate(PROMPTS, greedy=True), after)
    assert shm_files(server_process[1].pid)[1:] == []


class _DiesMidSync(ListedWeights):
    """A weight source whose second bucket never comes: a trainer that fails halfway through copying its weights."""

    def __init__(self, model):
        tensors = [(name, p.detach()) for name, p in model.named_parameters()]
        super().__init__([tensors[:10], tensors[10:]])

    def buckets(self):
        yield self.listed[0]
        raise RuntimeError("the trainer died mid-sync")


def test_a_trainer_dying_mid_copy_leaves_the_server_weights_alone(
    remote, server_process, data_and_model
):
    from transformers import AutoModelForCausalLM

    before = remote.generate(PROMPTS, greedy=True)
    model = perturbed(
        AutoModelForCausalLM.from_pretrained(data_and_model[1], dtype=torch.float32).eval(), seed=12
    )
    with pytest.raises(RuntimeError, match="the trainer died mid-sync"):
        remote.sync_weights(_DiesMidSync(model))
    # the engine read nothing of the half-written file
    assert_same_generation(remote.generate(PROMPTS, greedy=True), before)
    assert shm_files(server_process[1].pid)[1:] == []  # the server removed it
    remote.sync_weights(model)
    assert max_diff_vs_hf(model, *remote.generate(PROMPTS, greedy=True)) < TOL


def test_shm_updates_need_the_key_and_leave_no_file_when_refused(server):
    auth = {"Authorization": f"Bearer {KEY}"}
    assert (
        requests.post(server + "/control/weights/begin", json={"transport": "shm"}).status_code
        == 401
    )
    path = requests.post(
        server + "/control/weights/begin", json={"transport": "shm"}, headers=auth
    ).json()["path"]
    assert os.path.dirname(path).startswith("/dev/shm/chatgen-weights-")
    with open(path, "wb") as f:  # what a trainer writes there
        f.write(bytes(64))
    assert (
        requests.post(server + "/control/weights/finish", json={"header": None}).status_code == 401
    )
    finish = requests.post(server + "/control/weights/finish", json={}, headers=auth)
    # still open
    assert finish.status_code == 400 and '{"header": ...}' in finish.json()["error"]["message"]
    finish = requests.post(
        server + "/control/weights/finish",
        headers=auth,
        json={"header": {"dtype": "torch.float32", "buckets": [], "nonfinite": []}},
    )
    assert (
        finish.status_code == 409
        and "the trainer sends nothing" in finish.json()["error"]["message"]
    )
    assert not os.path.exists(path)  # the server removed the refused file


def test_pause_holds_requests_until_resume(remote, server, data_and_model):
    from transformers import AutoModelForCausalLM

    auth = {"Authorization": f"Bearer {KEY}"}
    control = {"headers": auth, "json": {}}
    assert requests.post(server + "/control/pause", **control).json() == {"paused": True}
    done = []
    worker = threading.Thread(target=lambda: done.append(remote.generate(PROMPTS, greedy=True)))
    worker.start()
    worker.join(timeout=2)
    assert not done  # waiting while paused
    model = perturbed(
        AutoModelForCausalLM.from_pretrained(data_and_model[1], dtype=torch.float32).eval(), seed=7
    )
    with pytest.raises(RuntimeError, match='the engine is paused, and mode "wait"'):
        remote.sync_weights(model)
    remote.sync_weights(model, mode="keep")  # weights can change while paused
    assert requests.post(server + "/control/resume", **control).json() == {"paused": False}
    worker.join(timeout=60)
    assert max_diff_vs_hf(model, *done[0]) < TOL  # the held request ran under the new weights
    reset = requests.post(server + "/control/reset_prefix_cache", **control)
    assert reset.json() == {"reset": True}


ANOTHER_SHM_TRAINER = """
import sys, torch
from transformers import AutoModelForCausalLM
from chatgen import VLLMGeneration
from helpers import perturbed
url, key, model_dir = sys.argv[1:]
gen = VLLMGeneration(model_dir, "server", server_base_url=url, api_key=key)
report = gen.sync_weights(perturbed(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), 11))
print("synced over", gen._transport, report.tensors)
"""


def test_auto_falls_back_to_the_group_for_a_server_in_another_dev_shm(
    remote, server, server_process, data_and_model
):
    """A trainer with its own /dev/shm (as in another container; here a mount namespace) cannot create the
    server's file: "auto" tells the server, falls back to the group, and the sync lands."""
    from transformers import AutoModelForCausalLM

    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) to give the trainer a /dev/shm of its own")
    trainer = subprocess.run(
        [
            "unshare",
            "--mount",
            "sh",
            "-c",
            'mount -t tmpfs none /dev/shm && exec "$0" "$@"',
            sys.executable,
            "-c",
            ANOTHER_SHM_TRAINER,
            server,
            KEY,
            str(data_and_model[1]),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(
            os.environ,
            PYTHONPATH=os.pathsep.join(
                [
                    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                    os.environ.get("PYTHONPATH", ""),
                ]
            ),
        ),
    )
    assert trainer.returncode == 0, trainer.stderr[-3000:]
    assert "synced over group 21" in trainer.stdout
    model = perturbed(
        AutoModelForCausalLM.from_pretrained(data_and_model[1], dtype=torch.float32).eval(), seed=11
    )
    assert max_diff_vs_hf(model, *remote.generate(PROMPTS, greedy=True)) < TOL
    # the file it could not create left nothing behind
    assert shm_files(server_process[1].pid)[1:] == []


def _trainer_rank(rank, url, model_dir, port, seed, results):
    """One rank of a 2-process torch.distributed trainer that syncs the same model through server mode."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from chatgen import VLLMGeneration
    from chatgen.core.distributed import init_process_group

    init_process_group("gloo", rank, 2, "127.0.0.1", port)
    model = perturbed(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), seed)
    gen = VLLMGeneration(model_dir, "server", server_base_url=url, api_key=KEY)
    results.put((rank, gen.sync_weights(model).tensors))
    dist.destroy_process_group()


def test_a_two_rank_trainer_syncs_through_rank_0(remote, server, data_and_model):
    import torch.multiprocessing as mp
    from transformers import AutoModelForCausalLM

    from chatgen.core.distributed import free_port

    ctx, port = mp.get_context("spawn"), free_port()
    results = ctx.Queue()
    ranks = [
        ctx.Process(
            target=_trainer_rank, args=(r, server, str(data_and_model[1]), port, 8, results)
        )
        for r in range(2)
    ]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(timeout=120)
    assert [p.exitcode for p in ranks] == [0, 0]
    assert sorted(results.get(timeout=5) for _ in ranks) == [(0, 21), (1, 21)]
    model = perturbed(
        AutoModelForCausalLM.from_pretrained(data_and_model[1], dtype=torch.float32).eval(), seed=8
    )
    assert max_diff_vs_hf(model, *remote.generate(PROMPTS, greedy=True)) < TOL


def test_grpo_with_hf_trainer_example_in_server_mode(server, data_and_model):
    from examples.grpo_with_hf_trainer import main

    data, model = data_and_model
    history = main(
        [
            "--mode",
            "server",
            "--server-url",
            server,
            "--api-key",
            KEY,
            "--model",
            str(model),
            "--data",
            str(data),
            "--steps",
            "2",
            "--prompts",
            "4",
            "--group",
            "4",
            "--eval-every",
            "1",
            "--eval-prompts",
            "8",
        ]
    )
    assert [r["step"] for r in history] == [0, 1, 2]
    assert history[0]["loss"] != 0 and all(r["synced_tensors"] == 21 for r in history[:2])
    # the server generated with the weights trained at step 0
    assert history[1]["logprob_mismatch"] < TOL
