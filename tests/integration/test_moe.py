"""Mixture-of-experts families (Qwen3-MoE, Mixtral) end to end on CPU with real megatron-core and vLLM.

    python -m pytest tests/integration/test_moe.py

Megatron equals HF transformers at TP 1, TP 2 and EP 2; one training step at EP 2 equals TP 1; a checkpoint saved
at EP 2 holds every expert; `chatgen check-sync` at EP 2 and TP 2 -> vLLM is within 1e-4 of the trainer and of HF
transformers with every expert weight in the engine exact, and its per-expert check names experts a sync mixed up;
routing replay: the engine records the experts it routed each token to, and a trainer with moe_routing_replay
computes with exactly those.
"""

import json

import pytest
import torch

pytestmark = pytest.mark.integration

TOL = 1e-4  # fp32
FAMILIES = ["tiny_qwen3_moe", "tiny_mixtral"]


@pytest.fixture(scope="module")
def moe_models(make_tiny):
    return {name: make_tiny(name) for name in FAMILIES}


def batch(vocab=500, b=4, t=16, seed=0):
    return torch.randint(4, vocab, (b, t), generator=torch.Generator().manual_seed(seed))


def nll_loss(logprobs, micro_batch):
    loss = -logprobs.mean()
    return loss, {"nll": loss.detach()}


def hf_logprobs(model_dir, input_ids):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, input_ids[:, 1:, None])[..., 0]


def build(model_dir, **kw):
    from megatron.core import parallel_state as ps

    from chatgen.training.megatron_module import MegatronModule

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    return MegatronModule(dict(load=str(model_dir), **kw)).start()


def _layouts(models, ids, refs, ckpt_root):
    """Rank body of the 2-process job: per family, TP 2 then EP 2 (floats back: picklable)."""
    from safetensors.torch import load_file

    from chatgen.models.convert import megatron_checkpoint_to_hf

    out = {}
    for name, model_dir in models.items():
        hf_ref, (metrics, weights) = refs[name]
        original = load_file(str(model_dir / "model.safetensors"))
        for tp, ep in ((2, 1), (1, 2)):
            trainer = build(
                model_dir, tensor_model_parallel_size=tp, expert_model_parallel_size=ep, lr=1e-3
            )
            res = {
                "logprob_diff": float(
                    (trainer.forward_tokens({"input_ids": ids}) - hf_ref).abs().max()
                ),
                "weights_exact": all(
                    torch.equal(t, original[k]) for k, t in trainer.hf_state_dict().items()
                ),
            }
            if tp > 1:
                try:
                    trainer.train_step({"input_ids": ids}, nll_loss)
                except ValueError as e:
                    res["refused"] = str(e)
            else:  # EP 2 carves 2 data-parallel ranks: each trains on its half of the batch
                half = ids.shape[0] // 2
                step = trainer.train_step(
                    {"input_ids": ids[trainer.dp_rank * half : (trainer.dp_rank + 1) * half]},
                    nll_loss,
                )
                after = trainer.hf_state_dict()
                res.update(
                    loss=step["loss"],
                    grad_norm=step["grad_norm"],
                    usage=[step[f"moe/expert_usage/{e}"] for e in range(trainer.spec.num_experts)],
                    weight_diff=max(float((after[k] - w).abs().max()) for k, w in weights.items()),
                )
                # every expert, whatever the EP
                ckpt = trainer.save_checkpoint(ckpt_root / f"{name}_ep2")
                res["checkpoint_exact"] = all(
                    torch.equal(t, after[k]) for k, t in megatron_checkpoint_to_hf(ckpt)[1].items()
                )
            out[f"{name} TP{tp} EP{ep}"] = res
    return out


def test_megatron_moe_matches_hf_at_tp_and_ep_and_ep2_trains_like_tp1(moe_models, tmp_path):
    """TP 1 (here) and TP 2 / EP 2 (a 2-process job) equal HF; HF weights come back exactly (hf_weights gathers
    the experts over EP); one EP 2 step (DP 2) gives TP 1's loss, grad norm, expert usage and weights; the EP 2
    checkpoint holds every expert; MoE training at TP 2 is refused with the fix."""
    from chatgen.training.launcher import run_distributed

    ids = batch()
    refs = {}
    for name, model_dir in moe_models.items():
        hf_ref = hf_logprobs(model_dir, ids)
        trainer = build(model_dir, lr=1e-3)
        assert (trainer.forward_tokens({"input_ids": ids}) - hf_ref).abs().max() < TOL, name
        metrics = trainer.train_step({"input_ids": ids}, nll_loss)
        usage = [metrics[f"moe/expert_usage/{e}"] for e in range(trainer.spec.num_experts)]
        # every token slot counted
        assert sum(usage) == pytest.approx(1.0) and min(usage) > 0, (
            name,
            usage,
        )
        assert "moe/load_balancing_loss" not in metrics  # moe_aux_loss_coeff 0
        refs[name] = (hf_ref, (metrics, trainer.hf_state_dict()))
        trainer.shutdown()
    results = run_distributed(_layouts, 2, args=(moe_models, ids, refs, tmp_path))
    for rank_results in results:
        for case, res in rank_results.items():
            name = case.split()[0]
            assert res["logprob_diff"] < TOL and res["weights_exact"], (case, res)
            if "TP2" in case:
                assert "trains at tensor_model_parallel_size=1" in res["refused"], case
                assert "expert_model_parallel_size" in res["refused"], case
            else:
                metrics = refs[name][1][0]
                assert res["loss"] == pytest.approx(metrics["loss"], rel=1e-5), case
                assert res["grad_norm"] == pytest.approx(metrics["grad_norm"], rel=1e-4), case
                assert res["usage"] == pytest.approx(
                    [metrics[f"moe/expert_usage/{e}"] for e in range(4)]
                ), case
                # AdamW's first step moves each weight by about lr = 1e-3: an expert grad not summed over the EP
                # ranks' tokens, or averaged with another expert's, would move some the wrong way
                assert res["weight_diff"] < 2e-5 and res["checkpoint_exact"], (case, res)


def test_router_load_balancing_loss_is_trained_and_logged(moe_models):
    ids = batch()
    plain = build(moe_models["tiny_qwen3_moe"], lr=1e-3)
    loss = plain.train_step({"input_ids": ids}, nll_loss)["loss"]
    plain.shutdown()
    balanced = build(moe_models["tiny_qwen3_moe"], lr=1e-3, moe_aux_loss_coeff=0.5)
    router = balanced.local_param("decoder.layers.0.mlp.router.weight").detach().clone()
    metrics = balanced.train_step({"input_ids": ids}, nll_loss)
    # Switch's loss E * sum_e f_e * p_e: 1 when balanced, more otherwise; the router learns from it too
    assert 1.0 <= metrics["moe/load_balancing_loss"] < 2.0
    # the aux loss reaches the gradient, not the loss_fn
    assert metrics["loss"] == pytest.approx(loss, rel=1e-6)
    assert not torch.equal(router, balanced.local_param("decoder.layers.0.mlp.router.weight"))
    balanced.shutdown()


def _check_sync(model_dir, tmp_path, *layout):
    from chatgen.cli import main

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        '{"prompt_ids": [1, 5, 17, 99, 200]}\n{"prompt_ids": [1, 2, 3, 4, 5, 6, 7]}\n'
    )
    out = tmp_path / "check.json"
    code = main(
        [
            "check-sync",
            "--hf-checkpoint",
            str(model_dir),
            *layout,
            "--input",
            str(prompts),
            "--output",
            str(out),
            "--max-new-tokens",
            "12",
        ]
    )
    return code, json.loads(out.read_text())


LAYOUTS = {"ep2": ("--train-ep", "2"), "tp2": ("--train-tp", "2")}
# each layout with each family once in the fast tier (Qwen3-MoE's mapping at EP 2, Mixtral's at TP
# 2); the other two pairs take the same layout code and the same family mapping: slow
FAST_PAIRS = {("ep2", "tiny_qwen3_moe"), ("tp2", "tiny_mixtral")}


@pytest.mark.parametrize(
    "layout, name",
    [
        pytest.param(
            LAYOUTS[layout],
            name,
            id=f"{layout}-{name}",
            marks=() if (layout, name) in FAST_PAIRS else pytest.mark.slow,
        )
        for layout in LAYOUTS
        for name in FAMILIES
    ],
)
def test_check_sync_expert_and_tensor_parallel_trainer_into_vllm(
    moe_models, tmp_path, name, layout
):
    code, report = _check_sync(moe_models[name], tmp_path, *layout)
    assert code == 0 and report["mode"] == "cross-process"
    assert report["max_abs_logprob_diff"] < TOL
    # every expert weight of the engine read back (vLLM's fused, CPU-prepacked layout) equals the checkpoint
    cfg = json.loads((moe_models[name] / "config.json").read_text())
    assert (
        len(report["expert_weight_max_abs_diff"])
        == cfg["num_hidden_layers"] * cfg["num_local_experts"] * 3
    )
    assert report["max_abs_expert_weight_diff"] == 0.0
    # and what vLLM computes after the sync is HF transformers' model
    for sample in report["samples"]:
        ids = torch.tensor([sample["prompt_ids"] + sample["output_ids"]])
        hf = hf_logprobs(moe_models[name], ids)[0, len(sample["prompt_ids"]) - 1 :]
        assert (hf - torch.tensor(sample["engine_logprobs"])).abs().max() < TOL


def engine(model_dir):
    """A VLLMModule on random weights (load_format dummy)."""
    from chatgen.generation.vllm.module import VLLMModule

    return VLLMModule(
        dict(
            load=str(model_dir),
            load_format="dummy",
            enforce_eager=True,
            dtype="float32",
            seed=0,
            kv_cache_memory_bytes=32 << 20,
            seq_length=128,
            max_new_tokens=16,
        )
    ).start()


def test_per_expert_check_names_the_experts_a_sync_mixed_up(moe_models):
    """A sync that sends expert 1's weights as expert 2's and back (a mapping bug a log-prob check may miss when
    the router rarely picks them) shows in the per-expert report, for exactly those six tensors."""
    from safetensors.torch import load_file

    from chatgen import models
    from chatgen.param_sync import sync_weights
    from chatgen.tools.check_sync import expert_weight_diffs

    model_dir = moe_models["tiny_qwen3_moe"]
    spec = models.spec_from_hf_config(json.loads((model_dir / "config.json").read_text()))
    weights = load_file(str(model_dir / "model.safetensors"))
    swap = {
        f"model.layers.1.mlp.experts.{a}.{w}.weight": f"model.layers.1.mlp.experts.{b}.{w}.weight"
        for a, b in ((1, 2), (2, 1))
        for w in ("gate_proj", "up_proj", "down_proj")
    }
    llm = engine(model_dir)
    try:
        sync_weights({name: weights[swap.get(name, name)] for name in weights}, llm)
        diffs = expert_weight_diffs(llm, spec, model_dir)
        assert {name for name, d in diffs.items() if d > 0} == set(swap)
        sync_weights(weights, llm)
        assert max(expert_weight_diffs(llm, spec, model_dir).values()) == 0.0
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def recorded(moe_models):
    """A RolloutBatch from a VLLMModule that records routing (2 samples per prompt), and the HF model's own
    top-k per token and layer for the same sequences."""
    from transformers import AutoModelForCausalLM

    from chatgen.generation.vllm.module import VLLMModule

    model_dir = moe_models["tiny_qwen3_moe"]
    policy = VLLMModule(
        dict(
            load=str(model_dir),
            kv_cache_memory_bytes=32 << 20,
            enforce_eager=True,
            seq_length=64,
            new_token_limit=True,
            max_new_tokens=12,
            logprobs_mode="raw",
            temperature=1.0,
            seed=0,
            n=2,
            return_routed_experts=True,
        )
    ).start()
    try:
        rollout = policy.run_generation(
            policy.build_dataset(["sort: 3 1 2 =", "hello there", "add: 2 3 ="])
        )
    finally:
        policy.shutdown()
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        # per layer (S*L, E)
        router_logits = hf(rollout.input_ids, output_router_logits=True).router_logits
    # (S, L, layers, k)
    hf_topk = torch.stack(
        [
            logits.topk(2, dim=-1).indices.view(*rollout.input_ids.shape, 2)
            for logits in router_logits
        ],
        dim=2,
    )
    return model_dir, rollout, hf_topk


def test_engine_records_the_experts_it_routed_each_token_to(recorded):
    _, rollout, hf_topk = recorded
    s, width = rollout.input_ids.shape
    assert rollout.routed_experts.shape == (s, width, 2, 2)
    # positions the model read: all but the last
    read = rollout.prompt_lengths + rollout.response_lengths - 1
    for row in range(s):
        routed = rollout.routed_experts[row]
        assert (routed[: read[row]] >= 0).all() and (routed[read[row] :] == -1).all(), row
        # the same experts as HF transformers' router (as sets: vLLM does not order a token's top k)
        ours = routed[: read[row]].sort(dim=-1).values
        theirs = hf_topk[row, : read[row]].sort(dim=-1).values
        assert torch.equal(ours, theirs), row


def test_trainer_replays_the_recorded_experts(recorded):
    model_dir, rollout, _ = recorded
    data = rollout.trainer_inputs()
    # every entry (no loss_mask: with one, forward_tokens computes only the entries it marks, packed)
    own = build(model_dir).forward_tokens({k: v for k, v in data.items() if k != "loss_mask"})
    replaying = build(model_dir, moe_routing_replay=True)
    replayed = replaying.forward_tokens(data)
    assert ((replayed - rollout.infer_logprobs).abs() * rollout.loss_mask).max() < TOL
    # it computes with the batch's experts, not its own: other experts give other log-probs ...
    moved = dict(
        data,
        routed_experts=torch.where(
            data["routed_experts"] >= 0, (data["routed_experts"] + 1) % 4, data["routed_experts"]
        ),
    )
    assert ((replaying.forward_tokens(moved) - replayed).abs() * rollout.loss_mask).max() > 1e-3
    # ... and routes by itself where nothing was recorded (-1)
    unknown = dict(data, routed_experts=torch.full_like(data["routed_experts"], -1))
    assert torch.equal(replaying.forward_tokens(unknown), own)
    with pytest.raises(
        ValueError, match="moe_routing_replay is true but the batch has no routed_experts"
    ):
        replaying.forward_tokens({"input_ids": data["input_ids"]})


@pytest.mark.parametrize("ep", [1, 2])
def test_grpo_on_the_tiny_moe_replays_routing_and_logs_the_router(
    ray_session, moe_models, tmp_path, monkeypatch, ep
):
    """configs/grpo_tiny_moe.yaml for two small episodes: the engine records routing, the trainer replays it (the
    first step's log-probs equal the engine's), the router's figures are in the metrics. EP 2: the trainer runs as
    two Ray actors (its experts split between them, two data-parallel ranks), apart from the engine, and its
    checkpoint holds every expert (on the session's Ray: tests/integration/conftest.py)."""
    from pathlib import Path

    from chatgen import tasks
    from chatgen.models.convert import megatron_checkpoint_to_hf
    from chatgen.rlhf.algorithms import grpo
    from chatgen.rlhf.config import load_config

    repo = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(repo)
    data, out, model = tmp_path / "data", tmp_path / "run", moe_models["tiny_qwen3_moe"]
    tasks.write_task_data(str(data), n_train=64, n_eval=8)
    overrides = {
        "runtime.data_path": f"{data}/train.jsonl",
        "runtime.eval_data_path": f"{data}/eval.jsonl",
        "runtime.output_dir": out,
        "runtime.num_episode": 2,
        "runtime.sample_per_episode": 32,
        "runtime.train_micro_batch_size": 8,
        "runtime.train_global_batch_size": 16,
        "runtime.eval_episode_interval": 2,
        "runtime.save_episode_interval": 2,
        "policy.load": model,
        "policy.n": 4,
        "policy_trainer.load": model,
        "policy_trainer.expert_model_parallel_size": ep,
    }
    if ep > 1:
        overrides["runtime.colocation"] = "[[policy, reward]]"
    grpo.train(
        load_config(
            repo / "configs/grpo_tiny_moe.yaml", [f"{k}={v}" for k, v in overrides.items()]
        ),
        log=lambda *_: None,
    )
    saved = megatron_checkpoint_to_hf(out / "checkpoints" / "episode_000002" / "policy_trainer")[1]
    # layers x experts x (gate, up, down)
    assert sum("experts" in name for name in saved) == 2 * 4 * 3
    metrics = {
        r["episode"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
    }
    for episode in (1, 2):
        m = metrics[episode]
        # replayed experts, exact sync: the engine's log-probs
        assert m["mismatch/logprob_max_abs"] < TOL
        usage = [m[f"policy/moe/expert_usage/{e}"] for e in range(4)]
        assert sum(usage) == pytest.approx(1.0) and min(usage) > 0
        assert 0.5 < m["policy/moe/load_balancing_loss"] < 4.0 and m["policy/grad_norm"] > 0
    assert "eval/reward" in metrics[2]
