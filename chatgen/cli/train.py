"""`chatgen train`: run the RLHF job of a main YAML (the algorithm named by runtime.algorithm.name).

    chatgen train configs/grpo_tiny.yaml                         # fresh run into runtime.output_dir
    chatgen train configs/grpo_tiny.yaml runtime.num_episode=5 policy.n=4
    chatgen train configs/grpo_tiny.yaml --resume                # continue from the latest checkpoint
    chatgen train configs/grpo_tiny.yaml --resume-from episode_000020   # from an earlier one (e.g. latest damaged)

The whole config is loaded and checked before Ray or any actor starts, by the function `chatgen
config` runs (chatgen.cli.config.checked_run_config), so a bad YAML fails in seconds with every
problem listed. Ctrl-C or a failing actor stops every actor; checkpoints already written stay
intact.
"""

import sys

from chatgen.cli.config import checked_run_config
from chatgen.config import ConfigError
from chatgen.rlhf.checkpoint import CheckpointError
from chatgen.rlhf.health import RunHealthError
from chatgen.rlhf.metrics import say
from chatgen.rlhf.runtime import ActorFailure


def add_arguments(parser) -> None:
    parser.add_argument("config", help="main YAML (runtime: + models:)")
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="overrides, e.g. runtime.num_episode=3 policy.temperature=1.0",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue from the latest checkpoint in <output_dir>/checkpoints",
    )
    parser.add_argument(
        "--resume-from",
        metavar="CHECKPOINT",
        help="continue from this checkpoint: a directory, or an episode directory name under "
        "<output_dir>/checkpoints (e.g. episode_000020)",
    )


def run(args) -> int:
    try:
        # exactly what `chatgen config` checks
        cfg, algorithm = checked_run_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"chatgen train: {e}", file=sys.stderr)
        return 2
    try:
        # lines above the progress line
        algorithm.train(cfg, resume=args.resume_from or args.resume, log=say)
    except (ActorFailure, RunHealthError, CheckpointError) as e:
        print(f"chatgen train: stopped: {e}", file=sys.stderr)
        return 1
    except FileExistsError as e:
        print(f"chatgen train: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("chatgen train: interrupted; actors stopped, checkpoints kept", file=sys.stderr)
        return 130
    return 0
