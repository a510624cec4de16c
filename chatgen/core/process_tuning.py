"""The process tuning of chatgen's processes, in one place: the allocator (`chatgen train` on
jemalloc with CHATGEN_MALLOC=jemalloc), glibc's malloc arenas (`chatgen train`), the OpenMP team of
`chatgen serve`'s engine, and passive OpenMP waiting (the CLI's process and every Ray actor).

Each is decided before torch (and its OpenMP runtime) loads: chatgen.cli's `main` applies them to
its own process, chatgen.rlhf.ray_cluster.worker_env passes PASSIVE_OPENMP to the actors. The
measurements behind each are in their docstrings.
"""

import ctypes
import importlib.util
import os
import sys

from chatgen.core.checkpoint_io import read_hf_config

M_ARENA_MAX = -8  # glibc's mallopt parameter number (malloc.h)
# Idle OpenMP threads sleep instead of spinning. On shared CPU cores (vLLM and Megatron in one
# process, or several processes) spinning made the tiny model's steps 3-10x slower (measured).
# Export OMP_WAIT_POLICY=ACTIVE to opt out. Inside `chatgen train` the trainer's thread and the
# engine thread each have a team, more threads than cores: libgomp then spins at most 1000
# iterations whatever GOMP_SPINCOUNT says, and ACTIVE's 1000 measured no faster than this
# (SmolLM2, docs/long_context.md, "What is left of SmolLM2's episode").
PASSIVE_OPENMP = {"OMP_WAIT_POLICY": "PASSIVE"}


def one_malloc_arena() -> bool:
    """Every thread of this process allocates from glibc's one main arena (`mallopt(M_ARENA_MAX,
    1)`, what MALLOC_ARENA_MAX=1 does), unless the environment already chose (MALLOC_ARENA_MAX or
    a glibc.malloc.arena_max tunable). glibc gives each allocating thread an arena of its own (up
    to 8 per core) and an arena keeps the memory its thread freed: the trainer's activations
    stayed resident in the main thread's arena while the engine thread's arena kept the
    generation's, ~110 + ~40 MiB held twice. With one arena they reuse the same free memory: the
    tiny GRPO run's peak 1.12-1.13 -> 1.06-1.07 GiB, episodes as fast (alternating runs, see
    docs/rlhf_engine.md). `chatgen train` only: `chatgen serve`, whose HTTP and engine threads
    allocate at once, served 0.55-0.69x vLLM's server with it against 0.72-0.81x without
    (benchmarks/bench_server.py, 3 rounds). Returns whether the limit was set (False off glibc)."""
    if "MALLOC_ARENA_MAX" in os.environ or "glibc.malloc.arena_max" in os.environ.get(
        "GLIBC_TUNABLES", ""
    ):
        return False
    try:
        return ctypes.CDLL(None).mallopt(M_ARENA_MAX, 1) == 1
    except (OSError, AttributeError):  # not glibc (musl, macOS): no arenas of this kind
        return False


MALLOC_CHOICE = "CHATGEN_MALLOC"  # jemalloc: `chatgen train` restarts itself on jemalloc


def jemalloc_library() -> str | None:
    """The jemalloc that Ray's wheel ships (ray/core/libjemalloc.so; Ray is a dependency), found
    without importing Ray; None where it is not installed."""
    try:
        spec = importlib.util.find_spec("ray")
    except (ImportError, ValueError):
        return None
    for root in (spec and spec.submodule_search_locations) or ():
        path = os.path.join(root, "core", "libjemalloc.so")
        if os.path.isfile(path):
            return path
    return None


def restart_on_jemalloc(argv: list) -> None:
    """With CHATGEN_MALLOC=jemalloc, replace this process (same pid, same arguments) by one with
    jemalloc preloaded, unless LD_PRELOAD is already set (a user's allocator, or this restart
    done) or no jemalloc is found. For `chatgen train` run as a command, before anything heavy
    loads. A trade, so a choice: jemalloc hands freed pages back, and the tiny GRPO run's peak
    RSS stays flat (0.94 GiB over 60 episodes against 1.03-1.05 on glibc's one arena, which keeps
    the train step's freed memory as fragments and grows), but its train steps fault those pages
    in again: train 0.31 vs 0.25 s per episode (docs/rlhf_engine.md)."""
    if os.environ.get(MALLOC_CHOICE) != "jemalloc" or os.environ.get("LD_PRELOAD"):
        return
    library = jemalloc_library()
    if library is None:
        return
    env = dict(os.environ, LD_PRELOAD=library)
    os.execve(sys.executable, [sys.executable, "-m", "chatgen.cli", *argv], env)


# Measured on a 2-core box against vLLM's api_server (bench_server; docs/serving.md, Benchmarks):
# the tiny Llama (hidden size 128) served at 0.66x its throughput with both cores in the engine's
# OpenMP team and 0.97x with one; SmolLM2 (hidden 576) at 1.22x with both and 0.985x with one. Below
# this width a step is too small to split.
WIDE_HIDDEN_SIZE = 512


def serve_threads(argv: list) -> int:
    """OpenMP threads for the engine of `chatgen serve --model DIR`: every core for a model of
    hidden size >= WIDE_HIDDEN_SIZE; one fewer for a narrower one, whose kernels spend a second
    thread's time waiting at their barriers (py-spy: 27% of the engine thread in the attention
    kernel with two threads, 1.8% with one); that core is left to the HTTP side, as vLLM's server
    leaves one to its own. Decided before torch loads, through OMP_NUM_THREADS: a later
    torch.set_num_threads reaches only the calling thread, and vLLM's CPU attention refuses a
    step planned for another thread count."""
    model = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--model"), None)
    model = next((a.partition("=")[2] for a in argv if a.startswith("--model=")), model)
    try:
        hidden = read_hf_config(model, "--model").get("hidden_size", 0) if model else 0
    except (OSError, ValueError):  # serve names the problem itself
        hidden = 0
    cores = len(os.sched_getaffinity(0))
    return cores if hidden >= WIDE_HIDDEN_SIZE else max(1, cores - 1)


def resident_bytes() -> int:
    """This process's resident set size (Linux /proc; 0 where there is none)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


# Allocators that, preloaded, take malloc over from glibc (and hand pages back themselves)
PRELOADED_ALLOCATORS = ("libjemalloc", "libtcmalloc", "libmimalloc")


def glibc_malloc_trim():
    """glibc's `malloc_trim` when glibc's malloc serves this process, else None (another libc, or a
    preloaded allocator whose pages glibc does not hold). Which allocator is in use is read from the
    libraries mapped into the process, not from LD_PRELOAD: vLLM's CPU platform rewrites that
    variable (libgomp, for its children) once an engine starts, so it no longer says what this
    process was started with."""
    try:
        with open("/proc/self/maps") as maps:
            if any(name in line for line in maps for name in PRELOADED_ALLOCATORS):
                return None
    except OSError:  # no /proc: fall back to what the environment says
        if os.environ.get("LD_PRELOAD"):
            return None
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


class HeapBound:
    """Keeps glibc's heap from growing without bound over a long run. glibc's one arena keeps
    what a train step freed as free chunks, and fragments of them, so the RSS at the end of an
    episode creeps up (the tiny GRPO run, before triton left the venv: 932 MiB after the first
    episode, 1013 after the sixth, a 1.05 GiB peak by the 60th). `check()` at the end of an
    episode hands the free pages back (malloc_trim) once the RSS is more than `slack` above the
    first episode's end. Not every episode: the memory an episode frees is what the next one
    takes again, and after a trim it takes it as fresh pages (page faults): trimming every other
    episode made those episodes 0.14-0.16 s (~20%) slower than the others of the same run (2 runs
    of 40 episodes, load 16-30), for a peak only ~22 MiB lower over 30 episodes (902 against 924
    MiB). So the bound is wide: it stops the creep of a long run, not the per-episode swing
    (docs/rlhf_engine.md). A no-op off glibc, or with a preloaded allocator
    (CHATGEN_MALLOC=jemalloc hands pages back itself)."""

    def __init__(self, slack: int = 128 << 20):
        self.slack, self.reference, self.trims = slack, None, 0
        self._trim = glibc_malloc_trim()

    def check(self) -> bool:
        """Trim the heap if it grew past the bound; returns whether it did."""
        if self._trim is None or not (rss := resident_bytes()):
            return False
        if self.reference is None:
            self.reference = rss
            return False
        if rss <= self.reference + self.slack:
            return False
        self._trim(0)
        self.trims += 1
        return True


def exit_without_teardown(code: int) -> None:
    """End this process, a `chatgen` command that has finished, without the interpreter's
    teardown; returns (and the caller exits as usual) while a non-daemon thread still runs, which
    Python's exit would wait for.

    At exit CPython collects and frees every object the command's imports and models made
    (vLLM's, Megatron's, torch's): 2.6-3.3 s after the tiny GRPO run's summary (py-spy: the final
    garbage collections), ~6% of its wall time, spent on memory the kernel reclaims anyway. What
    the teardown would do that matters is done here: the atexit handlers (logging, Ray,
    multiprocessing children, weakref finalizers, temporary directories), every open Python file
    flushed (a module's log file that is never closed keeps its last lines), C stdio flushed;
    then os._exit. Python's file objects are found by walking the heap (1.2M objects after the
    tiny GRPO run: ~0.3-0.6 s), so only when the process still has a file open for writing
    besides its standard streams (`open_written_files`); the standard streams are flushed
    directly."""
    import atexit
    import gc
    import io
    import threading

    if any(
        t.is_alive() and not t.daemon
        for t in threading.enumerate()
        if t is not threading.main_thread()
    ):
        return
    atexit._run_exitfuncs()
    streams = [sys.stdout, sys.stderr]
    if open_written_files() is not False:
        gc.unfreeze()  # the objects frozen at startup (chatgen.module.startup_gc) too
        files = (io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom)
        streams += [f for f in gc.get_objects() if type(f) in files]
    for f in streams:
        try:
            f.flush()
        except (OSError, ValueError, AttributeError):  # closed, detached, a reader gone, None
            pass
    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):
        pass
    os._exit(code)


def open_written_files() -> bool | None:
    """Whether this process has a regular file open for writing on a descriptor above 2 (what a
    Python file object left unflushed can lose at os._exit); None where /proc/self/fd is not there
    (not Linux): the caller assumes there may be."""
    import fcntl
    import stat

    try:
        fds = [int(fd) for fd in os.listdir("/proc/self/fd")]
    except OSError:
        return None
    for fd in fds:
        if fd <= 2:
            continue
        try:
            writable = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDONLY
            if writable and stat.S_ISREG(os.fstat(fd).st_mode):
                return True
        except OSError:  # the listing's own descriptor, closed by now
            continue
    return False


def own_cores(first: int, count: int, allowed: set) -> set | None:
    """The cores of an engine apart on a node: the node's engines take its `allowed` cores in
    order, `count` apiece (their OpenMP threads), this one from index `first`; None when the node
    has too few left: then the engine floats. Two tiny-model engines that floated on the same 2
    cores served their sessions no faster than one (benchmarks/bench_agentic.py)."""
    cores = sorted(allowed)
    if count < 1 or first + count > len(cores):
        return None
    return set(cores[first : first + count])


def pin_process(cores: set) -> None:
    """Every thread of this process on `cores`, and the threads it starts later (a thread
    inherits its creator's mask): os.sched_setaffinity sets one thread's (Linux), and a Ray
    actor has started its own threads before its constructor runs."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass
