"""`chatgen train`: run the RLHF job of a main YAML (GRPO or PPO, per runtime.algorithm.name).

    chatgen train configs/grpo_tiny.yaml                         # fresh run into runtime.output_dir
    chatgen train configs/grpo_tiny.yaml runtime.num_episode=5 policy.n=4
    chatgen train configs/grpo_tiny.yaml --resume                # continue from the latest checkpoint

The whole config is loaded and checked before Ray or any actor starts, so a bad YAML fails in a second with
every problem listed. Ctrl-C or a failing actor stops every actor; checkpoints already written stay intact.
"""
import importlib
import sys

from chatgen.config import ConfigError, load_config

# runtime.algorithm.name -> the module whose `train(cfg, resume)` runs it (add a new algorithm here and to
# AlgorithmConfig.name in chatgen/config/schema.py; docs/extending.md walks through it)
ALGORITHMS = {"grpo": "chatgen.rlhf.grpo", "ppo": "chatgen.rlhf.ppo"}


def add_arguments(parser) -> None:
    parser.add_argument("config", help="main YAML (runtime: + models:)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="overrides, e.g. runtime.num_episode=3 policy.temperature=1.0")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the latest checkpoint in <output_dir>/checkpoints")


def run(args) -> int:
    from chatgen.rlhf.engine import check_config

    try:
        cfg = load_config(args.config, args.overrides)
        check_config(cfg)
    except ConfigError as e:
        print(f"chatgen train: {e}", file=sys.stderr)
        return 2
    from chatgen.rlhf.runtime import ActorFailure  # imports Ray: only once the config is known to be good

    train = importlib.import_module(ALGORITHMS[cfg.runtime.algorithm.name]).train
    try:
        train(cfg, resume=args.resume)
    except ActorFailure as e:
        print(f"chatgen train: stopped: {e}", file=sys.stderr)
        return 1
    except FileExistsError as e:
        print(f"chatgen train: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("chatgen train: interrupted; actors stopped, checkpoints kept", file=sys.stderr)
        return 130
    return 0
