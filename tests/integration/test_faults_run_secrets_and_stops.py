"""Real `chatgen train` runs of the tiny GRPO task (issue 50, findings 1 and 2):

- a secret given through ${VAR} and one in a secret-named override reach no file under the output
  directory, checkpoints included, nor the printed config; run state is this user's only;
- a reward service that sends its headers and then a byte every 2 s: the run with `timeout: 3`
  ends by itself within the timeout + 10 s of its first request, naming the URL;
- SIGTERM while that service holds the reward (timeout 600): exit 143 within 30 s.

    pytest tests/integration/test_faults_run_secrets_and_stops.py
"""

import http.server
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import selected_tests

pytestmark = [pytest.mark.integration, pytest.mark.faults]

REPO = Path(__file__).resolve().parents[2]
ENV_SECRET, OVERRIDE_SECRET = "sk-live-env-0123456789", "pw-override-98765"
SMALL = [
    "runtime.num_episode=1",
    "runtime.sample_per_episode=8",
    "policy.n=2",
    "runtime.train_micro_batch_size=8",
    "runtime.train_global_batch_size=8",
    "runtime.generation_batch_size=8",
    "runtime.eval_episode_interval=null",
    "runtime.save_episode_interval=1",
]


@pytest.fixture(scope="module")
def project(tmp_path_factory, tiny_llama_dir):
    """configs/grpo_tiny.yaml (and its per-model files) copied, the tiny task's data beside it."""
    from chatgen import tasks

    root = tmp_path_factory.mktemp("run")
    shutil.copytree(REPO / "configs" / "grpo_tiny", root / "grpo_tiny")
    shutil.copy(REPO / "configs" / "grpo_tiny.yaml", root / "grpo_tiny.yaml")
    tasks.write_task_data(str(root / "data"), n_train=16, n_eval=4)
    return root


def command(project, out: str, *extra) -> list:
    return [
        sys.executable,
        "-m",
        "chatgen.cli",
        "train",
        str(project / "grpo_tiny.yaml"),
        *SMALL,
        f"runtime.output_dir={project / out}",
        *extra,
    ]


def environment(tiny, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "CHATGEN_VERBOSE"}
    env.update(PYTHONPATH=str(REPO), POLICY_LOAD=str(tiny), DATA_DIR="data", **extra)
    return env


@pytest.fixture(scope="module", autouse=True)
def secrets_run(request, project, tiny_llama_dir):
    """The run of test_no_secret_reaches_a_file_of_the_run_checkpoints_included, started when the
    module begins (when that test is selected): a whole run in a process of its own, beside the
    runs of the other tests (each is seconds of imports on about one core; CI has two). (the
    process, its stdout, its stderr: files, so that no pipe nobody reads yet fills)"""
    import tempfile

    wanted = "test_no_secret_reaches_a_file_of_the_run_checkpoints_included"
    if wanted not in selected_tests(request, __file__):
        yield None
        return
    with tempfile.TemporaryFile("w+") as stdout, tempfile.TemporaryFile("w+") as stderr:
        proc = subprocess.Popen(
            [
                *command(project, "secrets"),
                "-v",  # the resolved config printed too
                "policy.args.header=Bearer ${JUDGE_KEY}",
                f"policy.args.password={OVERRIDE_SECRET}",
                "runtime.loggers=[jsonl,tensorboard]",
            ],
            cwd=project,
            stdout=stdout,
            stderr=stderr,
            text=True,
            env=environment(tiny_llama_dir, JUDGE_KEY=ENV_SECRET),
        )
        yield proc, stdout, stderr
        proc.kill()
        proc.wait()


class Trickle(http.server.BaseHTTPRequestHandler):
    """A reward service that answers 200 and then a space every 2 s, never the rewards."""

    protocol_version = "HTTP/1.1"
    first: float | None = None

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        Trickle.first = Trickle.first or time.monotonic()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", "1000000")
        self.end_headers()
        try:
            for _ in range(600):
                self.wfile.write(b" ")
                self.wfile.flush()
                time.sleep(2)
        except OSError:
            pass

    def log_message(self, *args):
        pass


@pytest.fixture
def trickle():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Trickle)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    Trickle.first = None
    yield f"http://127.0.0.1:{server.server_address[1]}/score"
    server.shutdown()
    server.server_close()


def reward_terms(url: str, timeout: float) -> list:
    return [
        "models.reward.model_class=chatgen.rlhf.rewards:Rewards",
        "models.reward.config={terms: {service: {url: '%s', timeout: %s, retries: 0}}}"
        % (url, timeout),
    ]


def start(project, tiny, out, extra) -> subprocess.Popen:
    # the reward section of the copy: its `rule` key is not a Rewards key
    main = project / f"{out}.yaml"
    main.write_text(
        (project / "grpo_tiny.yaml").read_text().replace("      rule: sort_digits\n", "")
    )
    args = command(project, out, *extra)
    args[4] = str(main)
    return subprocess.Popen(
        args,
        cwd=project,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=environment(tiny),
    )


def wait_for_the_first_request(proc, limit: float = 600) -> float:
    start = time.monotonic()
    while Trickle.first is None:
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        assert time.monotonic() - start < limit, "the run never asked for a reward"
        time.sleep(0.2)
    return Trickle.first


def test_a_trickling_reward_service_ends_the_run_by_its_timeout(project, tiny_llama_dir, trickle):
    proc = start(project, tiny_llama_dir, "stuck", reward_terms(trickle, 3))
    try:
        first = wait_for_the_first_request(proc)
        proc.wait(timeout=3 + 10 + 30)  # the bound asserted below, plus room for a report
        took = time.monotonic() - first
        output = proc.stdout.read()
    finally:
        proc.kill()
    assert took < 3 + 10, f"{took:.1f} s"
    assert proc.returncode not in (0, None)
    assert f"reward service: {trickle} failed after 1 tries" in output
    assert "no complete answer within 3 s" in output


def test_sigterm_while_a_reward_is_stuck_exits_within_30_s(project, tiny_llama_dir, trickle):
    proc = start(project, tiny_llama_dir, "term", reward_terms(trickle, 600))
    try:
        wait_for_the_first_request(proc)
        time.sleep(2)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        took = time.monotonic() - sent
        output = proc.stdout.read()
    finally:
        proc.kill()
    assert proc.returncode == 143, output[-3000:]
    assert took < 30, f"{took:.1f} s"
    assert "terminated (SIGTERM)" in output


def test_sigterm_while_the_models_start_exits_within_30_s(project, tiny_llama_dir):
    """The other slow phase of a run: SIGTERM while the engine and the trainer are being built."""
    proc = subprocess.Popen(
        command(project, "starting"),
        cwd=project,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=environment(tiny_llama_dir),
    )
    try:
        for line in proc.stdout:  # the run's first line: the models start next
            if line.startswith("[chatgen] grpo:"):
                break
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        took = time.monotonic() - sent
        output = proc.stdout.read()
    finally:
        proc.kill()
    assert proc.returncode == 143 and took < 30, (proc.returncode, took, output[-3000:])
    assert "terminated (SIGTERM)" in output


# last: its run started with the module (secrets_run) and went on beside the runs above
def test_no_secret_reaches_a_file_of_the_run_checkpoints_included(secrets_run, project):
    proc, stdout, stderr = secrets_run
    proc.wait(timeout=900)
    stdout.seek(0)
    stderr.seek(0)
    printed = stdout.read() + stderr.read()
    assert proc.returncode == 0, printed[-6000:]
    out = project / "secrets"
    files = [p for p in out.rglob("*") if p.is_file()]
    assert any(p.name == "engine_state.json" for p in files)
    for secret in (ENV_SECRET, OVERRIDE_SECRET):
        assert [str(p) for p in files if secret.encode() in p.read_bytes()] == []
        assert secret not in printed
    state = next(p for p in files if p.name == "engine_state.json").read_text()
    assert "Bearer ${JUDGE_KEY}" in state  # written as the config gave it
    assert out.stat().st_mode & 0o777 == 0o700
    # what the trainers write inside a checkpoint is behind these
    for p in [out / "checkpoints", *(out / "checkpoints").glob("episode_*")]:
        assert p.stat().st_mode & 0o777 == 0o700, p
    for p in out.rglob("*"):
        if p.name in ("engine_state.json", "resolved_config.yaml", ".chatgen.lock", "latest"):
            assert p.stat().st_mode & 0o777 == 0o600, p
