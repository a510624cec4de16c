"""Megatron -> vLLM weight sync on CPU with real megatron-core and vLLM: after a sync, vLLM's greedy
log-probs equal the trainer's within 1e-4 (fp32) for every layout; bad syncs fail loudly.

Engines start with random weights (load_format=dummy), so only the sync can make them agree.

    python -m pytest tests/integration/test_sync.py
"""

import os

import pytest
import torch
from helpers import (
    SYNC_NEW_TOKENS,
    SYNC_PROMPTS,
    engine,
    generate,
    generated_diff_vs_hf,
    worst_abs_diff,
)

pytestmark = pytest.mark.integration

from chatgen.param_sync import sync_weights  # noqa: E402

TOL = 1e-4


def max_diff_vs_trainer(trainer, generated, prompts=SYNC_PROMPTS) -> float:
    return worst_abs_diff(
        trainer.forward_tokens({"input_ids": torch.tensor([prompt + ids])})[0, len(prompt) - 1 :]
        - torch.tensor(vllm_lp)
        for prompt, (ids, vllm_lp) in zip(prompts, generated)
    )


def trainer(model_dir, **kw):
    from megatron.core import parallel_state as ps

    from chatgen.training.megatron_module import MegatronModule

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    return MegatronModule(dict(load=str(model_dir), **kw)).start()


@pytest.fixture(scope="module")
def models(make_tiny):
    return {
        "llama": make_tiny("tiny_llama"),
        "qwen2": make_tiny("tiny_qwen2"),
        "qwen3": make_tiny("tiny_qwen3"),
        "llama_1kv": make_tiny("tiny_llama", num_key_value_heads=1),
        "llama_ffn256": make_tiny("tiny_llama", intermediate_size=256),
    }


@pytest.fixture(scope="module")
def engines(models):
    llms = {name: engine(models[name]) for name in ("llama", "qwen2", "qwen3")}
    yield llms
    for llm in llms.values():
        llm.shutdown()


# qwen2: QKV bias + tied embeddings; qwen3: QK-norm, head_dim 64 != hidden_size / heads, tied embeddings
@pytest.mark.parametrize(
    "name, tensors", [("llama", 21), ("qwen2", 21 + 6 - 1), ("qwen3", 21 + 4 - 1)]
)
def test_colocated_tp1_sync_matches_trainer(models, engines, name, tensors):
    llm, tr = engines[name], trainer(models[name], lr=1e-2)
    assert max_diff_vs_trainer(tr, generate(llm)) > 1e-2  # random engine weights: far off
    report = sync_weights(tr, llm, validate=True)
    assert report.validated and report.tensors == tensors and report.bytes > 1e6
    assert max_diff_vs_trainer(tr, generate(llm)) < TOL

    # after a training step the engine must follow the trainer's new weights, not the checkpoint's
    def loss_fn(lp, mb):
        return -lp.mean(), {}

    tr.train_step({"input_ids": torch.tensor([SYNC_PROMPTS[1] * 2])}, loss_fn)
    stale = generate(llm)
    assert max_diff_vs_trainer(tr, stale) > 1e-3
    sync_weights(tr, llm, bucket_bytes=300_000)  # several buckets
    assert max_diff_vs_trainer(tr, generate(llm)) < TOL


def test_wrong_architecture_or_shape_is_refused_and_engine_keeps_weights(models, engines):
    from chatgen.param_sync import SyncError

    llm = engines["llama"]
    tr = trainer(models["llama"])
    sync_weights(tr, llm)
    before = generate(llm)
    with pytest.raises(SyncError) as err:  # llama trainer -> qwen2 engine: no biases sent
        sync_weights(trainer(models["llama"]), engines["qwen2"])
    assert (
        "model.layers.0.self_attn.q_proj.bias: the engine expects shape (128,), the trainer sends nothing"
        in str(err.value)
    )
    assert "keeps its old weights" in str(err.value)
    with pytest.raises(SyncError) as err:  # same family, different MLP width
        sync_weights(trainer(models["llama_ffn256"]), llm)
    assert (
        "model.layers.0.mlp.gate_proj.weight: trainer sends shape (256, 128), the engine expects (352, 128)"
        in str(err.value)
    )
    assert generate(llm) == before


def test_failure_mid_stream_says_engine_is_partially_updated(models, engines, monkeypatch):
    from chatgen.param_sync import SyncError
    from chatgen.training.hf_export import HFWeights

    llm, tr = engines["llama"], trainer(models["llama"])
    real = HFWeights.buckets

    def broken(*args, **kwargs):
        for i, bucket in enumerate(real(*args, **kwargs)):
            if i == 2:
                raise ConnectionError("peer went away")
            yield bucket

    monkeypatch.setattr(HFWeights, "buckets", broken)
    with pytest.raises(
        SyncError, match=r"PARTIALLY updated \(\d+ tensors written\).*peer went away"
    ):
        sync_weights(tr, llm, bucket_bytes=300_000)

    # a bucket that arrives wrong: the validation check's own SyncError
    def corrupted(*args, **kwargs):
        for i, bucket in enumerate(real(*args, **kwargs)):
            yield [(name, t + 1.0) for name, t in bucket] if i == 2 else bucket

    monkeypatch.setattr(HFWeights, "buckets", corrupted)
    with pytest.raises(SyncError, match=r"PARTIALLY updated \(\d+ tensors written\).*validation"):
        sync_weights(tr, llm, bucket_bytes=300_000, validate=True)
    monkeypatch.undo()
    sync_weights(tr, llm)  # a full sync repairs it
    assert max_diff_vs_trainer(tr, generate(llm)) < TOL


def _cross_process_trainer(model_dirs, layouts, port, token):
    """Trainer ranks: for each model, one sync per (TP, PP) layout of the 2 ranks into its engine in the parent
    process; (1, 1) is DP = 2: two replicas of the whole model, rank 0 sends. (One job for every model: each start
    of ranks is seconds of imports; each trainer starts afresh.)"""
    from chatgen.param_sync import GroupSender

    tx = GroupSender.to("127.0.0.1", port, token)
    for model_dir in model_dirs:
        for tp, pp in layouts:
            module = trainer(
                model_dir, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp
            )
            sync_weights(module, tx, validate=True, bucket_bytes=300_000)


CROSS_PROCESS = ["llama_1kv", "qwen3"]  # llama_1kv: num_query_groups=1 < TP; qwen3: QK-norm


def test_cross_process_tp2_and_pp2_to_tp1_engine(models):
    """TP 2 -> 1, then PP 2 -> 1, then DP 2 -> 1, over a private gloo group, for each of CROSS_PROCESS."""
    from chatgen.param_sync import GroupReceiver
    from chatgen.training.launcher import DistributedJob

    llms = {name: engine(models[name]) for name in CROSS_PROCESS}
    rx = GroupReceiver.listen()
    layouts = [(2, 1), (1, 2), (1, 1)]
    job = DistributedJob(
        _cross_process_trainer,
        2,
        args=([models[name] for name in CROSS_PROCESS], layouts, rx.port, rx.token),
    )
    try:
        for name, llm in llms.items():
            model_dir = models[name]
            for layout in layouts:
                # engine holds random weights
                assert generated_diff_vs_hf(model_dir, generate(llm)) > 1e-2, (name, layout)
                report = rx.receive_into(llm, alive=job.poll)
                assert report.validated and report.buckets > 1, (name, layout)
                assert generated_diff_vs_hf(model_dir, generate(llm)) < TOL, (name, layout)
                # scramble the engine again so the next layout's sync has to do the work
                g = torch.Generator().manual_seed(1)
                llm.update_weights(
                    [
                        (n, 0.05 * torch.randn(s, generator=g))
                        for n, s in llm.weight_manifest().items()
                    ]
                )
        job.join()
    finally:
        job.stop()
        for llm in llms.values():
            llm.shutdown()


def _colocated_tp2(model_dir, prompts):
    """Each rank: Megatron TP=2 and its vLLM TP=2 rank (external_launcher) in the same process."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from chatgen.training.megatron_module import MegatronModule

    module = MegatronModule(dict(load=str(model_dir), tensor_model_parallel_size=2)).start()
    # WORLD_SIZE=2: external_launcher, one rank per process
    llm = engine(model_dir, tensor_parallel_size=2)
    before = max_diff_vs_trainer(module, generate(llm, prompts), prompts)
    report = sync_weights(module, llm, validate=True)
    after = max_diff_vs_trainer(module, generate(llm, prompts), prompts)
    llm.shutdown()  # frees vLLM's shared-memory segments before the process exits
    return before, after, report.tensors


def test_colocated_tp2_to_vllm_tp2(models):
    from chatgen.training.launcher import run_distributed

    results = run_distributed(
        _colocated_tp2,
        2,
        args=(models["llama"], SYNC_PROMPTS),
        env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
    )
    for before, after, tensors in results:
        assert before > 1e-2 and after < TOL and tensors == 21


def test_check_sync_cli_qwen2_tp2_to_tp1(models, tmp_path):
    import json

    from chatgen.cli import main

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in SYNC_PROMPTS))
    out = tmp_path / "check.json"
    rc = main(
        [
            "check-sync",
            "--hf-checkpoint",
            str(models["qwen2"]),
            "--train-tp",
            "2",
            "--infer-tp",
            "1",
            "--input",
            str(prompts),
            "--output",
            str(out),
            "--max-new-tokens",
            str(SYNC_NEW_TOKENS),
        ]
    )
    result = json.loads(out.read_text())
    assert rc == 0 and result["max_abs_logprob_diff"] < TOL and result["mode"] == "cross-process"
    assert [s["prompt_ids"] for s in result["samples"]] == SYNC_PROMPTS
    for s in result["samples"]:
        assert (
            len(s["output_ids"])
            == len(s["engine_logprobs"])
            == len(s["trainer_logprobs"])
            == SYNC_NEW_TOKENS
        )
    assert result["sync_seconds"] > 0
