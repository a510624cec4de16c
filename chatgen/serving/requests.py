"""Reading a request of the OpenAI server (chatgen.serving.app): the JSON body, the protocol model
(vLLM's) with the fields the server refuses, the chat rendered with the model's template, the
prompts tokenized and length-checked as vLLM does, and the sampling parameters: a Job ready to run.
"""

import asyncio
import concurrent.futures
import copy
import json
import re

from pydantic import ValidationError

from chatgen.generation.chat_tokens import replace_prefix_tokens
from chatgen.serving.http import APIError
from chatgen.serving.tool_calls import check_tool_schemas, template_messages

# Request fields the server refuses rather than silently ignore: (field, is it set?, why)
UNSUPPORTED = (
    ("use_beam_search", bool, "beam search is not supported; sample with n > 1"),
    (
        "response_format",
        lambda v: v is not None and getattr(v, "type", "text") != "text",
        "structured output is not supported",
    ),
    ("structured_outputs", lambda v: v is not None, "structured output is not supported"),
    ("suffix", bool, "suffix (fill in the middle) is not supported"),
    (
        "chat_template",
        lambda v: v is not None,
        "a chat template sent with the request is not run (vLLM's default, without --trust-request-chat-template); "
        "the model's own template renders every chat",
    ),
)


def pydantic_errors(errors) -> str:
    return "; ".join(
        f"{'.'.join(map(str, err['loc'])) or 'body'}: {err['msg']}" for err in errors[:10]
    )


_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")  # a \uD800-\uDFFF escape in the raw body


def read_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError, or an int of > 4300 digits
        raise APIError(400, f"the request body is not valid JSON: {e}")
    except RecursionError:
        raise APIError(400, "the request body nests JSON arrays or objects too deeply to parse")
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    if _SURROGATE.search(raw):  # a pair of escapes is one character; a lone one is no text
        try:
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as e:
            raise APIError(
                400,
                f"the request body holds a lone UTF-16 surrogate escape "
                f"(\\u{ord(e.object[e.start]):04x}), which is no text: escape the "
                "whole character as a surrogate pair, or send it as UTF-8",
            )
    return body


def parse_request(model_class, body: dict):
    try:
        req = model_class.model_validate(body)
    except ValidationError as e:
        raise APIError(400, "invalid request: " + pydantic_errors(e.errors()))
    for field, is_set, why in UNSUPPORTED:
        if is_set(getattr(req, field, None)):
            raise APIError(400, f"{field}: {why}", field)
    return req


def refuse_non_int_token_ids(prompt) -> None:
    """pydantic would read `[true, false]` (or 1.0) as token ids [1, 0]: a prompt of ids must
    hold integers."""
    if not isinstance(prompt, list):
        return
    for i, p in enumerate(prompt):
        for t in p if isinstance(p, list) else [p]:
            if not isinstance(t, str) and type(t) is not int:
                raise APIError(
                    400,
                    f"prompt: token ids are integers; found {json.dumps(t)} in "
                    f"{'prompt ' + str(i) if isinstance(p, list) else 'the prompt'}",
                    "prompt",
                )


class ModelLimits:
    """What the protocol's `build_tok_params(model_config)` reads of vLLM's ModelConfig."""

    def __init__(self, max_model_len: int):
        self.max_model_len = max_model_len


class Job:
    """A parsed request, ready to run: its prompts (token ids), their texts where known, their
    sampling params."""

    adapter = None  # the served LoRA adapter its `model` names (chatgen serve --lora-modules); None: the base

    def __init__(self, req, prompts, texts, params, **extra):
        self.req, self.prompts, self.texts, self.params = req, prompts, texts, params
        self.__dict__.update(extra)


class RequestReader:
    """Request handling shared by the endpoints: a request's body parsed and checked, its prompts
    tokenized (off the event loop, on the reader's own thread) and its sampling parameters, as a
    Job."""

    def __init__(self, module, name: str):
        self.module, self.name = module, name
        self.tool_calls = None  # chatgen.serving.tool_calls.ToolCalls: --enable-auto-tool-choice
        cfg = module.config
        self.defaults = {
            "temperature": cfg.temperature,
            "top_p": cfg.top_p,
            "top_k": max(cfg.top_k, 0),
            "min_p": cfg.min_p,
        }
        self.limits = ModelLimits(cfg.seq_length)
        # decoding (shared with the engine: decoding never changes it)
        self.tokenizer = module.tokenizer
        # Encoding with vLLM's truncation settings changes the tokenizer's state (HF's
        # set_truncation_and_padding), which would fail ("Already borrowed") while another thread
        # encodes with it: the server encodes with its own copy, on its own single thread (which
        # also keeps tokenizing off the event loop).
        self.encoder = copy.deepcopy(module.tokenizer)
        self.worker = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="chatgen-server-tokenize"
        )
        self.token_texts = {}  # token id -> its text in log-probs (vLLM's convert_ids_list_to_tokens)

    async def off_loop(self, fn, raw: bytes):
        return await asyncio.get_running_loop().run_in_executor(self.worker, fn, raw)

    def check_model(self, model) -> str | None:
        """The served LoRA adapter `model` names (None: the base model); a 404 for a name not
        served."""
        adapters = getattr(self.module, "lora_adapters", {})
        if model in adapters:
            return model
        if model is not None and model != self.name:
            raise APIError(
                404,
                f"model {model!r} does not exist; this server serves "
                f"{', '.join(map(repr, [self.name, *adapters]))} (GET /v1/models)",
                "model",
            )
        return None

    # ------------------------------------------------------------------ prompts (on the worker
    # thread)

    def tokenize_text(self, text: str, tok_params) -> list:
        """vLLM's text path: a length check on characters (before any tokenizing), encode,
        truncate, a length check on tokens; the rules are the request's `TokenizeParams`."""
        text = tok_params.apply_pre_tokenization(self.encoder, {"prompt": text})["prompt"]
        return self.check_ids(
            self.encoder.encode(self.trim(text, tok_params), **tok_params.get_encode_kwargs()),
            tok_params,
        )

    def trim(self, text: str, tok_params) -> str:
        """A truncated prompt's text cut, before encoding, to what its kept tokens can span (the
        model's max input tokens x its longest token, on the side truncation drops): the
        tokenizer would otherwise encode all of a 15 MB text to keep 100 tokens, and every other
        request waits on this thread meanwhile. vLLM cuts the same way when a request names
        truncation_side."""
        limit = getattr(self.encoder, "max_chars_per_token", None)
        if not limit or None in (tok_params.truncate_prompt_tokens, tok_params.max_input_tokens):
            return text
        limit *= tok_params.max_input_tokens
        if len(text) <= limit:
            return text
        side = tok_params.truncation_side or getattr(self.encoder, "truncation_side", "left")
        return text[-limit:] if side == "left" else text[:limit]

    def check_ids(self, ids, tok_params) -> list:
        """Token ids truncated and length-checked by the request's `TokenizeParams`."""
        ids = list(
            tok_params.apply_post_tokenization(self.encoder, {"prompt_token_ids": list(ids)})[
                "prompt_token_ids"
            ]
        )
        if not ids:
            raise APIError(
                400,
                "the prompt has no tokens left (truncate_prompt_tokens: 0?); every "
                "prompt needs at least one",
                "truncate_prompt_tokens",
            )
        return ids

    def render(
        self, req, messages=None, add_generation_prompt=None, continue_final_message=None
    ) -> str:
        """A chat (the request's messages, or `messages`) rendered to text with the model's own
        chat template, with the request's tools, documents and chat_template_kwargs."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise APIError(
                400,
                "this model's tokenizer has no chat template; use /v1/completions with a prompt",
            )
        plain = []
        for i, message in enumerate(req.messages if messages is None else messages):
            content = message.get("content")
            if content is not None and not isinstance(content, str):  # content parts: text only
                try:
                    parts = list(content)  # validated here, lazily, by the protocol
                except ValidationError as e:
                    raise APIError(
                        400, f"messages.{i}.content: " + pydantic_errors(e.errors()), "messages"
                    )
                if any(part.get("type") != "text" for part in parts):
                    raise APIError(
                        400,
                        f"messages.{i}.content: only text parts are supported (this server serves a "
                        "text-only model)",
                        "messages",
                    )
                # vLLM's "string" content format
                content = "\n".join(part["text"] for part in parts)
            plain.append(
                {
                    **{
                        k: v
                        for k, v in message.items()
                        if k in ("role", "name", "tool_call_id", "tool_calls")
                    },
                    "content": content,
                }
            )
        kwargs = dict(req.chat_template_kwargs or {})
        kwargs.update(
            add_generation_prompt=req.add_generation_prompt
            if add_generation_prompt is None
            else add_generation_prompt,
            continue_final_message=req.continue_final_message
            if continue_final_message is None
            else continue_final_message,
        )
        tools = getattr(req, "tools", None)
        if tools:
            kwargs["tools"] = [tool.model_dump() for tool in tools]
        if getattr(req, "documents", None):
            kwargs["documents"] = req.documents
        try:
            return self.tokenizer.apply_chat_template(
                template_messages(plain), tokenize=False, **kwargs
            )
        except Exception as e:  # a template that raises on these messages (e.g. roles out of order)
            raise APIError(400, f"messages: the chat template refused them: {e}", "messages")

    def chat_prompt(self, req, tok_params) -> list:
        """The prompt ids of a chat: the template's, with the previous turn's exact ids as prefix
        when known."""
        messages = req.messages
        prefix = getattr(req, "required_prefix_token_ids", None)
        last = max(
            (i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=None
        )
        if prefix is None and last is not None:
            m = messages[last]
            if m.get("prompt_token_ids") is not None and m.get("generation_token_ids") is not None:
                parts = (m["prompt_token_ids"], m["generation_token_ids"])
                if not all(isinstance(p, list) for p in parts):
                    raise APIError(
                        400,
                        f"messages.{last}: prompt_token_ids and "
                        "generation_token_ids are lists of token ids",
                        "messages",
                    )
                prefix = parts[0] + parts[1]
        if prefix is None:
            return self.tokenize_text(self.render(req), tok_params)
        if not (
            isinstance(prefix, list) and prefix and all(type(t) is int and t >= 0 for t in prefix)
        ):
            raise APIError(
                400,
                "required_prefix_token_ids must be a non-empty list of token ids",
                "required_prefix_token_ids",
            )
        if last is None:
            raise APIError(
                400,
                "required_prefix_token_ids needs the assistant message they end with in messages",
                "required_prefix_token_ids",
            )
        eos = self.tokenizer.eos_token_id
        # continue exactly the ids of that answer
        if req.continue_final_message and last == len(messages) - 1:
            return self.check_ids(prefix[:-1] if prefix[-1] == eos else prefix, tok_params)
        history = self.encoder.encode(
            self.render(
                req, messages[: last + 1], add_generation_prompt=False, continue_final_message=False
            ),
            add_special_tokens=False,
        )
        ids = self.encoder.encode(self.render(req), add_special_tokens=False)
        try:
            return self.check_ids(
                replace_prefix_tokens(self.tokenizer, prefix, history, ids), tok_params
            )
        except ValueError as e:
            raise APIError(400, str(e), "required_prefix_token_ids")

    def sampling_params(self, req, prompt_len: int):
        """The request's SamplingParams for one prompt (vLLM's `get_max_tokens` and
        `to_sampling_params`; fields the request leaves out take the per-model config's
        temperature, top_p, top_k and min_p)."""
        from vllm.entrypoints.serve.utils.api_utils import get_max_tokens

        wanted = getattr(req, "max_completion_tokens", None)
        wanted = req.max_tokens if wanted is None else wanted
        max_tokens = get_max_tokens(
            self.module.config.seq_length,
            wanted,
            prompt_len,
            {},
            truncate_prompt_tokens=req.truncate_prompt_tokens,
        )
        params = req.to_sampling_params(max_tokens, self.defaults)
        if params.logprobs is None and params.logprob_token_ids is None:
            params.logprobs = 0  # generation_log_probs needs the sampled token's log-prob
        return params

    def prepare_completion(self, raw: bytes) -> Job:
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest

        body = read_json(raw)
        refuse_non_int_token_ids(body.get("prompt"))
        req = parse_request(CompletionRequest, body)
        adapter = self.check_model(req.model)
        raw_prompts = req.prompt
        if raw_prompts is None or raw_prompts == "":
            raise APIError(
                400,
                "prompt: give a non-empty string, a list of token ids, or a list of those",
                "prompt",
            )
        if isinstance(raw_prompts, str) or (
            raw_prompts and all(type(t) is int for t in raw_prompts)
        ):
            raw_prompts = [raw_prompts]
        if not raw_prompts:
            raise APIError(400, "prompt: the list holds no prompt; give at least one", "prompt")
        tok_params = req.build_tok_params(self.limits)
        prompts, texts = [], []
        for i, p in enumerate(raw_prompts):
            if isinstance(p, str):
                prompts.append(self.tokenize_text(p, tok_params))
                texts.append(p)
            else:
                if not p:
                    raise APIError(
                        400, f"prompt {i}: empty; every prompt needs at least one token", "prompt"
                    )
                prompts.append(self.check_ids(p, tok_params))
                texts.append(self.tokenizer.decode(prompts[-1]) if req.echo else None)
        params = [self.sampling_params(req, len(p)) for p in prompts]
        return Job(req, prompts, texts, params, adapter=adapter)

    def prepare_chat(self, raw: bytes) -> Job:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        req = parse_request(ChatCompletionRequest, read_json(raw))
        adapter = self.check_model(req.model)
        self.check_tools(req)
        prompt = self.chat_prompt(req, req.build_tok_params(self.limits))
        return Job(req, [prompt], [None], [self.sampling_params(req, len(prompt))], adapter=adapter)

    def check_tools(self, req) -> None:
        """A request's tools: valid JSON Schemas, and a tool_choice that parses calls only with a
        parser (vLLM's rule); markers such as <tool_call> may be special tokens, so they stay in
        the text the parser reads."""
        if not req.tools:
            return
        check_tool_schemas(req.tools)
        if req.tool_choice == "none":
            return
        if self.tool_calls is None:
            raise APIError(
                400,
                f"tool_choice {req.tool_choice if isinstance(req.tool_choice, str) else 'named'}: parsing "
                "tool calls needs --enable-auto-tool-choice and --tool-call-parser NAME (chatgen serve; "
                "EmbeddedServer(tool_call_parser=NAME)); or send tool_choice 'none' to render the tools "
                "into the prompt and read the calls from the reply yourself",
                "tool_choice",
            )
        req.skip_special_tokens = False

    def tokenize(self, raw: bytes):
        from vllm.entrypoints.serve.tokenize.protocol import (
            TokenizeChatRequest,
            TokenizeCompletionRequest,
            TokenizeResponse,
        )

        body = read_json(raw)
        req = parse_request(
            TokenizeChatRequest if "messages" in body else TokenizeCompletionRequest, body
        )
        self.check_model(req.model)
        text = self.render(req) if "messages" in body else req.prompt
        ids = self.tokenize_text(text, req.build_tok_params(self.limits))
        return TokenizeResponse(
            tokens=ids,
            count=len(ids),
            max_model_len=self.module.config.seq_length,
            token_strs=self.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None,
        )

    def detokenize(self, raw: bytes):
        from vllm.entrypoints.serve.tokenize.protocol import DetokenizeRequest, DetokenizeResponse

        req = parse_request(DetokenizeRequest, read_json(raw))
        self.check_model(req.model)
        vocab = self.module.vocab_size
        if any(not 0 <= t < vocab for t in req.tokens):
            bad = next(t for t in req.tokens if not 0 <= t < vocab)
            raise APIError(
                400, f"tokens: {bad} is no token id of this model (0..{vocab - 1})", "tokens"
            )
        return DetokenizeResponse(prompt=self.tokenizer.decode(req.tokens))
