"""`chatgen generate`: batch generation from a JSONL file through the step-driven VLLMModule.

    chatgen generate --model outputs/tiny-llama --input prompts.jsonl --output out.jsonl --max-new-tokens 32
    chatgen generate --model DIR --input IN.jsonl --output OUT.jsonl --n 4 --temperature 0.8 top_p=0.9
    chatgen generate --module my_models:MyPolicy --config my_policy.yaml --config-dialect chatlearn \
        --model DIR --input IN.jsonl --output OUT.jsonl        # your VLLMModule subclass and its YAML

Input lines: {"prompt_ids": [1, 52, ...]} or {"prompt": "text"} (needs a tokenizer in the model
directory). Output: one line per sample (n per input line, in input order): {"index": input line,
"sample": 0..n-1, "prompt_ids", "output_ids" (generated tokens only), "logprobs" (one per generated
token), "finish_reason", "text" (when the model has a tokenizer)}. Trailing `key=value` arguments
set any per-model key (docs/generation_keys.md); --config starts from a per-model YAML.

With --module, text prompts go through the class's `build_dataset` (and its dataset's collate_fn, if
any) and the output is what its `decode_internal` returns: a RolloutBatch as above, or a dict of
per-sample values (a ChatLearn module's {"all_tokens": (S, L), "str_outputs": [...], ...}), one line
per sample with each key's entry for that sample.

The output path is checked before the model loads (its directory writable, not the input file, not
an existing file unless --overwrite) and written atomically (a killed run leaves the old file or
none, never half of one). A model that yields NaN or inf log-probs (weights diverged) is an error
(exit 1), with no output written.
"""

import json
import math
import os
import sys
from pathlib import Path

from chatgen.cli import heartbeat, positive_int
from chatgen.compat.chatlearn import dialect
from chatgen.config import load_model_config
from chatgen.core import quiet
from chatgen.core.checkpoint_io import atomic_file, read_hf_config
from chatgen.core.imports import import_class
from chatgen.core.jsonl import is_token_ids, read_records
from chatgen.core.rollout import RolloutBatch
from chatgen.generation.config import check_prompt_ids
from chatgen.rlhf.config import format_config
from chatgen.rlhf.metrics import progress_bar, say

FLAGS = {"max_new_tokens": int, "temperature": float, "n": int, "seed": int}


def add_module_arguments(parser) -> None:
    """The flags that say which VLLMModule to build and from what (`chatgen generate` and
    `chatgen serve`)."""
    parser.add_argument(
        "--model",
        required=True,
        help="Hugging Face model directory or chatgen Megatron checkpoint (the `load` key)",
    )
    parser.add_argument(
        "--config", help="per-model YAML to start from (default: the VLLMConfig defaults)"
    )
    parser.add_argument(
        "--module",
        metavar="PKG.MOD:CLASS",
        help="your VLLMModule subclass (importable from the current directory); default VLLMModule",
    )
    parser.add_argument(
        "--config-dialect",
        choices=["chatgen", "chatlearn"],
        default="chatgen",
        help="how --config is read: chatlearn reads a ChatLearn per-model YAML (its ${VAR} rules, "
        "its Megatron-LM keys ignored; docs/configuration.md)",
    )


def build_module(args, overrides=()):
    """The (not yet started) VLLMModule of `add_module_arguments`' flags; `overrides`: key=value
    strings from the command's own flags, before the trailing key=value arguments. Prints the
    resolved config to stderr with -v."""
    # imports vLLM: not for `chatgen generate --help`
    from chatgen.generation.vllm.module import (
        VLLMModule,
    )

    cls = import_class(args.module) if args.module else VLLMModule
    if not (isinstance(cls, type) and issubclass(cls, VLLMModule)):
        raise ValueError(f"--module {args.module}: {cls!r} is not a subclass of chatgen.VLLMModule")
    config = load_model_config(
        args.config,
        cls.config_class,
        [f"load={args.model}", *overrides, *args.overrides],
        extra_check=cls.config_problems,
        dialect=dialect(args.config_dialect),
    )
    if quiet.verbose():
        print(format_config(config), file=sys.stderr)
    return cls(config)


def require_tokenizer(module, model, why: str) -> None:
    """Before the engine starts: the tokenizer of `module`'s config (its `tokenizer` key, else
    the --model directory) exists, else a ValueError naming `tokenizer=`; `why` says what needs
    it."""
    from chatgen.generation.config import has_tokenizer, tokenizer_dir

    if not has_tokenizer(tokenizer_dir(module.config, model)):
        raise ValueError(
            f"--model {model} holds no tokenizer (tokenizer.json, tokenizer.model or "
            f"tokenizer_config.json), which {why}; add tokenizer=DIR (the HF model "
            "directory it was trained from) to the command line, or convert it with "
            "`chatgen convert --to hf --tokenizer DIR`"
        )


def add_arguments(parser) -> None:
    add_module_arguments(parser)
    parser.add_argument(
        "--input", required=True, help="JSONL of {\"prompt_ids\": [...]} or {\"prompt\": \"...\"}"
    )
    parser.add_argument("--output", required=True, help="JSONL to write, one line per sample")
    parser.add_argument("--overwrite", action="store_true", help="replace --output if it exists")
    parser.add_argument(
        "--max-new-tokens",
        type=positive_int,
        help="tokens per response (sets new_token_limit=true)",
    )
    parser.add_argument("--temperature", type=float, help="sampling temperature; 0 = greedy")
    parser.add_argument("--n", type=positive_int, help="samples per prompt")
    parser.add_argument("--seed", type=int, help="sampling seed")
    parser.add_argument(
        "overrides", nargs="*", metavar="key=value", help="any per-model key, e.g. top_p=0.9"
    )


def read_prompts(path, vocab_size: int) -> list:
    """The JSONL input as [(prompt_ids or None, prompt text or None)], or a ValueError naming the
    bad line."""

    def problem(record):
        if "prompt_ids" not in record and not isinstance(record.get("prompt"), str):
            return 'needs "prompt_ids" (list of ints) or "prompt" (string)'
        if "prompt_ids" in record and not is_token_ids(record["prompt_ids"]):
            return '"prompt_ids" must be a non-empty list of ints'
        if "prompt_ids" in record:
            try:
                check_prompt_ids(record["prompt_ids"], vocab_size, '"prompt_ids"')
            except ValueError as e:
                return str(e)
        return None

    return [(r.get("prompt_ids"), r.get("prompt")) for r in read_records(path, problem, "prompts")]


def check_output(output, input_path, overwrite: bool) -> None:
    """Before any work: --output can be written, is not --input, and replaces nothing unless
    --overwrite."""
    out = Path(output)
    if out.exists() and Path(input_path).exists() and out.samefile(input_path):
        raise ValueError(
            f"--output {output} is the --input file; write the samples to another file"
        )
    if out.is_dir():
        raise ValueError(f"--output {output} is a directory; give a file name")
    if out.exists() and not overwrite:
        raise ValueError(
            f"--output {output} exists; pass --overwrite to replace it, or choose another file"
        )
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OSError(
            f"--output {output}: cannot create its directory {out.parent} ({e.strerror})"
        ) from None
    if not os.access(out.parent, os.W_OK):
        raise PermissionError(
            f"--output {output}: cannot write in {out.parent}; choose a writable directory"
        )


def run(args) -> int:
    # Bad input raises ValueError / ConfigError / OSError: chatgen.cli prints it without a
    # traceback.
    hf_config = read_hf_config(args.model, "--model")
    check_output(args.output, args.input, args.overwrite)
    rows = read_prompts(args.input, hf_config["vocab_size"])
    overrides = [f"{key}={getattr(args, key)}" for key in FLAGS if getattr(args, key) is not None]
    if args.max_new_tokens is not None:
        overrides.append("new_token_limit=true")
    module = build_module(args, overrides)
    text_prompts = [text for ids, text in rows if ids is None]
    if text_prompts:
        need = f'the {len(text_prompts)} "prompt" lines of --input need'
        require_tokenizer(module, args.model, need)
    with heartbeat(f"starting the engine for {args.model}"):
        module.start()
    # one call: one count of cut prompts
    prepared = module.prepare_dataset(text_prompts) if text_prompts else []
    # all text: the module's dataset as it built it (it may repeat prompts)
    if len(text_prompts) == len(rows):
        items = prepared
    elif len(prepared) != len(text_prompts):
        raise ValueError(
            f"--input {args.input}: {type(module).__name__}.build_dataset made {len(prepared)} items of "
            f"{len(text_prompts)} text prompts; mixing prompt_ids lines with text lines needs one item "
            "per prompt (give all lines as text, or all as prompt_ids)"
        )
    else:
        texts = iter(prepared)
        items = [
            {"input_ids": ids, "prompt": text} if ids is not None else next(texts)
            for ids, text in rows
        ]
    done = []  # finished prompts (a disabled bar counts none)
    with progress_bar(
        len(items), "prompt"
    ) as bar:  # a live line on a terminal, else a line per 20%

        def on_finished(output):
            done.append(output.request_id)
            bar.update(1)
            if bar.disable and len(done) % max(1, len(items) // 5) == 0:
                say(f"prompt {len(done)}/{len(items)} done")

        module.on_finished = on_finished
        out = module.run_generation(items)  # the class's decode_internal: a RolloutBatch by default
    module.shutdown()
    if not isinstance(out, RolloutBatch):
        records = [json.dumps(record) + "\n" for record in _sample_records(out, args.module)]
    else:
        records = []
        for s in range(len(out)):
            p, r = int(out.prompt_lengths[s]), int(out.response_lengths[s])
            index = int(out.prompt_index[s])
            record = {
                "index": index,
                "sample": s - int((out.prompt_index == index).nonzero()[0]),
                "prompt_ids": out.input_ids[s, :p].tolist(),
                "output_ids": out.input_ids[s, p : p + r].tolist(),
                "logprobs": out.infer_logprobs[s, p - 1 : p - 1 + r].tolist(),
                "finish_reason": out.finish_reasons[s],
            }
            if module.tokenizer is not None:
                record["text"] = out.texts[s]
            if not all(map(math.isfinite, record["logprobs"])):
                print(
                    f"chatgen generate: input line {index + 1}: the model gave NaN or inf log-probs; its weights are "
                    f"not finite (a diverged training run?): check {args.model}. Nothing was written.",
                    file=sys.stderr,
                )
                return 1
            records.append(json.dumps(record) + "\n")
    with atomic_file(args.output) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.writelines(records)
    m = module.metrics
    print(
        f"wrote {m['samples']} samples to {args.output}: {m['generation_tokens']} tokens in "
        f"{m['engine_steps']} engine steps, {m['generation_tokens_per_s']:.1f} generated tokens/s, "
        f"peak KV-cache use {100 * m['kv_cache_usage_peak']:.1f}%",
        file=sys.stderr,
    )
    return 0


def _sample_records(out, module_name) -> list:
    """One JSON-ready dict per sample of a decode_internal output that is a dict of per-sample
    values (lists, or tensors whose first dimension is the sample)."""
    if not isinstance(out, dict) or not out:
        raise TypeError(
            f"--module {module_name}: decode_internal returned {type(out).__name__}; `chatgen generate` "
            "writes a RolloutBatch or a dict of per-sample values (lists or tensors of equal length)"
        )
    lengths = {
        key: len(value)
        for key, value in out.items()
        if hasattr(value, "__len__") and not isinstance(value, str)
    }
    sizes = set(lengths.values())
    if len(sizes) != 1:
        raise ValueError(
            f"--module {module_name}: decode_internal's values have different lengths {lengths}; "
            "each must hold one entry per sample"
        )
    rows = []
    for s in range(sizes.pop()):
        record = {"index": s}
        for key in lengths:
            value = out[key][s]
            record[key] = value.tolist() if hasattr(value, "tolist") else value
        rows.append(record)
    return rows
