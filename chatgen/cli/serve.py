"""`chatgen serve`: an OpenAI-compatible HTTP server over a step-driven VLLMModule.

    chatgen serve --model outputs/tiny-llama                       # http://127.0.0.1:8000/v1
    chatgen serve --model DIR --config configs/models/tiny_llama.yaml --port 8001 --api-key KEY seq_length=512
    chatgen serve --module my_models:MyPolicy --config my_policy.yaml --config-dialect chatlearn --model DIR

Binds to 127.0.0.1 unless --host says otherwise; with --api-key every endpoint needs
`Authorization: Bearer KEY`. --control adds the weight-update endpoints (chatgen/serving/control.py). Trailing
`key=value` arguments set any per-model key (docs/generation_keys.md).
Endpoints and fields: docs/serving.md.
"""
import argparse
import sys

from chatgen.cli import positive_int
from chatgen.cli.generate import add_module_arguments, build_module
from chatgen.core.checkpoint_io import read_hf_config


def port_number(text: str) -> int:
    """argparse type of --port: 0..65535 (0: a free port), else a usage error naming the value."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port: use 1..65535, or 0 for a free one")
    return value


def add_arguments(parser) -> None:
    add_module_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=port_number, default=8000,
                        help="port to listen on (default 8000; 0: a free one)")
    parser.add_argument("--max-request-bytes", type=positive_int, default=None,
                        help="answer 413 to a request body larger than this (default 16 MiB)")
    parser.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every request")
    parser.add_argument("--control", action="store_true",
                        help="add the /control endpoints (pause, resume, weight updates from a trainer, prefix cache "
                             "reset; chatgen/serving/control.py); beyond loopback they need --api-key")
    parser.add_argument("--served-model-name", help="the model name clients send (default: --model as given)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="any per-model key, e.g. seq_length=512")


def run(args) -> int:
    read_hf_config(args.model, "--model")
    import uvicorn  # the server's stack (and vLLM's protocol): not for `chatgen serve --help`

    from chatgen.serving.app import build_app
    from chatgen.serving.control import check_bind, control_router
    from chatgen.serving.embedded import listen

    if args.control:
        check_bind(args.host, args.api_key)  # before the engine starts
    sock = listen(args.host, args.port)  # a port in use is an error before the engine loads
    module = build_module(args).start()
    try:
        routers = [control_router(module, api_key=args.api_key, host=args.host)] if args.control else []
        app = build_app(module, api_key=args.api_key, model_name=args.served_model_name or args.model,
                        routers=routers, max_request_bytes=args.max_request_bytes)
        host = f"[{args.host}]" if ":" in args.host else args.host
        print(f"chatgen serve: http://{host}:{sock.getsockname()[1]}/v1 (model {app.state.model_name!r})",
              file=sys.stderr)
        uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
    finally:
        module.shutdown()
        sock.close()
    return 0
