"""The Ray cluster of a run: starting a local one (loopback only, with a reaper of its leftovers) or
connecting to `runtime.ray_address`, reading its nodes, and the environment every actor process
gets.

chatgen.rlhf.runtime places the model groups on it (and re-exports these names); `chatgen config`
reads a cluster's nodes through cluster_nodes without starting anything.
docs/failure_and_security.md.
"""

import os
import shutil

from chatgen.core.imports import project_dirs, require
from chatgen.core.process_tuning import PASSIVE_OPENMP

# The driver's variables every actor gets: chatgen's, vLLM's and Hugging Face's, and the
# communication and CUDA tuning of a cluster (NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME,
# PYTORCH_CUDA_ALLOC_CONF, CUDA_DEVICE_MAX_CONNECTIONS,
# ...), which a multi-node job sets on the driver and which must reach the processes that communicate.
FORWARDED_PREFIXES = ("CHATGEN_", "VLLM_", "HF_", "NCCL_", "GLOO_", "PYTORCH_", "CUDA_")
NOT_FORWARDED = ("CUDA_VISIBLE_DEVICES",)  # Ray gives each actor its own devices


def worker_env() -> dict:
    """Environment of every actor, set before its process starts: the driver's import path (the
    project directories of chatgen.core.imports and the current directory first, so examples/ and
    user modules import), the driver's variables of FORWARDED_PREFIXES (with
    chatgen.core.quiet's: vLLM logging errors only unless `chatgen -v`), and passive OpenMP
    waiting (on shared CPU cores, spinning OpenMP threads slow a tiny model's steps ~10x)."""
    path = [
        *project_dirs(),
        os.getcwd(),
        *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p],
    ]
    env = {
        "PYTHONPATH": os.pathsep.join(dict.fromkeys(path)),
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        **PASSIVE_OPENMP,
    }
    env.update(
        {
            k: v
            for k, v in os.environ.items()
            if (k.startswith(FORWARDED_PREFIXES) and k not in NOT_FORWARDED)
            or k in ("OMP_WAIT_POLICY", "LD_PRELOAD")
        }
    )
    return env


def cluster_address(rt) -> str | None:
    """The Ray cluster a run attaches to: runtime.ray_address, else the RAY_ADDRESS variable
    (`ray job submit` sets it for the job's driver), else None (a Ray of this run's own, when Ray
    is used)."""
    return rt.ray_address or os.environ.get("RAY_ADDRESS") or None


def alive_nodes() -> list:
    """The resources of each alive node of the Ray this process is connected to (totals, as `ray start` sized
    them)."""
    import ray

    return [node["Resources"] for node in ray.nodes() if node["Alive"]]


def cluster_nodes(address: str) -> list:
    """`alive_nodes` of the cluster at `address`, for `chatgen config`: connects, reads,
    disconnects; starts nothing on the cluster."""
    require("ray", "reading a Ray cluster (runtime.ray_address)")
    import ray

    ray.init(address=address, log_to_driver=False, configure_logging=False, logging_level="ERROR")
    try:
        return alive_nodes()
    finally:
        ray.shutdown()


def init_ray(address: str | None, num_cpus_needed: float) -> "LocalRay | None":
    """Connect to `address` (a cluster), or start a local Ray sized for this run, listening on
    loopback only.

    Returns the `LocalRay` started here (`Runtime.shutdown` stops it), None when connected to a
    cluster or when Ray was already up.

    A local Ray binds every server (GCS, raylet, workers' gRPC, the agents, the autoscaler monitor)
    to 127.0.0.1: `ray.init` itself turns a loopback node address into the machine's routable one,
    so chatgen switches Ray to the single-machine mode it uses by default on macOS and Windows
    (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, read when Ray resolves the node address) for the start. No
    dashboard; the actors at the driver's priority, without Ray's metrics or idle workers
    (LOCAL_SYSTEM_CONFIG). Its session files and sockets live in a temporary directory of this run, not
    /tmp/ray. Ray's fatal-signal handler is taken off SIGTERM again (it dumped a stack and aborted),
    so SIGTERM reaches the driver's own handler (chatgen.cli: a clean stop).
    docs/failure_and_security.md covers a cluster (runtime.ray_address), where Ray must listen on
    the network: its token authentication and firewall.
    """
    import signal
    import tempfile
    import threading

    import ray
    from ray._private import ray_constants

    if ray.is_initialized():
        return None
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    kwargs = dict(
        include_dashboard=False,
        log_to_driver=True,
        configure_logging=False,
        runtime_env={"env_vars": {"PYTHONPATH": worker_env()["PYTHONPATH"]}},
    )
    main_thread = threading.current_thread() is threading.main_thread()
    sigterm = signal.getsignal(signal.SIGTERM) if main_thread else None
    if address:
        ray.init(address=address, **kwargs)
    else:
        temp_dir = tempfile.mkdtemp(prefix="chatgen-ray-")
        saved = os.environ.get(_SINGLE_MACHINE), ray_constants.ENABLE_RAY_CLUSTER
        # the raylet inherits it too
        os.environ[_SINGLE_MACHINE], ray_constants.ENABLE_RAY_CLUSTER = (
            "0",
            False,
        )
        try:
            # Logical CPUs: enough for every actor of this run even on a 2-core laptop (colocated
            # models take turns on the same cores, so over-subscribing the logical count is what we
            # want).
            ray.init(
                num_cpus=max(int(num_cpus_needed + 0.999), os.cpu_count() or 1),
                _temp_dir=temp_dir,
                _system_config=LOCAL_SYSTEM_CONFIG,
                **kwargs,
            )
        except BaseException:
            shutil.rmtree(temp_dir, ignore_errors=True)
            raise
        finally:
            ray_constants.ENABLE_RAY_CLUSTER = saved[1]
            if saved[0] is None:
                del os.environ[_SINGLE_MACHINE]
            else:
                os.environ[_SINGLE_MACHINE] = saved[0]
        local = LocalRay(temp_dir)
        node_ip = ray.util.get_node_ip_address()
        # a Ray upgrade changed how the node address is picked: refuse to run exposed
        if node_ip != "127.0.0.1":
            local.stop()
            raise RuntimeError(
                f"Ray started on {node_ip}, not on loopback; this Ray version ignores "
                f"{_SINGLE_MACHINE}=0 (see chatgen.rlhf.ray_cluster.init_ray)"
            )
    if main_thread:
        signal.signal(signal.SIGTERM, sigterm)
    return None if address else local


_SINGLE_MACHINE = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"

# A run's own Ray: its actors (the engines, the trainers) at the driver's priority, where Ray starts
# workers at niceness 15 (its default, so that its raylet stays responsive): at 15 every other
# process of the machine (the driver's environments and tools, another job) takes a shared core
# first, and two engines on a 2-core machine ran ~0.75 core each. Left out: Ray's Prometheus metrics
# (an exporter in every process; a run logs its own) and the idle workers the raylet starts ahead
# of any actor (one Python process per CPU). docs/async_rl.md, "Agentic episodes over engines".
LOCAL_SYSTEM_CONFIG = {
    "worker_niceness": 0,
    "enable_metrics_collection": False,
    "enable_worker_prestart": False,
    "prestart_worker_first_driver": False,
}


class LocalRay:
    """The Ray a run started on this machine: its temporary directory, and a reaper process that
    outlives a killed driver. Ray's GCS and raylet die with the driver, but its agents linger
    about a minute (they try to report the raylet's death to the dead GCS); the reaper waits for
    the driver's pipe to close, however the driver ends, then kills every process that holds a
    file of the session directory open (each Ray process logs there) and removes the directory."""

    # The reaper's code (argv[1]: the session directory); self-contained, so it runs whatever the
    # import path.
    REAPER = """if True:
        import os, shutil, sys
        import psutil
        spare = {os.getpid(), os.getppid()}  # the driver may still hold a log open after ray.shutdown
        sys.stdin.buffer.read()  # returns when the driver closes the pipe or dies
        session = os.path.join(sys.argv[1], "")
        for p in psutil.process_iter():
            try:
                if p.pid not in spare and any(f.path.startswith(session) for f in p.open_files()):
                    p.kill()
            except (psutil.Error, OSError):  # gone, or not ours to read
                pass
        shutil.rmtree(sys.argv[1], ignore_errors=True)
    """

    def __init__(self, directory: str):
        import subprocess
        import sys

        self.dir = directory
        # not in the terminal's process group: Ctrl-C
        self.reaper = subprocess.Popen(
            [sys.executable, "-c", self.REAPER, directory],
            stdin=subprocess.PIPE,
            start_new_session=True,
        )

    def stop(self) -> None:
        """Shut Ray down, then let the reaper check that nothing of the session is left."""
        import ray

        if ray.is_initialized():
            ray.shutdown()
        self.reaper.stdin.close()
        self.reaper.wait(timeout=60)
