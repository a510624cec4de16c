"""A two-node Ray cluster on this machine's loopback, and a GRPO run across it, as on a real cluster.

    python -m pytest tests/integration/test_two_node.py        # ~40 s on 2 idle CPU cores (~3.5 min under load 15-20)

Two raylets on 127.0.0.1 (`ray start`, one CPU each, token authentication, each in its own directory with its
own temporary directory) and a driver in a third directory, attached through RAY_ADDRESS as `ray job submit`
attaches one. The run's configs use relative paths (the main YAML's model files, the model and the data), which
the driver resolves: the actors work in their raylet's directory. The policy runs as two replicas on one node,
the trainer on the other; its weights reach both replicas by one broadcast per bucket. What is checked: `chatgen
config` places the layout on the cluster's nodes (and refuses one that does not fit), the run learns (from a
short supervised warm start, its greedy reward on the 8 prompts it trains on more than doubles in 8 episodes;
the engines' samples score as the trainer scores them after every sync, on both replicas), every listening
socket is loopback, and the test
stops its cluster by its own processes' ids, leaving no process and no file.

Ray 2.60 turns a loopback node address into the machine's routable one (`resolve_ip_for_localhost`); the
cluster's processes and the driver run with that function keeping the address as given (RAY_START, DRIVER).
"""

import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
from helpers import is_loopback, listening_sockets
from timeouts import scaled

pytestmark = pytest.mark.integration

SYNC_TOL = 1e-4

KEEP_LOOPBACK = (
    "import ray._private.services as services\n"
    "services.resolve_ip_for_localhost = lambda host: host  # Ray would swap 127.0.0.1 for the routable IP\n"
)
RAY_START = (
    KEEP_LOOPBACK
    + "import sys\nfrom ray.scripts.scripts import main\nsys.argv[0] = 'ray'\nmain()\n"
)
DRIVER = KEEP_LOOPBACK + "import sys\nfrom chatgen.cli import main\nsys.exit(main(sys.argv[1:]))\n"
PROBE = (
    KEEP_LOOPBACK
    + """import sys, time
import ray
ray.init(address=sys.argv[1], log_to_driver=False, logging_level="ERROR")
while len([n for n in ray.nodes() if n["Alive"]]) < int(sys.argv[2]):
    time.sleep(0.5)
"""
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LoopbackCluster:
    """Ray nodes started by this process on 127.0.0.1; `stop()` ends exactly the processes they started."""

    def __init__(self, base: Path, nodes: int = 2):
        self.base, self.port, self.procs = base, _free_port(), []
        token = base / "auth_token"
        token.write_text(secrets.token_hex(32))
        token.chmod(0o600)
        self.env = {
            **os.environ,
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN_PATH": str(token),
            "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_ADDRESS": f"127.0.0.1:{self.port}",
        }
        # the actors import what the driver tells them to, nothing of this test
        self.env.pop("PYTHONPATH", None)
        self._start(
            0,
            [
                "--head",
                f"--port={self.port}",
                "--include-dashboard=false",
                f"--ray-client-server-port={_free_port()}",
            ],
        )
        deadline = time.time() + scaled(120)
        while True:  # the head's GCS answers before the others may join it
            try:
                socket.create_connection(("127.0.0.1", self.port), 1).close()
                break
            except OSError:
                if time.time() > deadline or self.procs[0].poll() is not None:
                    raise RuntimeError(f"the head node did not start: {self.log(0)}")
                time.sleep(0.5)
        for i in range(1, nodes):
            self._start(i, [f"--address=127.0.0.1:{self.port}"])
        self._probe(nodes)

    def _probe(self, nodes: int, tries: int = 3) -> None:
        """Wait until `nodes` nodes are alive, as a driver sees them; a probe that fails (under load Ray's first
        connection can time out) is retried, and the last one's stderr and the nodes' logs are shown."""
        for attempt in range(1, tries + 1):
            try:
                probe = subprocess.run(
                    [sys.executable, "-c", PROBE, self.env["RAY_ADDRESS"], str(nodes)],
                    env=self.env,
                    cwd=self.base,
                    timeout=scaled(180),
                    capture_output=True,
                    text=True,
                )
            except subprocess.TimeoutExpired as e:
                probe, why = (
                    None,
                    f"timed out after {e.timeout:.0f} s; stderr: {(e.stderr or b'')[-2000:]!r}",
                )
            if probe is not None and probe.returncode == 0:
                return
            if probe is not None:
                why = f"exit {probe.returncode}; stderr:\n{probe.stderr[-3000:]}"
            print(f"two-node cluster probe {attempt}/{tries} failed ({why})", file=sys.stderr)
        raise RuntimeError(
            f"the cluster's {nodes} nodes never all answered a driver: probe {why}\n"
            f"head node log:\n{self.log(0)}"
        )

    def _start(self, i: int, args: list) -> None:
        node = self.base / f"node{i}"
        node.mkdir()
        with open(self.base / f"node{i}.log", "w") as log:  # the child keeps its own descriptor
            self.procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-c",
                        RAY_START,
                        "start",
                        "--block",
                        "--node-ip-address=127.0.0.1",
                        "--num-cpus=1",
                        f"--temp-dir={node / 'ray'}",
                        f"--dashboard-agent-listen-port={_free_port()}",
                        "--object-store-memory=200000000",
                        "--disable-usage-stats",
                        *args,
                    ],
                    cwd=node,
                    env=self.env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )

    def log(self, i: int) -> str:
        return (self.base / f"node{i}.log").read_text()[-3000:]

    def processes(self) -> list:
        """Every process of the cluster: the `ray start` launchers, what they started, and any process with a
        file open in the cluster's directory (a worker that outlived its raylet)."""
        found = {}
        for proc in self.procs:
            try:
                root = psutil.Process(proc.pid)
                found.update({p.pid: p for p in [root, *root.children(recursive=True)]})
            except psutil.NoSuchProcess:
                pass
        prefix = os.path.join(str(self.base), "")
        for p in psutil.process_iter():
            try:
                if p.pid not in found and any(f.path.startswith(prefix) for f in p.open_files()):
                    found[p.pid] = p
            except psutil.Error:
                pass
        return list(found.values())

    def stop(self) -> list:
        """SIGTERM every process of the cluster, SIGKILL what is left after 5 s; returns what still runs."""
        for _ in range(2):  # a second pass for anything started while the first one ran
            procs = self.processes()
            for p in procs:
                try:
                    p.terminate()
                except psutil.Error:
                    pass
            _, alive = psutil.wait_procs(procs, timeout=5)
            for p in alive:
                try:
                    p.kill()
                except psutil.Error:
                    pass
            psutil.wait_procs(alive, timeout=5)
        for proc in self.procs:
            proc.wait(timeout=5)
        return [p for p in self.processes() if p.is_running()]


@pytest.fixture(scope="module")
def cluster():
    base = Path(tempfile.mkdtemp(prefix="chatgen-2node-"))
    started = None
    try:
        started = LoopbackCluster(base)
        yield started
    finally:
        left = started.stop() if started is not None else []
        shutil.rmtree(base, ignore_errors=True)
        assert not left, f"cluster processes left running: {[(p.pid, p.name()) for p in left]}"


MAIN = """# chatgen train configs/main.yaml   (tests/integration/test_two_node.py: every path relative)
runtime:
  num_episode: 8
  sample_per_episode: 64                  # the same 8 prompts x n=8 every episode
  train_micro_batch_size: 16
  train_global_batch_size: 32
  save_episode_interval: 8
  eval_episode_interval: 8
  data_path: data/train.jsonl
  eval_data_path: data/train.jsonl        # greedy reward on what it trains on: does it learn?
  output_dir: out
  colocation: [[policy, reward]]
  placement_strategy: PACK
  algorithm: {name: grpo, old_logprobs: recompute}
models:
  policy: {backend: vllm, model_config_file: policy.yaml, num_replicas: 2, num_cpu: 1}
  policy_trainer: {backend: megatron, model_config_file: trainer.yaml, trainable: true, num_cpu: 1}
  reward: {backend: python, model_class: "chatgen.rlhf.rewards:RuleReward", config: {rule: sort_digits}}
"""
POLICY = """# chatgen train configs/main.yaml
# chatgen-schema: vllm
load: model
n: 8
eval_temperature: 0.0
stop_token_list: "</s>"
new_token_limit: true
max_new_tokens: 16
seq_length: 64
logprobs_mode: raw
kv_cache_memory_bytes: 8388608
enforce_eager: true
"""
TRAINER = """# chatgen train configs/main.yaml
# chatgen-schema: megatron
load: model
seq_length: 64
lr: 1.0e-3
"""


def test_grpo_across_two_nodes_with_relative_paths(cluster, tiny_llama_dir, tmp_path):
    from helpers import quick_warm_start

    from chatgen import tasks
    from chatgen.core.jsonl import read_prompt_records

    driver = tmp_path / "driver"
    tasks.write_task_data(str(driver / "data"), n_train=8, n_eval=8)  # the run's prompts
    # the warm start's demonstrations
    tasks.write_task_data(str(tmp_path / "sft"), n_train=64, n_eval=8)
    quick_warm_start(
        tiny_llama_dir,
        read_prompt_records(tmp_path / "sft" / "sft.jsonl"),
        driver / "model",
        steps=100,
    )
    for name, text in (("main.yaml", MAIN), ("policy.yaml", POLICY), ("trainer.yaml", TRAINER)):
        (driver / "configs").mkdir(exist_ok=True)
        (driver / "configs" / name).write_text(text)
    # chatgen config reads the cluster's nodes: the layout fits; a trainer needing 2 CPUs on nodes of 1 does not
    # (both at once: each is seconds of imports and of attaching to the cluster, on one core)
    check = [sys.executable, "-c", DRIVER, "config", "configs/main.yaml"]
    checks = [
        subprocess.Popen(
            argv,
            cwd=driver,
            env=cluster.env,
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
        )
        for argv in (check, [*check, "models.policy_trainer.num_cpu=2"])
    ]
    try:
        (_, fits), (_, too_big) = [p.communicate(timeout=scaled(300)) for p in checks]
    finally:
        for p in checks:
            p.kill()
    assert checks[0].returncode == 0, fits[-3000:]
    assert (
        checks[1].returncode == 2
        and "runtime.placement_strategy: PACK: policy_trainer needs 1 x {CPU: 2}" in too_big
    ), too_big[-3000:]
    with listening_sockets() as seen:
        run = subprocess.run(
            [sys.executable, "-c", DRIVER, "train", "configs/main.yaml"],
            cwd=driver,
            env=cluster.env,
            capture_output=True,
            text=True,
            timeout=scaled(900),
        )
    assert run.returncode == 0, run.stderr[-4000:] + cluster.log(0)
    # the cluster and the run: loopback only
    assert not [s for s in seen if not is_loopback(s[1])], seen
    # two groups on two nodes: the replicas on one, the trainer on the other
    started = dict(re.findall(r"started (\S+): .* on node\(s\) (\S+) in", run.stdout))
    assert set(started) == {"policy+reward", "policy_trainer"}, run.stdout[-3000:]
    assert started["policy+reward"] != started["policy_trainer"]
    metrics = {
        r["episode"]: r
        for r in map(json.loads, (driver / "out" / "metrics.jsonl").read_text().splitlines())
    }
    assert sorted(metrics) == list(range(9))
    for episode in range(1, 9):
        m = metrics[episode]
        assert (
            m["policy/grad_norm"] > 0 and m["replica/0/samples"] > 0 and m["replica/1/samples"] > 0
        )
        # from episode 2 on sampled after a broadcast: every sample of both replicas scores as the trainer scores it
        assert m["mismatch/logprob_max_abs"] < SYNC_TOL
    # it learns: its greedy reward on the prompts it trains on rises (3-7x in 8 episodes over 4 seeds in-process)
    assert metrics[8]["eval/reward"] > 2 * metrics[0]["eval/reward"] > 0
    assert (driver / "out" / "checkpoints" / "episode_000008").is_dir()
