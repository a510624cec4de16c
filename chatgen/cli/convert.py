"""`chatgen convert`: HF checkpoint <-> chatgen Megatron checkpoint (chatgen.models.convert).

    chatgen convert --to megatron --input outputs/tiny-llama --output outputs/tiny-llama-tp2pp2 --tp 2 --pp 2
    chatgen convert --to hf --input outputs/tiny-llama-tp2pp2 --output outputs/tiny-llama-back
    chatgen convert --to hf --input outputs/run/checkpoints/episode_000020/policy_trainer --output outputs/ep20-hf
    chatgen convert --to hf --input megatron_lm_run/iter_0001000 --hf-config outputs/tiny-llama --output outputs/x
    chatgen convert --to hf --input old_run/checkpoints/episode_000020/policy_trainer \
        --tokenizer outputs/tiny-llama --output outputs/ep20-hf   # saved without its tokenizer

`--to hf` writes what AutoTokenizer / AutoModelForCausalLM load: the weights, config.json, the
tokenizer, its chat template and generation_config.json (docs/megatron_module.md). A checkpoint
without tokenizer files (chatgen's before 2026-11-27) is refused unless --tokenizer names the HF
directory to take them from (an export without one loads as an empty tokenizer).
"""

from pathlib import Path

from chatgen.cli import positive_int
from chatgen.core.checkpoint_io import read_megatron_meta
from chatgen.generation.config import has_tokenizer
from chatgen.models.convert import hf_to_megatron_dir, megatron_to_hf_dir, side_files_source


def add_arguments(p):
    p.add_argument("--to", required=True, choices=["megatron", "hf"], help="target format")
    p.add_argument(
        "--input", required=True, help="HF directory (--to megatron) or chatgen Megatron checkpoint"
    )
    p.add_argument("--output", required=True, help="directory to write (must not exist)")
    p.add_argument(
        "--tp", type=positive_int, default=1, help="tensor-parallel size of the Megatron checkpoint"
    )
    p.add_argument(
        "--pp",
        type=positive_int,
        default=1,
        help="pipeline-parallel size of the Megatron checkpoint",
    )
    p.add_argument(
        "--make-vocab-size-divisible-by",
        type=positive_int,
        default=128,
        help="pad the vocab to a multiple of this times TP (as MegatronConfig does)",
    )
    p.add_argument(
        "--hf-config",
        help="--to hf from a Megatron-LM distributed checkpoint: the HF model directory "
        "(or its config.json) whose architecture it has",
    )
    p.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="--to hf: the HF directory to take the tokenizer, chat template and generation "
        "config from (default: the checkpoint's own)",
    )


def run(args) -> int:
    if Path(args.output).exists():
        raise FileExistsError(f"--output {args.output} exists; choose a new directory")
    if args.to == "megatron":
        out = hf_to_megatron_dir(
            args.input, args.output, args.tp, args.pp, args.make_vocab_size_divisible_by
        )
        print(f"wrote Megatron checkpoint TP={args.tp} PP={args.pp} to {out}")
    else:
        source = side_files_source(args.input, args.tokenizer, args.hf_config)
        # before the work (an export without a tokenizer loads as an empty one); not a checkpoint at
        # all: the conversion names that problem
        checkpoint = read_megatron_meta(args.input) is not None or args.hf_config
        if checkpoint and not has_tokenizer(source):
            flag = "--tokenizer" if args.tokenizer else "--input"
            raise FileNotFoundError(
                f"{flag} {source} holds no tokenizer (tokenizer.json, tokenizer.model "
                "or tokenizer_config.json); pass --tokenizer DIR, the HF model "
                "directory it was trained from"
            )
        out = megatron_to_hf_dir(
            args.input, args.output, side_files_from=args.tokenizer, hf_config=args.hf_config
        )
        print(f"wrote HF checkpoint to {out}")
    return 0
