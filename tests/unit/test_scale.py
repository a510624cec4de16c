"""Unit tests of scale-out's own logic: the layout of a run's ranks and its checks, placement on a cluster's nodes,
what actors inherit, relative paths, how prompts are spread over replicas and put back in order, and the weight
broadcast to several engines over a real gloo group (engines that record what they are given stand in for vLLM).

    pytest tests/unit/test_scale.py
"""

import json
import threading
from pathlib import Path

import pytest
import torch
from helpers import REPO, load

from chatgen import tasks
from chatgen.config import ConfigError
from chatgen.core.rollout import RolloutBatch, Sample
from chatgen.param_sync import GroupReceiver, GroupSender, ShmSender, SyncError, load_shm
from chatgen.rlhf import registry
from chatgen.rlhf.checks import check_run
from chatgen.rlhf.generation_group import GenerationGroup, assign
from chatgen.rlhf.placement import placement_problems, plan_groups, ranks_by_node, topology_problems


def model_dir(path: Path, heads: int, kv_heads: int) -> Path:
    """A directory with only a config.json: what the layout checks read of a model."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(
        json.dumps({"num_attention_heads": heads, "num_key_value_heads": kv_heads})
    )
    return path


# --- the layout of a run's ranks -------------------------------------------------------------------------------


def test_replicas_tile_a_colocated_trainer_whatever_its_tp(data):
    tp2 = [*data, "policy_trainer.tensor_model_parallel_size=2"]
    assert [
        (p.names, p.world)
        for p in plan_groups(load("grpo_tiny.yaml", *tp2, "models.policy.num_replicas=2"))
    ] == [(["policy", "policy_trainer", "reward"], 2)]
    # one TP 2 engine
    assert plan_groups(load("grpo_tiny.yaml", *tp2, "policy.tensor_parallel_size=2"))[0].world == 2
    with pytest.raises(
        ConfigError,
        match=r"models.policy: num_replicas 2 x tensor_parallel_size 2 = 4 engine rank\(s\), "
        r"but it is colocated with 2 trainer ranks .* set num_replicas: 1",
    ):
        plan_groups(
            load(
                "grpo_tiny.yaml",
                *tp2,
                "models.policy.num_replicas=2",
                "policy.tensor_parallel_size=2",
            )
        )


def test_disaggregated_replicas_are_a_group_of_their_own(data):
    cfg = load(
        "grpo_tiny.yaml",
        *data,
        "runtime.colocation=[[policy, reward]]",
        "models.policy.num_replicas=3",
        "policy.tensor_parallel_size=2",
        "models.policy.num_cpu=6",
        "models.policy_trainer.num_cpu=1",
    )
    policy, trainer = plan_groups(cfg)
    # 3 replicas x TP 2
    assert (policy.names, policy.world, policy.cpus) == (
        ["policy", "reward"],
        6,
        1.0,
    )
    assert (trainer.names, trainer.world) == (["policy_trainer"], 1)


def test_impossible_layouts_are_named_with_their_key_and_fix(data, tmp_path):
    qwen7b = model_dir(tmp_path / "qwen7b", heads=28, kv_heads=4)  # Qwen2.5-7B's heads: no TP 8
    cfg = load(
        "grpo_tiny.yaml",
        *data,
        f"policy.load={qwen7b}",
        f"policy_trainer.load={qwen7b}",
        "policy.tensor_parallel_size=8",
        "models.policy.num_gpu=4",
        "policy_trainer.tensor_model_parallel_size=8",
        "runtime.colocation=[[policy, reward]]",
    )
    problems = "\n".join(topology_problems(cfg))
    assert (
        "models.policy.tensor_parallel_size: 8 does not split the model's 28 attention heads (4 KV heads; "
        f"{qwen7b}/config.json); use one of [1, 2, 4, 28] and more num_replicas for the same devices"
    ) in problems
    assert (
        "models.policy_trainer.tensor_model_parallel_size: 8 does not split the model's 28 attention heads"
        in problems
    )
    assert "models.policy.num_gpu: 4 GPUs is not a multiple of tensor_parallel_size 8" in problems
    cfg = load(
        "grpo_tiny.yaml",
        *data,
        "models.policy.num_gpu=8",
        "models.policy.num_replicas=2",
        "policy.tensor_parallel_size=2",
        "runtime.colocation=[[policy, reward]]",
    )
    assert topology_problems(cfg) == [
        "models.policy.num_gpu: 8 GPUs, but num_replicas 2 x tensor_parallel_size 2 = 4 "
        "engine ranks of one GPU each; set num_gpu: 4, or num_replicas: 4 to use 8 GPUs"
    ]
    # what chatgen config and train check
    with pytest.raises(ConfigError, match="num_replicas: 4 to use 8 GPUs"):
        check_run(cfg, registry.load("grpo"))
    with pytest.raises(
        ConfigError, match="models.reward.num_replicas: 2 replicas of a python model"
    ):
        load("grpo_tiny.yaml", *data, "models.reward.num_replicas=2")


def test_placement_on_a_cluster_s_nodes(data):
    cfg = load(
        "grpo_tiny.yaml",
        *data,
        "runtime.colocation=[[policy, reward]]",
        "models.policy.num_replicas=2",
        "models.policy.num_cpu=1",
        "models.policy_trainer.num_cpu=1",
    )
    plans, two_nodes = plan_groups(cfg), [{"CPU": 1.0, "node:127.0.0.1": 1.0}, {"CPU": 1.0}]
    # the replicas (0.5 CPU each) on one, the trainer
    assert placement_problems(plans, two_nodes, "PACK", cfg) == []
    # SPREAD splits the replicas: no whole CPU left
    assert placement_problems(plans, two_nodes, "SPREAD", cfg) != []
    cfg = load(
        "grpo_tiny.yaml",
        *data,
        "runtime.colocation=[[policy, reward]]",
        "models.policy.num_replicas=2",
        "models.policy_trainer.num_cpu=2",
    )
    problems = placement_problems(plan_groups(cfg), two_nodes, "STRICT_PACK", cfg)
    assert len(problems) == 2 and problems[0].startswith(
        "runtime.placement_strategy: STRICT_PACK: policy+reward needs 2 x {CPU: 1} on one node"
    )
    assert (
        "policy_trainer needs 1 x {CPU: 2}" in problems[1]
        and "lower num_gpu / num_cpu, add nodes" in problems[1]
    )
    # GPUs: TP 2 engines on nodes of 3 GPUs: ranks node by node would cut a TP group in two
    gpus = load(
        "grpo_tiny.yaml",
        *data,
        "runtime.colocation=[[policy, reward]]",
        "models.policy.num_replicas=2",
        "policy.tensor_parallel_size=2",
        "models.policy.num_gpu=4",
        "models.policy_trainer.num_gpu=1",
    )
    problems = placement_problems(
        plan_groups(gpus), [{"CPU": 8, "GPU": 3}, {"CPU": 8, "GPU": 3}], "PACK", gpus
    )
    assert problems == [
        "runtime.placement_strategy: PACK: models.policy: a tensor-parallel group of 2 ranks would "
        "span two nodes (ranks per node: [3, 1]); use STRICT_PACK, or num_gpu / num_cpu that put a "
        "multiple of 2 ranks on each node"
    ]
    assert (
        placement_problems(
            plan_groups(gpus), [{"CPU": 8, "GPU": 4}, {"CPU": 8, "GPU": 4}], "PACK", gpus
        )
        == []
    )


def test_ranks_follow_the_nodes_their_bundles_landed_on():
    # node b first (bundle 0), then node a
    assert ranks_by_node(["b", "a", "b", "a"]) == [
        0,
        2,
        1,
        3,
    ]
    assert ranks_by_node(["a", "a", "b"]) == [0, 1, 2]


def test_actors_get_the_cluster_variables_and_ray_address_attaches(data, monkeypatch):
    from chatgen.rlhf.runtime import cluster_address, launcher, worker_env

    for key in (
        "NCCL_SOCKET_IFNAME",
        "GLOO_SOCKET_IFNAME",
        "PYTORCH_CUDA_ALLOC_CONF",
        "CUDA_DEVICE_MAX_CONNECTIONS",
        "CUDA_VISIBLE_DEVICES",
        "UNRELATED_VARIABLE",
    ):
        monkeypatch.setenv(key, "x")
    env = worker_env()
    assert {
        "NCCL_SOCKET_IFNAME",
        "GLOO_SOCKET_IFNAME",
        "PYTORCH_CUDA_ALLOC_CONF",
        "CUDA_DEVICE_MAX_CONNECTIONS",
    } <= set(env)
    # Ray gives each actor its devices
    assert "CUDA_VISIBLE_DEVICES" not in env and "UNRELATED_VARIABLE" not in env
    cfg = load("grpo_tiny.yaml", *data)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert cluster_address(cfg.runtime) is None and launcher(cfg, plan_groups(cfg)) == "local"
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")  # as `ray job submit` runs a job's driver
    assert (
        cluster_address(cfg.runtime) == "10.0.0.1:6379" and launcher(cfg, plan_groups(cfg)) == "ray"
    )


def test_relative_paths_are_made_absolute_by_the_driver(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tasks.write_task_data("data", n_train=64, n_eval=8)
    cfg = load(
        "grpo_tiny.yaml",
        "runtime.data_path=data/train.jsonl",
        "runtime.eval_data_path=data/eval.jsonl",
        "runtime.output_dir=out",
        "policy.load=models/m",
        "policy_trainer.load=~/m",
        "policy.tokenizer=",
    )
    assert cfg.runtime.data_path == str(
        tmp_path / "data/train.jsonl"
    ) and cfg.runtime.output_dir == str(tmp_path / "out")
    assert cfg.models["policy"].config.load == str(tmp_path / "models/m")
    assert cfg.models["policy_trainer"].config.load == str(Path.home() / "m")
    assert cfg.models["policy"].config.tokenizer is None  # unset stays unset
    check_run(cfg, registry.load("grpo"))  # the data file is found from anywhere now


# --- prompts over replicas ---------------------------------------------------------------------------------------


def test_prompts_go_to_the_replica_with_the_fewest_outstanding_tokens():
    # not round robin: the long prompt alone
    assert assign([10, 10, 10, 30], [0, 0]) == [
        [3],
        [0, 1, 2],
    ]
    # replica 0 still busy with another call
    assert assign([10, 10, 10, 10], [35, 0]) == [
        [],
        [0, 1, 2, 3],
    ]
    assert assign([5, 5, 5, 5], [0, 0, 0]) == [[0, 3], [1], [2]]


class _Engine:
    """A generation module's `run_generation` for one replica: each prompt answered n times with its tokens
    reversed, one token longer per sample (so replicas return batches of different widths)."""

    def __init__(self, n):
        self.n, self.metrics, self.pad_token_id = n, {}, 0

    def run_generation(self, items, is_eval=False):
        samples = [
            Sample(
                item["input_ids"],
                item["input_ids"][::-1] + [7] * j,
                [-0.5] * (len(item["input_ids"]) + j),
                prompt_index=k,
                text=f"{item['input_ids']}.{j}",
            )
            for k, item in enumerate(items)
            for j in range(self.n)
        ]
        self.metrics = {
            "generation_tokens": sum(len(s.response_ids) for s in samples),
            "elapsed_s": 0.5,
        }
        return RolloutBatch.from_samples(samples, 0)


class _Group:
    """The calls GenerationGroup makes of an actor group, run in this process (ranks 0..world-1)."""

    def __init__(self, world, n):
        self.world_size, self.workers = (
            world,
            [type("W", (), {"models": {"policy": _Engine(n)}})() for _ in range(world)],
        )

    def run_each(self, fn, per_rank_args):
        return [
            lambda w=w, a=a: fn(w, *a) for w, a in zip(self.workers, per_rank_args) if a is not None
        ]

    def run_async(self, fn, *args):
        return [lambda w=w: fn(w, *args) for w in self.workers]

    def get(self, thunks, what, labels=None):
        return [t() for t in thunks]


def test_replicas_answer_as_one_engine_in_the_caller_s_order():
    from chatgen.generation.config import GenerationConfig
    from chatgen.rlhf.runtime import ModelHandle
    from chatgen.rlhf.schema import ModelEntry

    # prompts of 1..7 tokens
    n, items = (
        3,
        [{"input_ids": list(range(1, 2 + (i * 5) % 7))} for i in range(9)],
    )
    entry = ModelEntry(backend="vllm", num_replicas=2, config=GenerationConfig(n=n))
    group = GenerationGroup(ModelHandle("policy", entry, _Group(2, n)))
    batch = group.run_generation(items)
    expected = _Engine(n).run_generation(items)  # what one engine returns for all of them
    assert (
        batch.prompt_index.tolist() == [i for i in range(9) for _ in range(n)]
        and batch.texts == expected.texts
    )
    assert torch.equal(batch.input_ids, expected.input_ids) and torch.equal(
        batch.loss_mask, expected.loss_mask
    )
    assert torch.equal(batch.infer_logprobs, expected.infer_logprobs)
    metrics = group.pop_metrics()
    assert metrics["replica/0/samples"] + metrics["replica/1/samples"] == 9 * n
    assert metrics["replica/0/samples"] % n == 0  # a prompt's n samples stay on one replica
    assert group.pop_metrics()["replica/0/samples"] == 0  # counted per log, from zero


def test_nemo_rl_names_are_chatgen_s_calls():
    from chatgen.compat.nemo_rl import NemoRLRefit

    calls = []

    class Group(NemoRLRefit):
        def check_weight_manifest(self, manifest):
            calls.append(manifest)

    Group().prepare_refit_info({"a": (torch.Size([3, 4]), torch.float32), "b": (3, 4), "c": [5]})
    # NeMo RL's (shape, dtype) or a shape
    assert calls == [{"a": torch.Size([3, 4]), "b": (3, 4), "c": [5]}]


# --- one trainer -> many engines ---------------------------------------------------------------------------------


class _Target:
    """The generation contract's weight calls, recording what was written."""

    def __init__(self, shapes):
        self.shapes, self.written, self.needs_resync = shapes, {}, None

    def weight_manifest(self):
        return self.shapes

    def load_weights(self, buckets, mode="wait"):
        for bucket in buckets:
            self.written.update((name, t.clone()) for name, t in bucket)
        return 1


def _channel(receivers: int, token: str = "secret"):
    tx = GroupSender("secret", 1 + receivers)
    rxs = [None] * receivers

    def join(i):
        rxs[i] = GroupReceiver(tx.host, tx.port, i + 1, 1 + receivers, token)

    threads = [threading.Thread(target=join, args=(i,)) for i in range(receivers)]
    [t.start() for t in threads]
    tx.connect()
    [t.join() for t in threads]
    return tx, rxs


def _sync(tx, rxs, targets, weights, **kw):
    results = [None] * len(rxs)

    def receive(i):
        try:
            results[i] = rxs[i].receive_into(targets[i])
        except SyncError as e:
            results[i] = e

    threads = [threading.Thread(target=receive, args=(i,)) for i in range(len(rxs))]
    [t.start() for t in threads]
    try:
        sent = tx.send(weights, **kw)
    except SyncError as e:
        sent = e
    [t.join() for t in threads]
    return sent, results


def test_one_broadcast_feeds_every_engine_and_one_refusal_stops_it_for_all():
    weights = [("a", torch.randn(64, 8)), ("b", torch.randn(300)), ("c", torch.randn(5))]
    shapes = {name: tuple(t.shape) for name, t in weights}
    tx, rxs = _channel(2)
    targets = [_Target(shapes), _Target(shapes)]
    sent, results = _sync(tx, rxs, targets, weights, bucket_bytes=3000, validate=True)
    assert sent.buckets == 2 and all(r.validated and r.buckets == 2 for r in results)
    assert all(torch.equal(t.written[name], w) for t in targets for name, w in weights)

    fresh = [_Target(shapes), _Target({**shapes, "c": (6,)})]  # engine rank 2 expects another shape
    sent, results = _sync(tx, rxs, fresh, [(n, t + 1) for n, t in weights])
    assert (
        isinstance(sent, SyncError)
        and "1 of 2 engine rank(s) refused" in str(sent)
        and "engine rank 2: " in str(sent)
    )
    assert "c: trainer sends shape (5,), the engine expects (6,)" in str(results[1])
    assert "this engine keeps its old weights" in str(results[0])
    assert fresh[0].written == {} == fresh[1].written  # nothing written anywhere


def test_a_receiver_without_the_run_s_token_writes_nothing():
    weights = [("a", torch.randn(4))]
    tx, rxs = _channel(1, token="guessed")
    target = _Target({"a": (4,)})
    sent, results = _sync(tx, rxs, [target], weights)
    assert "did not prove this update's token" in str(results[0]) and isinstance(sent, SyncError)
    assert target.written == {}


def test_shared_memory_handles_load_into_each_engine_on_the_host(tmp_path):
    weights = [("a", torch.randn(6, 3)), ("b", torch.randn(7))]
    sender = ShmSender.owned("secret", root=str(tmp_path))
    handles = sender.write(weights)
    assert oct(Path(handles["path"]).parent.stat().st_mode & 0o777) == "0o700"
    targets = [_Target({n: tuple(t.shape) for n, t in weights}) for _ in range(2)]
    for target in targets:
        assert load_shm(target, handles, "secret").tensors == 2
        assert all(torch.equal(target.written[n], t) for n, t in weights)
    with pytest.raises(SyncError, match="not signed with this run's token"):
        load_shm(_Target({}), handles, "other")
    # the old signature
    forged = {
        **handles,
        "header": {**handles["header"], "buckets": [[["a", [18]]]]},
    }
    with pytest.raises(SyncError, match="not signed"):
        load_shm(_Target({"a": (18,)}), forged, "secret")
    sender.close()
    assert not Path(handles["path"]).exists()


# --- the shipped scaling configs ---------------------------------------------------------------------------------

SCALING = sorted((REPO / "configs" / "scaling").glob("*.yaml"))
MODELS = {"7b": (28, 4), "70b": (64, 8)}  # Qwen2.5-7B's and Llama-3.1-70B's attention / KV heads


@pytest.mark.parametrize("path", SCALING, ids=lambda p: p.name)
def test_scaling_configs_pass_chatgen_config(path, tmp_path, monkeypatch, capsys):
    from chatgen.cli import config as config_cli
    from chatgen.cli import main

    tasks.write_task_data(str(tmp_path / "data"), n_train=64, n_eval=8)
    (tmp_path / "data" / "test.jsonl").write_text((tmp_path / "data" / "eval.jsonl").read_text())
    heads, kv = MODELS[path.stem.split("_")[1]]
    # its heads are checked
    monkeypatch.setenv("POLICY_LOAD", str(model_dir(tmp_path / "model", heads, kv)))
    monkeypatch.setenv("DATASET_PATH", str(tmp_path / "data"))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert main(["config", str(path)]) == 0, capsys.readouterr().err
    if path.stem == "grpo_7b_8gpu":  # docs/scaling.md: the same job on 64 GPUs by three overrides
        wide = [
            "models.policy.num_gpu=64",
            "models.policy.num_replicas=32",
            "models.policy_trainer.num_gpu=64",
        ]
        assert main(["config", str(path), *wide]) == 0, capsys.readouterr().err
    # on a cluster: the groups must fit its nodes; 8 nodes of 8 GPUs take every shipped layout
    monkeypatch.setenv("RAY_ADDRESS", "head:6379")
    nodes = {"8x8": [{"CPU": 128.0, "GPU": 8.0}] * 8, "16x4": [{"CPU": 128.0, "GPU": 4.0}] * 16}
    monkeypatch.setattr(config_cli, "cluster_nodes", lambda address: nodes[layout])
    layout = "8x8"
    assert main(["config", str(path)]) == 0, capsys.readouterr().err
    layout = "16x4"  # as many GPUs, 4 per node: a TP 8 group would span two nodes
    code, err = main(["config", str(path)]), capsys.readouterr().err
    if "70b" in path.stem:
        assert (
            code == 2
            and (
                "models.policy: a tensor-parallel group of 8 ranks would span two nodes (ranks per "
                "node: [4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4])"
            )
            in err
        )
        assert "models.policy_trainer: a tensor-parallel group of 8 ranks" in err
    else:
        assert code == 0, err
