"""Unit tests of the RLHF run's pure parts: config checks against an algorithm's MODELS, the rollout contract,
actor-group planning, and the `chatgen train` failure path for a bad YAML (no Ray, vLLM or Megatron starts).

    pytest tests/unit/test_rlhf_run.py
"""

import subprocess
import sys

import pytest
import torch
from helpers import REPO, load

from chatgen.config import ConfigError
from chatgen.core.rollout import RolloutBatch, Sample
from chatgen.core.tensors import select
from chatgen.rlhf import registry
from chatgen.rlhf.checks import check_run
from chatgen.rlhf.config import load_config
from chatgen.rlhf.metrics import sample_metrics
from chatgen.rlhf.placement import GroupPlan, plan_groups
from chatgen.rlhf.weight_links import WeightLinks


def check(cfg):
    check_run(cfg, registry.load(cfg.runtime.algorithm.name))


def errors_of(cfg) -> str:
    with pytest.raises(ConfigError) as e:
        check(cfg)
    return str(e.value)


@pytest.mark.parametrize("name", ["grpo_tiny.yaml", "ppo_tiny.yaml", "grpo_tiny_moe.yaml"])
def test_shipped_tiny_configs_pass(name, data):
    check(load(name, *data))


def test_routing_replay_needs_the_policy_to_record_the_experts(data):
    msg = errors_of(load("grpo_tiny_moe.yaml", *data, "policy.return_routed_experts=false"))
    assert (
        "models.policy_trainer.moe_routing_replay: true replays the experts the policy routed"
        in msg
    )
    assert "set models.policy.return_routed_experts: true" in msg
    check(
        load(
            "grpo_tiny_moe.yaml",
            *data,
            "policy.return_routed_experts=false",
            "policy_trainer.moe_routing_replay=false",
        )
    )


def test_check_config_collects_every_problem(data):
    cfg = load(
        "ppo_tiny.yaml",
        *data,
        "policy.temperature=0.7",
        "runtime.sample_per_episode=12",
        "runtime.train_micro_batch_size=4",
        "runtime.train_global_batch_size=4",
        "models.reference.trainable=true",
    )
    msg = errors_of(cfg)
    assert (
        "temperature" in msg and "sample_per_episode: 12 is not a multiple of policy n=2" not in msg
    )
    assert "models.reference.trainable: must be false" in msg
    msg = errors_of(load("grpo_tiny.yaml", *data, "policy.n=1", "runtime.algorithm.kl_coef=0.1"))
    assert "models.policy.n: GRPO compares the n samples of a prompt; set n >= 2" in msg
    assert "kl_coef: 0.1 needs a `reference` model" in msg


def test_model_names_come_from_the_algorithm(tmp_path, data):
    main = tmp_path / "main.yaml"
    main.write_text(f"""
runtime: {{algorithm: {{name: ppo, kl_coef: 0.1}}}}
models:
  policy: {{backend: vllm, model_config_file: {REPO}/configs/grpo_tiny/policy.yaml}}
  policy_trainer: {{backend: megatron, trainable: true, model_config_file: {REPO}/configs/grpo_tiny/trainer.yaml}}
  value: {{backend: megatron, model_config_file: {REPO}/configs/grpo_tiny/trainer.yaml}}
""")
    with pytest.raises(ConfigError) as e:  # the loader already knows ppo's models
        load_config(main, data)
    assert (
        "models.value: not a model of ppo; valid model names: policy, policy_trainer, reference, reward, "
        "value_trainer"
    ) in str(e.value)
    main.write_text(main.read_text().replace("  value: ", "  # value: "))
    msg = errors_of(load_config(main, data))
    assert "models.value_trainer: ppo needs a `value_trainer` model" in msg
    assert "models.reward: ppo needs a `reward` model" in msg


def test_unknown_algorithm_names_the_choices(tmp_path, data):
    with pytest.raises(ConfigError) as e:
        load("grpo_tiny.yaml", *data, "runtime.algorithm.name=gpro")
    assert "runtime.algorithm.name: unknown algorithm 'gpro'; did you mean 'grpo'?" in str(e.value)
    with pytest.raises(ConfigError) as e:  # a key of another algorithm
        load("grpo_tiny.yaml", *data, "runtime.algorithm.gamma=0.9")
    assert "runtime.algorithm.gamma: unknown key" in str(e.value)


def test_an_algorithm_of_your_own_is_one_module_named_in_yaml(tmp_path, data, monkeypatch):
    (tmp_path / "my_algo.py").write_text('''
import dataclasses
from chatgen.config import opt
from chatgen.rlhf.schema import AlgorithmConfig, Role

@dataclasses.dataclass(kw_only=True)
class Config(AlgorithmConfig):
    beta: float = opt(0.5, "how much")

MODELS = {"policy_trainer": Role("megatron", trainable=True)}

def train(cfg, resume=False, log=print):
    return {"beta": cfg.runtime.algorithm.beta}
''')
    monkeypatch.syspath_prepend(str(tmp_path))
    main = tmp_path / "main.yaml"
    main.write_text(f"""
runtime: {{algorithm: {{name: my_algo, beta: 0.25}}}}
models:
  policy_trainer: {{backend: megatron, trainable: true, model_config_file: {REPO}/configs/grpo_tiny/trainer.yaml}}
""")
    # a bare name means a shipped one
    with pytest.raises(ConfigError, match="unknown algorithm 'my_algo'"):
        load_config(main, data)
    main.write_text(main.read_text().replace("name: my_algo", "name: my_algo.x"))
    with pytest.raises(ConfigError, match="unknown algorithm 'my_algo.x'"):
        load_config(main, data)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "my_algo.py").write_text((tmp_path / "my_algo.py").read_text())
    main.write_text(main.read_text().replace("name: my_algo.x", "name: pkg.my_algo"))
    cfg = load_config(main, data)
    check(cfg)
    assert registry.load("pkg.my_algo").train(cfg) == {"beta": 0.25}


def test_check_config_data_paths(tmp_path):
    msg = errors_of(load("grpo_tiny.yaml", f"runtime.data_path={tmp_path}/missing.jsonl"))
    assert "runtime.data_path:" in msg and "missing.jsonl does not exist" in msg


def test_train_cli_bad_yaml_fails_before_ray(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        (REPO / "configs/grpo_tiny.yaml")
        .read_text()
        .replace("num_episode:", "num_episodes:")
        .replace("model_config_file: grpo_tiny/", f"model_config_file: {REPO}/configs/grpo_tiny/")
    )
    # A fresh interpreter: nothing heavy may have been imported, and Ray must not have started.
    code = (
        "import sys; from chatgen.cli import main; rc = main(['train', sys.argv[1]]); "
        "heavy = [m for m in ('ray', 'vllm', 'megatron.core') if m in sys.modules]; "
        "import ray; print('RESULT', rc, ray.is_initialized(), heavy)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(bad)], capture_output=True, text=True, timeout=120
    )
    assert "RESULT 2 False []" in out.stdout, out.stdout + out.stderr
    assert "runtime.num_episodes: unknown key; did you mean 'num_episode'?" in out.stderr


def two_samples() -> RolloutBatch:
    # prompt [1, 5, 6] + response [7, 2]; prompt [1, 5] + response [8, 9, 2]; pad 0.
    return RolloutBatch.from_samples(
        [
            Sample([1, 5, 6], [7, 2], [-0.5, -0.1], prompt_index=0, text="a"),
            Sample(
                [1, 5],
                [8, 9, 2],
                [-1.0, -2.0, -0.3],
                prompt_index=1,
                text="b",
                finish_reason="length",
            ),
        ],
        pad_token_id=0,
    )


def test_rollout_batch_aligns_masks_with_trainer_positions():
    batch = two_samples()
    assert batch.input_ids.tolist() == [[1, 5, 6, 7, 2], [1, 5, 8, 9, 2]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 1]]
    # Entry t of a (S, L-1) tensor scores token t+1: the response tokens of row 0 are tokens 3 and 4.
    assert batch.loss_mask.tolist() == [[0, 0, 1, 1], [0, 1, 1, 1]]
    assert batch.infer_logprobs[0, 2:4].tolist() == pytest.approx([-0.5, -0.1])
    assert batch.infer_logprobs[1].tolist() == pytest.approx([0.0, -1.0, -2.0, -0.3])
    sub = batch.select([1])
    assert (
        sub.input_ids.tolist() == [[1, 5, 8, 9, 2]]
        and sub.texts == ["b"]
        and sub.finish_reasons == ["length"]
    )
    data = select(batch.trainer_inputs(), torch.tensor([0]))
    assert set(data) == {"input_ids", "attention_mask", "loss_mask"} and data[
        "loss_mask"
    ].shape == (1, 4)


def test_rollout_batch_keeps_masked_turns_and_refuses_misaligned_logprobs():
    masked = RolloutBatch.from_samples(
        [
            Sample(
                [1],
                [4, 5, 6],
                [-1.0, -2.0, -3.0],
                response_mask=[1, 0, 1],
                weight_versions=[0, 0, 1],
            )
        ],
        pad_token_id=0,
    )
    assert masked.loss_mask.tolist() == [[1, 0, 1]] and masked.weight_versions.tolist() == [
        [0, 0, 1]
    ]
    with pytest.raises(ValueError, match="sample 0: 2 response tokens but 1 log-probs"):
        RolloutBatch.from_samples([Sample([1], [4, 5], [-1.0])], pad_token_id=0)


def test_rollout_batch_aligns_routed_experts_with_input_tokens():
    """routed_experts (S, L, layers, k) is per input token (not per predicted one); -1 where the engine routed
    nothing: the last token, padding, and every token of a sample that came without routing."""
    # 3 positions read (prompt 2 + response 2 - 1), 1 layer, top 2
    routed = [
        [[0, 1]],
        [[2, 3]],
        [[1, 2]],
    ]
    batch = RolloutBatch.from_samples(
        [Sample([1, 5], [6, 7], [-0.5, -0.1], routed_experts=routed), Sample([1], [8], [-1.0])],
        pad_token_id=0,
    )
    assert batch.routed_experts.shape == (2, 4, 1, 2) and batch.routed_experts.dtype == torch.long
    assert batch.routed_experts[0, :3].tolist() == routed and batch.routed_experts[
        0, 3
    ].tolist() == [[-1, -1]]
    assert (batch.routed_experts[1] == -1).all()
    assert torch.equal(batch.trainer_inputs()["routed_experts"], batch.routed_experts)
    assert torch.equal(
        select(batch.trainer_inputs(), torch.tensor([1, 0]))["routed_experts"],
        batch.routed_experts[[1, 0]],
    )
    assert batch.select([0]).routed_experts.shape == (1, 4, 1, 2)
    assert two_samples().routed_experts is None  # a dense model's batch has no such field


def test_routing_replay_takes_the_recorded_experts_and_routes_the_rest():
    from chatgen.training.megatron_module import RoutingReplay

    scores = torch.tensor([[0.1, 0.5, 0.3, 0.2], [0.4, 0.1, 0.2, 0.9], [0.3, 0.2, 0.6, 0.1]])

    def own(s, k, num_groups=None, group_topk=None):
        return torch.topk(s, k, dim=1)

    replay = RoutingReplay()
    # nothing set: the router's own top 2
    probs, experts = replay.get_replay_topk(scores, 2, None, None, own)
    assert experts.tolist() == [[1, 2], [3, 0], [2, 0]]
    replay.target = torch.tensor([[0, 3], [-1, -1], [1, 3]])
    probs, experts = replay.get_replay_topk(scores, 2, None, None, own)
    assert experts.tolist() == [[0, 3], [3, 0], [1, 3]]  # row 1 recorded nothing: its own choice
    # its scores at those experts
    assert torch.equal(probs, torch.tensor([[0.1, 0.2], [0.9, 0.4], [0.2, 0.1]]))


def test_sample_metrics_mismatch_only_on_response_tokens():
    batch = two_samples()
    old = batch.infer_logprobs.clone()
    old[0, 0] = 99.0  # a prompt position: not a sampled token, ignored
    old[1, 3] += 0.25
    m = sample_metrics(torch.tensor([1.0, 0.5]), batch, old)
    assert m["mismatch/logprob_max_abs"] == pytest.approx(0.25)
    assert m["mismatch/logprob_mean_abs"] == pytest.approx(0.25 / 5)
    assert m["reward/mean"] == 0.75 and m["reward/solved"] == 0.5 and m["response/length"] == 2.5
    assert "reward/solved" not in sample_metrics(
        torch.tensor([1.0, 0.5]), batch, old, solved_reward=None
    )


def test_plan_groups(data):
    grpo = plan_groups(load("grpo_tiny.yaml", *data))
    assert grpo == [GroupPlan(["policy", "policy_trainer", "reward"], 1, 0, 2.0, {})]
    ppo = plan_groups(load("ppo_tiny.yaml", *data))
    assert [(plan.names, plan.world) for plan in ppo] == [
        (["policy", "reward"], 1),
        (["policy_trainer", "reference", "value_trainer"], 1),
    ]
    # on CPU a mixture-of-experts trainer at EP 2 needs 2 ranks (its experts split over 2 data-parallel ranks)
    moe = plan_groups(
        load(
            "grpo_tiny_moe.yaml",
            *data,
            "runtime.colocation=[[policy, reward]]",
            "policy_trainer.expert_model_parallel_size=2",
        )
    )
    assert [(plan.names, plan.world) for plan in moe] == [
        (["policy", "reward"], 1),
        (["policy_trainer"], 2),
    ]


def test_launcher_runs_one_single_rank_group_in_process_and_the_rest_on_ray(data):
    from chatgen.rlhf.runtime import launcher

    grpo = load("grpo_tiny.yaml", *data)
    assert launcher(grpo, plan_groups(grpo)) == "local"
    ppo = load("ppo_tiny.yaml", *data)  # two groups: Ray actors
    assert launcher(ppo, plan_groups(ppo)) == "ray"
    cluster = load("grpo_tiny.yaml", *data, "runtime.ray_address=auto")
    assert launcher(cluster, plan_groups(cluster)) == "ray"
    forced = load("grpo_tiny.yaml", *data, "runtime.launcher=ray")
    assert launcher(forced, plan_groups(forced)) == "ray"
    impossible = load("ppo_tiny.yaml", *data, "runtime.launcher=local")
    with pytest.raises(
        ValueError, match="runtime.launcher: local needs every model in one colocation group"
    ):
        launcher(impossible, plan_groups(impossible))


def test_plan_groups_rejects_mismatched_colocation(data):
    with pytest.raises(ValueError, match="need different numbers of ranks"):
        plan_groups(load("ppo_tiny.yaml", *data, "policy_trainer.tensor_model_parallel_size=2"))
    with pytest.raises(ValueError, match="set tensor_parallel_size: 2"):
        plan_groups(load("grpo_tiny.yaml", *data, "policy_trainer.tensor_model_parallel_size=2"))


def test_data_parallel_size_multiplies_the_ranks_of_a_megatron_model_on_cpu(data):
    dp2 = [f"{m}.data_parallel_size=2" for m in ("policy_trainer", "reference", "value_trainer")]
    ppo = plan_groups(load("ppo_tiny.yaml", *data, *dp2))
    assert [(plan.names, plan.world) for plan in ppo] == [
        (["policy", "reward"], 1),
        (["policy_trainer", "reference", "value_trainer"], 2),
    ]
    with pytest.raises(ValueError, match="need different numbers of ranks.*TP x PP x DP"):
        plan_groups(load("ppo_tiny.yaml", *data, dp2[0]))
    # the tiny GRPO run keeps its one rank: DP is not derived from num_cpu
    assert plan_groups(load("grpo_tiny.yaml", *data)) == [
        GroupPlan(["policy", "policy_trainer", "reward"], 1, 0, 2.0, {})
    ]
    check(load("ppo_tiny.yaml", *data, *dp2, "runtime.train_micro_batch_size=64"))
    # on GPUs num_gpu gives the world: an explicit DP must agree with it
    gpus = [f"models.{m}.num_gpu=2" for m in ("policy_trainer", "reference", "value_trainer")]
    msg = errors_of(
        load(
            "ppo_tiny.yaml",
            *data,
            *gpus,
            "runtime.train_micro_batch_size=64",
            "policy_trainer.data_parallel_size=4",
        )
    )
    assert (
        "models.policy_trainer.data_parallel_size: 4 needs TP 1 x PP 1 x DP 4 = 4 GPUs, num_gpu is 2; make them "
        "agree"
    ) in msg


def test_batch_sizes_must_split_over_data_parallel_ranks(data):
    # 2 GPUs with TP=PP=1: DP=2, so a global batch of 128 is 64 per rank, less than the micro batch of 128
    dp2 = [
        *data,
        "models.policy_trainer.num_gpu=2",
        "models.reference.num_gpu=2",
        "models.value_trainer.num_gpu=2",
    ]
    msg = errors_of(load("ppo_tiny.yaml", *dp2))
    assert (
        "runtime.train_global_batch_size: 128 does not split into whole micro-batches on every data-parallel "
        "rank (models.policy_trainer has DP = 2 ranks / (TP 1 x PP 1) = 2 and micro batch 128); make it a "
        "multiple of 256"
    ) in msg
    check(load("ppo_tiny.yaml", *dp2, "runtime.train_micro_batch_size=64"))
    # a frozen model only runs forward passes: the episode's samples must split
    msg = errors_of(
        load(
            "ppo_tiny.yaml",
            *dp2,
            "runtime.train_micro_batch_size=64",
            "reference.micro_batch_size=48",
        )
    )
    assert "runtime.sample_per_episode: 256 does not split into whole micro-batches" in msg
    assert "models.reference has DP = 2" in msg and "make it a multiple of 96" in msg


def test_an_episode_is_whole_optimizer_steps(data):
    msg = errors_of(
        load(
            "grpo_tiny.yaml",
            *data,
            "runtime.train_micro_batch_size=32",
            "runtime.train_global_batch_size=96",
        )
    )
    assert (
        "runtime.sample_per_episode: 256 is not a multiple of runtime.train_global_batch_size=96; make it one so "
        "every episode is whole optimizer steps"
    ) in msg


def test_colocated_on_gpus_the_megatron_models_hand_the_memory_to_the_engine_before_it_wakes():
    """The run's side of the memory handoff (MegatronModule.offload, chatgen.rlhf.weight_links): before the sleeping
    engine wakes, every Megatron model of its group offloads; for a sync the engine wakes its weights only, the
    trainers' weights stay (the sync reads them) and follow after it, then the engine's KV cache wakes.
    (Fakes for the actors: the order of the calls is the run's own logic.)"""
    from types import SimpleNamespace

    calls = []

    class Handle:
        def __init__(self, name, backend, group, num_gpu=1):
            self.name, self.backend, self.group, self.entry = (
                name,
                backend,
                group,
                SimpleNamespace(num_gpu=num_gpu, config=SimpleNamespace()),
            )

        def call(self, method, *args):
            calls.append((self.name, method, *args))
            return [None]

        def offload(self, *args):  # a trainer's declared method (chatgen.module.remote)
            return self.call("offload", *args)

        def get(self, refs, what):
            return refs

        def weight_versions(self):
            return [1]

    class Group:
        def run_async(self, fn, *args):
            calls.append(("sync",))
            return []

    shared, apart = Group(), Group()
    handles = {
        "policy": Handle("policy", "vllm", shared),
        "policy_trainer": Handle("policy_trainer", "megatron", shared),
        "reference": Handle("reference", "megatron", shared),
        "reward": Handle("reward", "python", shared),
        "critic": Handle("critic", "megatron", apart),
    }
    runtime = type(
        "Runtime", (), {"handles": handles, "__getitem__": lambda self, name: handles[name]}
    )()
    links = WeightLinks(runtime, {"policy_trainer": "policy"})
    # not the critic elsewhere
    assert links.sleeps and links.offloading == [
        "policy_trainer",
        "reference",
    ]
    links.asleep = True
    links.sync()
    assert calls == [
        ("policy_trainer", "offload", False),
        ("reference", "offload", False),
        ("policy", "wake_up", ["weights"]),
        ("sync",),
        ("policy_trainer", "offload", True),
        ("reference", "offload", True),
        ("policy", "wake_up", ["kv_cache"]),
    ]
    calls.clear()
    links.asleep = True  # the engine generated and slept again; the next generation wakes it
    links.wake()
    assert calls == [
        ("policy_trainer", "offload", True),
        ("reference", "offload", True),
        ("policy", "wake_up"),
    ]
    handles["policy"].entry.num_gpu = 0  # on CPU the engine never sleeps and nothing is offloaded
    links = WeightLinks(runtime, {"policy_trainer": "policy"})
    assert not links.sleeps and links.offloading == []
