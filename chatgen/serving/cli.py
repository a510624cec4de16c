"""`chatgen serve`: an OpenAI-compatible HTTP server over a step-driven VLLMModule.

    chatgen serve --model outputs/tiny-llama                       # http://127.0.0.1:8000/v1
    chatgen serve --model DIR --config configs/models/tiny_llama.yaml --port 8001 --api-key KEY seq_length=512

Binds to 127.0.0.1 unless --host says otherwise; with --api-key every endpoint needs
`Authorization: Bearer KEY`. Trailing `key=value` arguments set any per-model key (docs/generation_keys.md).
Endpoints and fields: docs/serving.md.
"""
import functools
import sys
from pathlib import Path


def add_arguments(parser) -> None:
    parser.add_argument("--model", required=True, help="Hugging Face model directory (the `load` key)")
    parser.add_argument("--config", help="per-model YAML to start from (default: the VLLMConfig defaults)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    parser.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every request")
    parser.add_argument("--served-model-name", help="the model name clients send (default: --model as given)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="any per-model key, e.g. seq_length=512")


def run(args) -> int:
    if not (Path(args.model) / "config.json").is_file():
        raise ValueError(f"--model {args.model}: no config.json there; point it at a Hugging Face model directory")
    import uvicorn

    from chatgen.config import VLLMConfig, format_config, load_model_config
    from chatgen.generation import engine_config, vllm_adapter
    from chatgen.generation.vllm_module import VLLMModule
    from chatgen.serving.app import build_app

    platform = functools.partial(engine_config.platform_problems, cpu=vllm_adapter.on_cpu())
    config = load_model_config(args.config, VLLMConfig, [f"load={args.model}", *args.overrides],
                               extra_check=platform)
    print(format_config(config), file=sys.stderr)
    module = VLLMModule(config).start()
    try:
        app = build_app(module, api_key=args.api_key, model_name=args.served_model_name or args.model)
        print(f"chatgen serve: http://{args.host}:{args.port}/v1 (model {app.state.model_name!r})", file=sys.stderr)
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    finally:
        module.shutdown()
    return 0
