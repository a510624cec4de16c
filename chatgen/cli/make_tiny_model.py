"""`chatgen make-tiny-model`: a tiny Llama / Qwen2 / Qwen3 / Qwen3-MoE / Mixtral HF checkpoint with
a locally trained tokenizer (chatgen.models.tiny; docs/tiny_models.md).

    chatgen make-tiny-model --output outputs/tiny-llama
    chatgen make-tiny-model --config configs/models/tiny_qwen3.yaml --output outputs/tiny-qwen3 num_hidden_layers=4
"""

from pathlib import Path

from chatgen.models.tiny import CORPUS, load_spec, make_tiny_model


def add_arguments(parser) -> None:
    parser.add_argument(
        "--config", help="spec YAML (keys of TinyModelSpec); default: built-in tiny Llama"
    )
    parser.add_argument(
        "--family",
        help="model family (HF model_type: llama, qwen2, qwen3, qwen3_moe, mixtral); "
        "sets the spec's `family` over --config",
    )
    parser.add_argument("--output", required=True, help="directory to create (must not exist)")
    parser.add_argument("--corpus", default=str(CORPUS), help="text file to train the tokenizer on")
    parser.add_argument(
        "overrides", nargs="*", metavar="key=value", help="spec overrides, e.g. num_hidden_layers=4"
    )


def run(args) -> int:
    spec = load_spec(
        args.config, ([f"family={args.family}"] if args.family else []) + args.overrides
    )
    out = make_tiny_model(spec, args.output, Path(args.corpus))
    print(
        f"wrote {spec.family} tiny model to {out}: {spec.num_hidden_layers} layers, hidden {spec.hidden_size}, "
        f"vocab {spec.vocab_size} (its spec: {out / 'chatgen_tiny_model.yaml'})"
    )
    return 0
