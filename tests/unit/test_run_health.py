"""The run's own safety logic, without actors: health checks, the output-directory lock, checkpoint manifests.

pytest tests/unit/test_run_health.py
"""

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from chatgen.rlhf import checkpoint as ckpt
from chatgen.rlhf.health import (
    RunHealthError,
    StepHealth,
    check_cut_prompts,
    check_rewards,
    checked_rewards,
    zero_variance_groups,
)

pytestmark = pytest.mark.faults


def test_diverged_training_stops_after_the_configured_steps():
    logged = []
    health = StepHealth(3, logged.append)
    good, nan = dict(grad_norm=1.0, loss=0.1), dict(grad_norm=float("nan"))
    health.check("policy_trainer", nan)
    health.check("policy_trainer", dict(grad_norm=1.0, loss=float("inf")))
    health.check("policy_trainer", good)  # a good step resets the count
    health.check("policy_trainer", nan)
    health.check("policy_trainer", dict(grad_norm=2.0, skipped_step=1.0))
    assert len(logged) == 4 and all("WARNING" in line for line in logged)
    with pytest.raises(
        RunHealthError,
        match=r"non-finite loss or gradient norm .*3 in a row, "
        r"runtime.max_bad_train_steps=3",
    ):
        health.check("policy_trainer", nan)


def test_equal_rewards_warn_and_count_but_never_stop_the_run():
    """Issue 28, finding 4: a solved batch (every group's rewards equal, so zero advantages and a
    zero gradient) stopped the run after 3 steps as "collapsed or diverged"."""
    logged = []
    health = StepHealth(3, logged.append)
    for _ in range(10):
        health.check("policy_trainer", dict(grad_norm=0.0, loss=0.0))
    assert len(logged) == 10 and "zero gradient norm" in logged[0] and "rewards equal" in logged[0]
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5])  # groups of 2: equal, different, equal
    assert zero_variance_groups(rewards, 2, logged.append) == 2
    assert len(logged) == 10  # not every group: no warning
    assert zero_variance_groups(torch.ones(6), 3, logged.append) == 2
    assert "every group's 3 rewards are equal" in logged[-1]


def test_a_log_prob_mismatch_that_jumps_or_is_not_finite_stops_the_run():
    logged = []
    health = StepHealth(2, logged.append)
    for value in (2e-5, 3e-5, 1e-5, 0.05):  # noise, and 0.05 under the floor of a jump (0.1)
        health.check_mismatch(
            {"mismatch/logprob_mean_abs": value, "mismatch/logprob_max_abs": value}
        )
    assert logged == []
    health.check_mismatch({"mismatch/logprob_mean_abs": 0.8})
    assert "mismatch/logprob_mean_abs = 0.8 is not finite or jumped" in logged[0]
    health.check_mismatch({"mismatch/logprob_mean_abs": 3e-5})  # back to normal: the count restarts
    health.check_mismatch({"mismatch/logprob_max_abs": float("nan")})
    with pytest.raises(RunHealthError, match="logprob_max_abs = inf .*2 in a row.*check-sync"):
        health.check_mismatch({"mismatch/logprob_max_abs": float("inf")})


def test_too_many_cut_prompts_stop_the_run_before_training():
    logged = []
    items = [{"input_ids": [1]}, {"input_ids": [1], "prompt_cut": True}]
    check_cut_prompts(items, 0.5, logged.append)  # half: at the limit, a warning
    assert "1 of 2 training prompts were cut" in logged[0]
    items.append({"input_ids": [1], "prompt_cut": True})
    with pytest.raises(
        RunHealthError, match="2 of 3 training prompts .*runtime.max_cut_prompt_fraction=0.5"
    ):
        check_cut_prompts(items, 0.5, logged.append)


def test_a_nan_reward_stops_the_run_naming_the_sample():
    check_rewards(torch.tensor([0.0, 1.0]), ["a", "b"])
    with pytest.raises(RunHealthError, match=r"NaN/inf for samples \[1\] \(e.g. response 'b'\)"):
        check_rewards(torch.tensor([0.0, float("nan")]), ["a", "b"])


@pytest.mark.parametrize(
    "returned, said",
    [
        (None, "returned NoneType None"),
        ("0.5", "returned str '0.5'"),
        (["a", "b"], "returned a list of str"),
        ([1.0], r"returned 1 values for 2 completions"),
        ({"reward": [1.0, 0.0]}, "returned dict"),
    ],
)
def test_a_reward_of_the_wrong_type_is_refused_naming_the_reward(returned, said):
    """Issue 28, finding 10: None gave a raw TypeError traceback, a string "too many dimensions"."""
    assert checked_rewards([1, 0.5], ["a", "b"], "reward (my.Reward).score").tolist() == [1.0, 0.5]
    with pytest.raises(
        (TypeError, ValueError), match=rf"reward \(my.Reward\).score {said}.*must return 2 numbers"
    ):
        checked_rewards(returned, ["a", "b"], "reward (my.Reward).score")


def test_output_directory_lock_refuses_a_second_run_and_frees_on_exit(tmp_path):
    held = ckpt.lock_output_dir(tmp_path)
    code = (
        "import sys; from chatgen.rlhf.checkpoint import lock_output_dir\n"
        "try:\n    lock_output_dir(sys.argv[1]); print('LOCKED')\n"
        "except FileExistsError as e:\n    print('REFUSED', e)"
    )
    other = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert other.stdout.startswith("REFUSED") and "in use by another chatgen run" in other.stdout, (
        other.stderr
    )
    held.close()  # (a killed process releases it the same way: the kernel drops the lock)
    other = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert other.stdout.strip() == "LOCKED"


def make_checkpoint(save_dir, episode):
    tmp = ckpt.begin_checkpoint(save_dir, episode)
    (tmp / "policy_trainer").mkdir()
    save_file({"w": torch.zeros(16)}, str(tmp / "policy_trainer" / "model_tp0_pp0.safetensors"))
    (tmp / "policy_trainer" / "optim_tp0_pp0.pt").write_bytes(b"y" * 50)
    return ckpt.commit_checkpoint(tmp, {"episode": episode})


def test_a_damaged_checkpoint_is_refused_naming_the_file_and_the_way_back(tmp_path):
    make_checkpoint(tmp_path, 1)
    latest = make_checkpoint(tmp_path, 2)
    assert (
        json.loads((latest / "manifest.json").read_text())["policy_trainer/optim_tp0_pp0.pt"] == 50
    )
    assert ckpt.resume_point(tmp_path) == latest
    (latest / "policy_trainer" / "optim_tp0_pp0.pt").unlink()
    with pytest.raises(ckpt.CheckpointError) as err:
        ckpt.resume_point(tmp_path)
    assert "optim_tp0_pp0.pt is missing" in str(
        err.value
    ) and "--resume-from episode_000001" in str(err.value)
    weights = tmp_path / "episode_000001" / "policy_trainer" / "model_tp0_pp0.safetensors"
    good = weights.read_bytes()
    # overwritten in place, same size: the header no longer parses
    weights.write_bytes(b"\xff" * 16 + good[16:])
    with pytest.raises(
        ckpt.CheckpointError, match="model_tp0_pp0.safetensors is not a readable safetensors file"
    ):
        ckpt.resume_point(tmp_path, "episode_000001")
    weights.write_bytes(b"x" * 10)
    with pytest.raises(
        ckpt.CheckpointError, match=f"has 10 bytes, {len(good)} when saved.*no earlier checkpoint"
    ):
        ckpt.resume_point(tmp_path, "episode_000001")
    # a bad flag: exit 2
    with pytest.raises(
        FileNotFoundError,
        match="no checkpoint there; the checkpoints of this run are episode_000001, episode_000002",
    ):
        ckpt.resume_point(tmp_path, "episode_000007")
