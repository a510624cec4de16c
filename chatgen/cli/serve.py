"""`chatgen serve`: an OpenAI-compatible HTTP server over a step-driven VLLMModule.

    chatgen serve --model outputs/tiny-llama                       # http://127.0.0.1:8000/v1
    CHATGEN_API_KEY=KEY chatgen serve --model DIR --config configs/models/tiny_llama.yaml --port 8001 seq_length=512
    chatgen serve --module my_models:MyPolicy --config my_policy.yaml --config-dialect chatlearn --model DIR
    chatgen serve --model DIR --lora-modules mine=outputs/run/adapter  # a PEFT adapter as model "mine" beside the base
    chatgen serve --model DIR --enable-auto-tool-choice --tool-call-parser hermes   # replies carry tool_calls

Binds to 127.0.0.1 unless --host says otherwise; with an API key (the CHATGEN_API_KEY environment
variable, --api-key-file, or --api-key, which every user of the machine can read in the process
list) every endpoint needs `Authorization: Bearer KEY`. --control adds the weight-update endpoints
(chatgen/serving/control.py). Trailing `key=value` arguments set any per-model key
(docs/generation_keys.md). Endpoints and fields: docs/serving.md.
"""

import argparse
import os
import sys

from chatgen.cli import heartbeat, positive_int
from chatgen.cli.generate import add_module_arguments, build_module, require_tokenizer
from chatgen.core.checkpoint_io import read_hf_config
from chatgen.core.imports import require

API_KEY_ENV = "CHATGEN_API_KEY"


def port_number(text: str) -> int:
    """argparse type of --port: 0..65535 (0: a free port), else a usage error naming the value."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(
            f"{value} is not a port: use 1..65535, or 0 for a free one"
        )
    return value


def add_arguments(parser) -> None:
    add_module_arguments(parser)
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)"
    )
    parser.add_argument(
        "--port",
        type=port_number,
        default=8000,
        help="port to listen on (default 8000; 0: a free one)",
    )
    parser.add_argument(
        "--max-request-bytes",
        type=positive_int,
        default=None,
        help="answer 413 to a request body larger than this (default 16 MiB)",
    )
    parser.add_argument(
        "--api-key-file",
        metavar="PATH",
        help="require 'Authorization: Bearer KEY' on every request, KEY the first line of PATH "
        f"(or set {API_KEY_ENV}=KEY)",
    )
    parser.add_argument(
        "--api-key",
        help="as --api-key-file, the key on the command line: every user of this machine "
        f"sees it in the process list (ps); prefer {API_KEY_ENV} or --api-key-file",
    )
    parser.add_argument(
        "--control",
        action="store_true",
        help="add the /control endpoints (pause, resume, weight updates from a trainer, prefix cache "
        "reset; chatgen/serving/control.py); beyond loopback they need an API key",
    )
    parser.add_argument(
        "--gateway",
        action="store_true",
        help="record chat completions per agent session (/sessions/{id}/v1; reward POSTs close a "
        "session; chatgen/serving/gateway.py, docs/agents.md); needs an API key",
    )
    parser.add_argument(
        "--control-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="with --control: how long a weight update may keep the server waiting at any step "
        "(the trainer connecting after begin, each bucket, the end) before it is given up and "
        "the engine keeps its weights (default 120)",
    )
    parser.add_argument(
        "--served-model-name", help="the model name clients send (default: --model as given)"
    )
    parser.add_argument(
        "--allowed-hosts",
        default="",
        metavar="NAMES",
        help="comma-separated names clients may send in the Host header beyond IP "
        "addresses, localhost and this machine's names, e.g. the name a proxy "
        "forwards; '*': any (default: none; a foreign Host is answered 400)",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="on SIGTERM, how long requests still running may finish "
        "before they are cancelled (default 10; vLLM's --shutdown-timeout)",
    )
    parser.add_argument(
        "--lora-modules",
        "--lora",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="serve the PEFT LoRA adapter in DIR as model NAME beside the base (vLLM's flag; one adapter per "
        "flag, repeat it for more); "
        "sets enable_lora and max_lora_rank unless given (docs/lora.md)",
    )
    parser.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="parse the model's tool calls into OpenAI `tool_calls` (vLLM's flag; needs "
        "--tool-call-parser; docs/agents.md)",
    )
    parser.add_argument(
        "--tool-call-parser",
        metavar="NAME",
        help="vLLM's tool-call parser for the model's format: hermes, llama3_json, mistral, pythonic, "
        "qwen3_xml, ... (an unknown name lists them)",
    )
    parser.add_argument(
        "overrides", nargs="*", metavar="key=value", help="any per-model key, e.g. seq_length=512"
    )


LORA_RANKS = (8, 16, 32, 64, 128)  # vLLM's max_lora_rank choices


def lora_modules(items: list, served: str) -> tuple[dict, int]:
    """({NAME: DIR}, the largest rank) of --lora-modules, each DIR read as a PEFT LoRA adapter; a
    ValueError or ConfigError naming the flag and the fix otherwise (before any engine starts)."""
    from chatgen.models.lora_format import read_peft

    modules, rank = {}, 0
    for item in items:
        name, sep, directory = item.partition("=")
        if not (sep and name and directory):
            raise ValueError(
                f"--lora-modules {item!r}: give NAME=DIR, e.g. mine=outputs/run/adapter"
            )
        if name in modules or name == served:
            raise ValueError(
                f"--lora-modules {item!r}: the name {name!r} is taken (by the base model or another "
                "adapter); give each adapter a name of its own"
            )
        config, _ = read_peft(directory, key=f"--lora-modules {name}")
        modules[name], rank = directory, max(rank, int(config["r"]))
    if rank > LORA_RANKS[-1]:
        raise ValueError(f"--lora-modules: rank {rank} is above vLLM's largest max_lora_rank, 128")
    return modules, rank


def fit_max_new_tokens(module, args) -> None:
    """Without a max_new_tokens of the user's (an override or --config), one that leaves room for
    a prompt in the model's context: the server bounds each request's own max_tokens by what its
    prompt leaves (as vLLM's does), so the default (256) need not fit a 256-token model whole."""
    import dataclasses

    from chatgen.config.loader import read_yaml

    given = any(o.partition("=")[0].strip() == "max_new_tokens" for o in args.overrides)
    if args.config and not given:
        given = "max_new_tokens" in read_yaml(args.config, [], [])[0]
    cfg = module.config
    context = cfg.seq_length or read_hf_config(args.model, "--model").get("max_position_embeddings")
    if not given and context and cfg.max_new_tokens >= context:
        module.config = dataclasses.replace(cfg, max_new_tokens=max(1, context // 2))


def lora_overrides(overrides: list, rank: int) -> list:
    """The engine keys --lora-modules needs, unless the user gave them: enable_lora,
    max_lora_rank."""
    given = {o.partition("=")[0] for o in overrides}
    extra = [] if "enable_lora" in given else ["enable_lora=true"]
    if "max_lora_rank" not in given:
        extra.append(f"max_lora_rank={next(r for r in LORA_RANKS if r >= rank)}")
    return [*overrides, *extra]


def run(args) -> int:
    read_hf_config(args.model, "--model")
    # the key from the one place it was given (two are refused: which one counts would be a guess)
    given = [
        name
        for name, value in (
            (API_KEY_ENV, os.environ.get(API_KEY_ENV)),
            ("--api-key-file", args.api_key_file),
            ("--api-key", args.api_key),
        )
        if value is not None
    ]
    if len(given) > 1:
        raise ValueError(f"{' and '.join(given)} both give an API key; give it one way")
    key = None
    if given == ["--api-key-file"]:
        with open(args.api_key_file, encoding="utf-8") as f:
            key = f.readline().strip()
    elif given == ["--api-key"]:
        key = args.api_key
        print(
            f"chatgen serve: warning: --api-key shows the key to every user of this machine in the process list "
            f"(ps); set {API_KEY_ENV}=KEY or use --api-key-file PATH instead",
            file=sys.stderr,
        )
    elif given:
        key = os.environ[API_KEY_ENV]
    if given and not key:
        raise ValueError(
            f"{given[0]}: the API key is empty; give one, e.g. the output of `python -c 'import secrets; "
            "print(secrets.token_urlsafe(32))'`"
        )
    require("uvicorn", "chatgen serve")
    import uvicorn  # the server's stack (and vLLM's protocol): not for `chatgen serve --help`

    from chatgen.serving.app import build_app
    from chatgen.serving.control import DEFAULT_TIMEOUT_S, check_bind, control_router
    from chatgen.serving.embedded import listen
    from chatgen.serving.gateway import Gateway
    from chatgen.serving.limits import SHUTDOWN_GRACE_S, uvicorn_config

    if args.shutdown_timeout is not None and not args.shutdown_timeout >= 0:
        raise ValueError(
            f"--shutdown-timeout {args.shutdown_timeout}: give the seconds "
            "running requests may take to finish on SIGTERM, e.g. 10"
        )
    if args.gateway and not key:
        raise ValueError(
            f"--gateway: its reward endpoint decides what trains; give an API key ({API_KEY_ENV}=KEY "
            "or --api-key-file PATH)"
        )
    if args.enable_auto_tool_choice != (args.tool_call_parser is not None):
        raise ValueError(
            "--enable-auto-tool-choice and --tool-call-parser NAME go together (vLLM's flags): give "
            "both to parse tool calls, or neither"
        )
    if args.tool_call_parser is not None:
        from chatgen.serving.tool_calls import parser_class

        parser_class(args.tool_call_parser)  # an unknown name: before the engine starts
    served = args.served_model_name or args.model
    adapters, rank = lora_modules(args.lora_modules, served)  # before the engine starts
    if adapters:
        args.overrides = lora_overrides(args.overrides, rank)
    if args.control:  # before the engine starts
        check_bind(args.host, key)
        if args.control_timeout is not None and not args.control_timeout > 0:
            raise ValueError(
                f"--control-timeout {args.control_timeout}: give the seconds a weight update may keep "
                "the server waiting, e.g. 120"
            )
    sock = listen(args.host, args.port)  # a port in use is an error before the engine loads
    try:
        module = build_module(args)
        fit_max_new_tokens(module, args)
        # before the engine's minutes of start-up
        require_tokenizer(module, args.model, "the chat and text endpoints need")
        with heartbeat(f"starting the engine for {args.model}"):
            module.start()
    except BaseException:
        sock.close()
        raise
    try:
        for name, directory in adapters.items():  # the engine shuts down if one fails
            module.add_lora_adapter(name, directory)
        timeout = DEFAULT_TIMEOUT_S if args.control_timeout is None else args.control_timeout
        routers = (
            [control_router(module, api_key=key, host=args.host, timeout=timeout)]
            if args.control
            else []
        )
        app = build_app(
            module,
            api_key=key,
            model_name=served,
            routers=routers,
            max_request_bytes=args.max_request_bytes,
            allowed_hosts=[args.host, *filter(None, args.allowed_hosts.split(","))],
            tool_call_parser=args.tool_call_parser,
            gateway=Gateway() if args.gateway else None,
        )
        host = f"[{args.host}]" if ":" in args.host else args.host
        print(
            f"chatgen serve: http://{host}:{sock.getsockname()[1]}/v1 (model {app.state.model_name!r})",
            file=sys.stderr,
        )
        grace = SHUTDOWN_GRACE_S if args.shutdown_timeout is None else args.shutdown_timeout
        uvicorn.Server(uvicorn_config(app, shutdown_grace_s=grace)).run(sockets=[sock])
    finally:
        module.shutdown()
        sock.close()
    return 0
