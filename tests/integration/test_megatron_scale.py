"""MegatronModule at scale on CPU (gloo), with megatron-core's own DDP and distributed optimizer: data parallel
trains like one rank, the optimizer state shrinks per rank with DP, and a distributed checkpoint resumes at
another TP x PP x DP with every bit of weights, fp32 masters and Adam moments.

    python -m pytest tests/integration/test_megatron_scale.py
"""

import json
import shutil

import pytest
import torch
from helpers import batch, build, nll_loss, optimizer_state
from safetensors.torch import load as from_bytes
from safetensors.torch import save as to_bytes

pytestmark = pytest.mark.integration

STEPS = 3  # (a rank returns tensors as safetensors bytes: torch would share their memory with a process that exits)


def optimizer_bytes(trainer) -> int:
    """Bytes of optimizer state on this rank: Adam's two moments, plus the fp32 main weights where they are copies
    (bf16/fp16: megatron's fp32 masters; under fp32 the optimizer steps views of the weights themselves)."""
    total = 0
    for chained in trainer.optimizer.chained_optimizers:
        for state in chained.optimizer.state.values():
            total += sum(
                state[k].numel() * state[k].element_size() for k in ("exp_avg", "exp_avg_sq")
            )
        total += sum(
            p.numel() * p.element_size()
            for group in chained.shard_fp32_from_float16_groups
            for p in group
        )
    return total


def _data_parallel(model_dir, data):
    """Rank body, TP = PP = 1 on 2 ranks, so DP = 2: each rank trains on its half of the global batch."""
    trainer = build(model_dir, lr=1e-3, micro_batch_size=2, global_batch_size=4)
    half = slice(2 * trainer.dp_rank, 2 * trainer.dp_rank + 2)
    steps = [trainer.train_step({"input_ids": data[half]}, nll_loss) for _ in range(STEPS)]
    weights = trainer.hf_state_dict()
    bf16 = build(model_dir, dtype="bfloat16", lr=1e-3)
    bf16.train_step({"input_ids": data[half]}, nll_loss)
    return trainer.dp, steps, to_bytes(weights), optimizer_bytes(bf16)


def test_dp2_trains_like_dp1_on_the_same_global_batch(tiny_llama_dir):
    """DP = 2 (each rank half of the batch, gradients reduce-scattered, weights gathered after each step) gives the
    loss trajectory and weights of one rank on the whole batch; every DP rank ends with the same weights; the
    distributed optimizer holds half the state per rank."""
    from chatgen.training.launcher import run_distributed

    data = batch(b=4, seed=3)
    one = build(tiny_llama_dir, lr=1e-3, micro_batch_size=2, global_batch_size=4)
    ref = [one.train_step({"input_ids": data}, nll_loss) for _ in range(STEPS)]
    ref_weights = one.hf_state_dict()
    bf16 = build(tiny_llama_dir, dtype="bfloat16", lr=1e-3)
    bf16.train_step({"input_ids": data[:2]}, nll_loss)
    dp1_bytes = optimizer_bytes(bf16)
    ranks = [
        (dp, steps, from_bytes(weights), nbytes)
        for dp, steps, weights, nbytes in run_distributed(
            _data_parallel, 2, args=(tiny_llama_dir, data)
        )
    ]
    assert [r[0] for r in ranks] == [2, 2]
    for _, steps, weights, _ in ranks:
        for got, want in zip(steps, ref, strict=True):
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
        assert ref[-1]["loss"] < ref[0]["loss"]  # it trained
        # lr 1e-3 moves weights by ~1e-3 per step; DP float noise (a different summation order) stays ~1e-6
        assert max((weights[k] - w).abs().max().item() for k, w in ref_weights.items()) < 1e-5
    # one model on every DP rank
    assert all(torch.equal(ranks[0][2][k], ranks[1][2][k]) for k in ref_weights)
    dp2_bytes = [r[3] for r in ranks]
    print(f"optimizer state per rank, bf16 tiny Llama: DP1 {dp1_bytes} B, DP2 {dp2_bytes} B")
    assert all(b < 0.55 * dp1_bytes for b in dp2_bytes) and sum(dp2_bytes) >= dp1_bytes


def _save_at_dp2_then_resave_at(model_dir, data, path, layouts, out):
    """Rank body: TP 1 x PP 1 x DP 2, bf16; two steps, save, then the next step (what a resume must reproduce);
    then, in the same two ranks (one job: each start of ranks is seconds of imports), _resave_at."""
    import torch.distributed as dist

    trainer = build(model_dir, dtype="bfloat16", lr=1e-3, micro_batch_size=2, global_batch_size=4)
    half = slice(2 * trainer.dp_rank, 2 * trainer.dp_rank + 2)
    for _ in range(2):
        trainer.train_step({"input_ids": data[half]}, nll_loss)
    trainer.save_checkpoint(path)
    saved = trainer.hf_state_dict()
    next_loss = trainer.train_step({"input_ids": data[half]}, nll_loss)["loss"]
    del trainer  # what the layouts load comes from the checkpoint alone
    dist.barrier()  # every rank's part of it written before any rank loads it
    return to_bytes(saved), next_loss, _resave_at(model_dir, data, path, layouts, out)


def _resave_at(model_dir, data, src, layouts, out):
    """Rank body: load the DP2 checkpoint at each (TP, PP) layout of 2 ranks, save it again there, take the next
    step on the whole batch (DP = 1)."""
    results = []
    for tp, pp in layouts:
        trainer = build(
            src,
            dtype="bfloat16",
            lr=1e-3,
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            micro_batch_size=2,
        )
        loaded = trainer.hf_state_dict()
        trainer.save_checkpoint(f"{out}/tp{tp}pp{pp}")
        results.append(
            (
                trainer.iteration,
                to_bytes(loaded),
                trainer.train_step({"input_ids": data}, nll_loss)["loss"],
            )
        )
    return results


def test_a_distributed_checkpoint_resumes_exactly_at_another_layout(tiny_llama_dir, tmp_path):
    """Saved at TP1 x PP1 x DP2 (bf16: fp32 masters differ from the weights), loaded at TP2, PP2 and DP1: the same
    weights bit for bit, and the optimizer state too (loaded at TP2 / PP2 and saved again there, it comes back at
    DP1 identical to the original's); the next step's loss equals the uninterrupted run's (bf16 noise of another
    summation order). `chatgen convert --to hf` reads the checkpoint whole, with or without chatgen's metadata."""
    from chatgen.models.convert import megatron_checkpoint_to_hf
    from chatgen.training.launcher import run_distributed

    data = batch(b=4, seed=5)
    layouts = [(2, 1), (1, 2)]
    ranks = run_distributed(
        _save_at_dp2_then_resave_at,
        2,
        args=(tiny_llama_dir, data, tmp_path / "dp2", layouts, tmp_path),
    )
    saved, next_loss = from_bytes(ranks[0][0]), ranks[0][1]
    meta = json.loads((tmp_path / "dp2" / "chatgen_megatron.json").read_text())
    assert (
        meta["data_parallel_size"],
        meta["iteration"],
        meta["optimizer"],
        meta["distributed"],
    ) == (2, 2, True, True)
    for *_, rank in ranks:
        for (tp, pp), (iteration, loaded, loss) in zip(layouts, rank):
            loaded = from_bytes(loaded)
            assert iteration == 2 and all(torch.equal(loaded[k], saved[k]) for k in saved), (tp, pp)
            assert loss == pytest.approx(next_loss, rel=1e-3), (tp, pp)
    kw = dict(dtype="bfloat16", lr=1e-3, micro_batch_size=2)
    original = build(tmp_path / "dp2", **kw)  # DP 1, one process
    state = optimizer_state(original)
    assert state and all(torch.equal(original.hf_state_dict()[k], saved[k]) for k in saved)
    for tp, pp in layouts:
        again = build(tmp_path / f"tp{tp}pp{pp}", **kw)
        assert all(torch.equal(a, b) for a, b in zip(optimizer_state(again), state, strict=True)), (
            tp,
            pp,
        )
    assert original.train_step({"input_ids": data}, nll_loss)["loss"] == pytest.approx(
        next_loss, rel=1e-3
    )

    # (the checkpoint keeps megatron's fp32 norm weights; the trainer's HF stream casts them to its bf16)
    _, hf = megatron_checkpoint_to_hf(tmp_path / "tp2pp1")
    assert sorted(hf) == sorted(saved) and all(
        torch.equal(hf[k].to(saved[k].dtype), saved[k]) for k in saved
    )
    # Megatron-LM writes no chatgen metadata
    bare = shutil.copytree(tmp_path / "dp2", tmp_path / "as_megatron_lm")
    (bare / "chatgen_megatron.json").unlink()
    with pytest.raises(FileNotFoundError, match="pass --hf-config"):
        megatron_checkpoint_to_hf(bare)
    _, hf = megatron_checkpoint_to_hf(bare, hf_config=tiny_llama_dir)
    assert all(torch.equal(hf[k].to(saved[k].dtype), saved[k]) for k in saved)
