"""What the OpenAI server answers with, apart from generating: a protocol model as a JSON body or a
server-sent event, the log-probs in the OpenAI shapes (prompt, completion, chat), usage, and
chatgen's own fields of a sample (its token ids, the engine's log-prob of each and the weight
version each was sampled under).

ResponseBuilder is the base of chatgen.serving.endpoints.OpenAIServer (which generates); reading a request is
chatgen.serving.requests.RequestReader's.
"""

from fastapi.responses import Response

from chatgen.serving.requests import RequestReader


def json_response(obj) -> Response:
    """A protocol model as the response body: pydantic's own JSON (FastAPI's generic encoder of a
    returned model costs 0.25 ms per completion response, measured; this 0.007 ms)."""
    return Response(obj.model_dump_json(), media_type="application/json")


def sse_event(obj, **dump) -> str:
    return f"data: {obj.model_dump_json(**(dump or {'exclude_unset': True}))}\n\n"


def sampled_logprobs(sample) -> list:
    return [step[token].logprob for step, token in zip(sample.logprobs or (), sample.token_ids)]


def generated_fields(sample) -> dict:
    """chatgen's fields of a sample (or of a streamed delta: its new tokens): the ids, the
    engine's log-prob of each and the weight version each was sampled under."""
    return {
        "token_ids": list(sample.token_ids),
        "generation_log_probs": sampled_logprobs(sample),
        "generation_weight_versions": getattr(sample, "weight_versions", None),
    }


async def chain(first, outputs):
    if first is None:
        return
    yield first
    async for item in outputs:
        yield item


class ResponseBuilder(RequestReader):
    """Log-probs, token texts and usage in the OpenAI protocol's shapes (vLLM's models)."""

    # ------------------------------------------------------------------ outputs

    def token_text(self, token: int) -> str:
        """A token's text in log-probs, as vLLM writes it (the leading space SentencePiece's
        decode drops kept)."""
        text = self.token_texts.get(token)
        if text is None:
            from vllm.tokenizers.detokenizer_utils import convert_ids_list_to_tokens

            text = self.token_texts[token] = convert_ids_list_to_tokens(self.tokenizer, [token])[0]
        return text

    def prompt_logprobs(self, output):
        """The request's prompt log-probs as vLLM answers them: token texts filled in, -inf
        clamped to -9999."""
        steps = output.prompt_logprobs
        for step in steps or ():
            for token, lp in (step or {}).items():
                lp.decoded_token = self.token_text(token)
                lp.logprob = max(lp.logprob, -9999.0)
        return steps

    def completion_logprobs(self, token_ids, steps, top: int, text_offset: int = 0):
        """vLLM's completions `logprobs`: per token its text, log-prob, the first `top` + 1
        entries of its step (the sampled token first, then the most likely) and its offset in the
        text."""
        from vllm.entrypoints.openai.completion.protocol import CompletionLogProbs

        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        for token, step in zip(token_ids, steps):
            if step is None:  # the first prompt token (echo) has no log-prob
                tokens.append(self.tokenizer.decode(token))
                token_logprobs.append(None)
                top_logprobs.append(None)
            else:
                tokens.append(self.token_text(token))
                token_logprobs.append(max(step[token].logprob, -9999.0))
                top_logprobs.append(
                    {
                        self.token_text(t): max(lp.logprob, -9999.0)
                        for i, (t, lp) in enumerate(step.items())
                        if top == -1 or top >= i
                    }
                )
            offsets.append(text_offset if not offsets else offsets[-1] + len(tokens[-2]))
        return CompletionLogProbs(
            text_offset=offsets,
            token_logprobs=token_logprobs,
            tokens=tokens,
            top_logprobs=top_logprobs,
        )

    def chat_logprobs(self, sample, top: int):
        """vLLM's chat `logprobs` of a sample: per token its text, bytes, log-prob and its step's
        first `top` entries (the sampled token first, then the most likely)."""
        from vllm.entrypoints.openai.chat_completion.protocol import (
            ChatCompletionLogProb,
            ChatCompletionLogProbs,
            ChatCompletionLogProbsContent,
        )

        def entry(cls, token, lp, **more):
            text = self.token_text(token)
            return cls(
                token=text,
                logprob=max(lp.logprob, -9999.0),
                bytes=list(text.encode("utf-8", errors="replace")),
                **more,
            )

        return ChatCompletionLogProbs(
            content=[
                entry(
                    ChatCompletionLogProbsContent,
                    token,
                    step[token],
                    top_logprobs=[
                        entry(ChatCompletionLogProb, t, lp)
                        for i, (t, lp) in enumerate(step.items())
                        if top == -1 or i < top
                    ],
                )
                for token, step in zip(sample.token_ids, sample.logprobs)
            ]
        )

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens=None):
        from vllm.entrypoints.serve.engine.protocol import PromptTokenUsageInfo, UsageInfo

        return UsageInfo(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=None
            if cached_tokens is None
            else PromptTokenUsageInfo(cached_tokens=cached_tokens),
        )
