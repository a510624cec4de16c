"""A local sandbox for code that a model wrote: the `python` tool and the `code_exec` reward run it
here.

    result = run_python("print(1 + 1)", Limits(wall_s=5))
    result.ok, result.stdout, result.error      # True, "2\\n", None
    result.observation()                         # the text an episode shows the model

Each run gets a fresh scratch directory (the only writable place, the working directory, deleted
afterwards) and these limits (`Limits`): wall time, CPU time, address space, process count, bytes of
output, file size. At a limit the whole process tree is killed and the result says which limit
(`error`), never raises: a model's code failing is an observation, not a crash of the run.

Isolation, strongest available first (`isolation`):
- "bwrap" (bubblewrap; `apt-get install bubblewrap`, scripts/setup_env.sh installs it where it runs
  as root with apt): new user, PID, network, IPC and UTS namespaces, so no network at all (only a
  loopback of its own), no view of other processes, the host filesystem mounted read-only, a new
  /dev and /proc, an empty environment; the scratch directory is the one writable mount. The PID
  namespace dies with its first process, so killing bwrap kills every process the code started.
- "fallback" (no bwrap): rlimits, a new session (the process group is killed at the end), and a new
  network namespace by `unshare --net` where this process may create one (root). It does NOT stop:
  reads and writes anywhere the user running it may write (the working directory is scratch, but an
  absolute path escapes it), network access where `unshare` is not permitted, a process that leaves
  the session (`setsid`) surviving the group kill, and seeing the host's processes.
In both, when chatgen runs as root each run gets a user id of its own (an unused one, 200000 and
up), so the process-count limit counts only that run's processes and runs cannot signal each other;
as another user the limit counts that user's processes too (it is raised by what the user runs).
"""

import dataclasses
import itertools
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time

RUN_UIDS = 200000  # the first user id of runs when chatgen is root (one per run, cycling)
_run_ids = itertools.count()


@dataclasses.dataclass
class Limits:
    """What one run may use. Each limit kills the whole run when reached."""

    wall_s: float = 10.0  # seconds of real time
    cpu_s: int = 10  # seconds of CPU time, per process (RLIMIT_CPU)
    memory_mb: int = 1024  # address space per process (RLIMIT_AS)
    processes: int = 32  # processes and threads of the sandbox's user (RLIMIT_NPROC)
    output_bytes: int = 64 << 10  # stdout + stderr
    file_mb: int = 64  # largest file it may write (RLIMIT_FSIZE)


@dataclasses.dataclass
class Result:
    returncode: int | None  # None: killed by the sandbox at a limit
    stdout: str
    stderr: str
    error: str | None  # which limit was hit, or why the code failed; None: exit 0
    isolation: str  # "bwrap" or "fallback"
    seconds: float

    @property
    def ok(self) -> bool:
        return self.error is None

    def observation(self, max_chars: int = 2000) -> str:
        """The text a tool turn shows the model: its output, or the error and what it wrote."""
        text = self.stdout if self.ok else f"error: {self.error}\n{self.stdout}{self.stderr}"
        return text if len(text) <= max_chars else text[:max_chars] + "\n[output cut]"


def isolation() -> str:
    """The isolation runs get on this machine: 'bwrap' when bubblewrap works here, else
    'fallback'."""
    global _ISOLATION
    if _ISOLATION is None:
        ok = shutil.which("bwrap") is not None
        if ok:
            probe = subprocess.run(  # as the user runs get (root's runs are not root)
                _as_user(
                    ["bwrap", "--ro-bind", "/", "/", "--unshare-all", "--", "true"],
                    RUN_UIDS if os.geteuid() == 0 else None,
                ),
                capture_output=True,
                timeout=30,
            )
            ok = probe.returncode == 0
        _ISOLATION = "bwrap" if ok else "fallback"
    return _ISOLATION


_ISOLATION = None


def run_python(code: str, limits: Limits | None = None, mode: str | None = None) -> Result:
    """`code` run by a Python interpreter (-I: no user site, no PYTHON* variables) in the
    sandbox: this one, or the system's python3 when the sandbox's user (not root) cannot reach
    this one."""
    return run([python_executable(), "-I", "-c", code], limits, mode)


def python_executable() -> str:
    path = os.path.realpath(sys.executable)
    if os.geteuid() != 0 or _world_reachable(path):
        return sys.executable
    return shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin") or sys.executable


def _world_reachable(path: str) -> bool:
    """Whether every directory above `path` may be entered, and `path` run, by any user."""
    parts = path.split(os.sep)
    for k in range(2, len(parts) + 1):
        if not os.stat(os.sep.join(parts[:k]) or os.sep).st_mode & 0o001:
            return False
    return True


def run(argv: list, limits: Limits | None = None, mode: str | None = None) -> Result:
    """`argv` run in the sandbox (mode: 'bwrap' or 'fallback'; None: the best this machine has)."""
    limits = limits or Limits()
    mode = mode or isolation()
    if mode not in ("bwrap", "fallback"):
        raise ValueError(f"sandbox isolation {mode!r}: use 'bwrap' or 'fallback'")
    scratch = tempfile.mkdtemp(prefix="chatgen-sandbox-")
    try:
        uid = None
        if os.geteuid() == 0:  # root is exempt from RLIMIT_NPROC: the run gets a user of its own
            uid = RUN_UIDS + (os.getpid() * 1024 + next(_run_ids)) % 800000
            os.chown(scratch, uid, uid)
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": scratch, "TMPDIR": scratch}
        env.update(LANG="C.UTF-8", PYTHONDONTWRITEBYTECODE="1")
        if mode == "bwrap":
            command = _bwrap(argv, scratch, env)
        else:
            command = _unshare_net(uid) + list(argv)
        start = time.monotonic()
        # limits and the user by util-linux's setpriv / prlimit, not a preexec_fn: Python code in
        # the fork of a many-threaded process (the run's trainers, engines) can crash there
        proc = subprocess.Popen(
            _limited(command, limits, uid, mode),
            cwd=scratch,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        out, err, error = _collect(proc, limits, start, mode)
        returncode = proc.returncode
        if (
            mode == "bwrap" and 128 < returncode < 160
        ):  # bwrap's exit for a child killed by a signal
            returncode = 128 - returncode
        if error is None and returncode != 0:
            error = _exit_error(returncode, limits)
        if error is not None and error.startswith("killed"):
            returncode = None
        return Result(
            returncode,
            out.decode("utf-8", "replace"),
            err.decode("utf-8", "replace"),
            error,
            mode,
            time.monotonic() - start,
        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _bwrap(argv: list, scratch: str, env: dict) -> list:
    command = ["bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"]
    command += ["--bind", scratch, scratch, "--chdir", scratch, "--unshare-all"]
    command += ["--die-with-parent", "--new-session", "--clearenv"]
    for key, value in env.items():
        command += ["--setenv", key, value]
    return command + ["--", *argv]


def _unshare_net(uid: int | None) -> list:
    """`unshare --user --net` where the sandbox's user may make namespaces, else nothing."""
    global _UNSHARE
    if _UNSHARE is None:
        prefix = ["unshare", "--user", "--net"]
        ok = shutil.which("unshare") and (
            subprocess.run(_as_user([*prefix, "true"], uid), capture_output=True).returncode == 0
        )
        _UNSHARE = prefix if ok else []
    return _UNSHARE


_UNSHARE = None


def _limited(command: list, limits: Limits, uid: int | None, mode: str) -> list:
    """`command` run as the run's own user (as root) under the rlimits: setpriv, then prlimit."""
    mb = 1 << 20
    processes = limits.processes + (3 if mode == "bwrap" else 0)  # bwrap, its init
    if uid is None:  # the count is the user's: leave room for what it already runs
        processes += sum(1 for p in os.listdir("/proc") if p.isdigit())
    limited = [
        "prlimit",
        f"--cpu={limits.cpu_s}:{limits.cpu_s + 1}",
        f"--as={limits.memory_mb * mb}",
        f"--fsize={limits.file_mb * mb}",
        "--core=0",
        f"--nproc={processes}",
        "--",
    ]
    return _as_user(limited + list(command), uid)


def _as_user(command: list, uid: int | None) -> list:
    """`command` as user and group `uid` with no supplementary groups (None: as this process)."""
    if uid is None:
        return list(command)
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--", *command]


def _collect(proc, limits: Limits, start: float, mode: str) -> tuple:
    """(stdout, stderr, error): the outputs read until exit, the wall limit or the output limit;
    at a limit the session's processes are killed."""
    chunks = {proc.stdout: [], proc.stderr: []}
    total, error = 0, None
    selector = selectors.DefaultSelector()
    for stream in chunks:
        selector.register(stream, selectors.EVENT_READ)
    try:
        while selector.get_map():
            left = start + limits.wall_s - time.monotonic()
            if left <= 0:
                error = f"killed at the wall-time limit ({limits.wall_s:g} s)"
                break
            for key, _ in selector.select(timeout=min(left, 0.5)):
                data = os.read(key.fileobj.fileno(), 65536)
                if not data:
                    selector.unregister(key.fileobj)
                    continue
                chunks[key.fileobj].append(data)
                total += len(data)
                if total > limits.output_bytes:
                    error = f"killed at the output limit ({limits.output_bytes} bytes)"
                    break
            if error:
                break
    finally:
        selector.close()
        if error:
            _kill(proc, mode)
        try:
            proc.wait(timeout=max(0.1, start + limits.wall_s - time.monotonic()))
        except subprocess.TimeoutExpired:
            error = error or f"killed at the wall-time limit ({limits.wall_s:g} s)"
        _kill(proc, mode)  # whatever of the session is left (a daemonized child), and reap
        proc.stdout.close()
        proc.stderr.close()
    out, err = b"".join(chunks[proc.stdout]), b"".join(chunks[proc.stderr])
    return out[: limits.output_bytes], err[: limits.output_bytes], error


def _kill(proc, mode: str) -> None:
    """Every process of the run gone before this returns: `proc`'s children first (bwrap's
    PID-namespace init: the kernel kills the namespace with it, and bwrap exits once it reaped it),
    then the session. In the fallback `proc` is the program itself, which nothing of that ends: no
    wait for it."""
    for pid in _children(proc.pid):
        _signal(pid)
    if mode == "bwrap":
        try:
            proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            pass
    _signal(proc.pid, group=True)
    proc.wait()
    deadline = time.monotonic() + 5
    while _group_members(proc.pid) and time.monotonic() < deadline:  # killed, not yet reaped
        _signal(proc.pid, group=True)
        time.sleep(0.02)


def _signal(pid: int, group: bool = False) -> None:
    try:
        (os.killpg if group else os.kill)(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _children(pid: int) -> list:
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    found = []
    for tid in tasks:
        try:
            found += map(int, open(f"/proc/{pid}/task/{tid}/children").read().split())
        except OSError:
            pass
    return found


def _group_members(pgid: int) -> list:
    """Live processes in process group `pgid` (zombies excluded: they hold nothing)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = open(f"/proc/{pid}/stat").read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] != "Z" and int(fields[2]) == pgid:
            found.append(int(pid))
    return found


def _exit_error(returncode: int, limits: Limits) -> str:
    if returncode < 0:
        name = signal.Signals(-returncode).name
        why = {
            "SIGXCPU": f"the CPU-time limit ({limits.cpu_s} s)",
            "SIGKILL": "a limit (CPU time, memory or processes)",
            "SIGXFSZ": f"the file-size limit ({limits.file_mb} MB)",
        }.get(name, name)
        return f"killed by {why}"
    return f"exit status {returncode}"
