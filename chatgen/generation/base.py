"""The generation contract: what every generation backend does, and the registry that `backend:`
names.

    from chatgen.generation.base import load_backend
    backend = load_backend("vllm")                 # the package chatgen.generation.vllm (or your own module)
    policy = import_class(backend.MODULE)(config).start()          # a GenerationModule
    batch = policy.run_generation(policy.prepare_dataset(["sort: 3 1 2 ="]))   # a RolloutBatch
    out = policy.generate({"input_ids": ids, "input_lengths": lengths})      # token in / token out
    policy.load_weights(buckets)                   # named HF weights, as chatgen.param_sync streams them

Everything outside a backend's own package (param_sync, serving, the runtime, the algorithms) uses
only what `GenerationModule` declares here. A backend is a package of chatgen.generation (`vllm`,
`hf`) or any importable module, named by a model entry's `backend:` (e.g. `backend:
my_pkg.my_backend`); it defines
    Config    its per-model config, a dataclass subclassing chatgen.generation.config.GenerationConfig
    MODULE    'package.module:ClassName' of its GenerationModule subclass (imported only when a model starts,
              so that checking a config never imports an engine)
docs/architecture.md shows how to add one.

What a backend implements (the rest is shared here):
    setup()                       build the engine; set tokenizer, pad_token_id, vocab_size, hf_config
    run_generation(items, is_eval)            -> RolloutBatch (the one data contract, chatgen.core.rollout)
    finished(items, is_eval, greedy)          -> finished requests (see `Completion`), for generate / generate_text
    sampling_params(prompt_len, ...)          -> the backend's request settings (vLLM: SamplingParams), with a
                                                 call's own stop_strings / stop_token_ids
    stream(prompts, params, deltas)           async: (prompt index, request output) as they come
    load_weights(buckets, mode)               write HF-named weights; `weight_version`, `needs_resync`
    health_problem                            why it cannot serve now (a hung engine), or None
    sleep(level) / wake_up() / is_sleeping(); pause() / resume() / reset_prefix_cache(); shutdown()
A finished request is shaped like vLLM's `RequestOutput` (`request_id`, `prompt_token_ids`,
`prompt`, `prompt_logprobs`, `outputs`: samples with `index`, `token_ids`, `logprobs` (one {token
id: object with `.logprob`} per token), `text`, `finish_reason`, `stop_reason`, `weight_versions`);
chatgen.generation.batching turns it into batches. A backend other than vLLM builds it from
`Completion` and `FinishedRequest`.
"""

import contextlib
import dataclasses
import logging

from chatgen import generation, models
from chatgen.config import ConfigError
from chatgen.core.checkpoint_io import hf_weight_shapes
from chatgen.core.imports import load_plugin, plugins
from chatgen.core.rollout import RolloutBatch
from chatgen.generation import config as gc
from chatgen.generation.batching import generation_output, iter_samples, rollout_batch, unpad_batch
from chatgen.models import layout
from chatgen.module import Module

logger = logging.getLogger(__name__)
REQUIRED = ("Config", "MODULE")
UPDATE_MODES = ("wait", "keep", "recompute", "abort")
TOKENIZE_CHUNK = 1000  # prompts per tokenizer call in build_dataset


def encode(tokenizer, texts: list, chat_template: bool) -> list:
    """Token ids of text prompts, each rendered as a user turn with the chat template when
    chat_template."""
    if chat_template:
        # return_dict=False: transformers 5 returns a BatchEncoding by default, whose list() is its
        # keys
        return tokenizer.apply_chat_template(
            [[{"role": "user", "content": t}] for t in texts],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
    # only the ids: the attention masks and token type ids of 20k prompts were ~40% of the call
    return tokenizer(texts, return_attention_mask=False, return_token_type_ids=False)["input_ids"]


def available() -> list[str]:
    """The generation backends shipped with chatgen (the backend packages of chatgen.generation)."""
    return plugins(generation, packages_only=True)


def load_backend(name: str):
    """The backend module for a model entry's `backend:` (a package of chatgen.generation, or the
    dotted path of your own module); a ValueError names the choices when there is none."""
    return load_plugin(
        name,
        generation,
        REQUIRED,
        "generation backend",
        "backend",
        "chatgen/generation/vllm/__init__.py",
        packages_only=True,
    )


@dataclasses.dataclass
class TokenLogprob:
    """The log-prob of one token, shaped like vLLM's `Logprob` (`.logprob`)."""

    logprob: float


@dataclasses.dataclass
class Completion:
    """One sample of a finished request, shaped like vLLM's `CompletionOutput` (for backends
    other than vLLM)."""

    index: int
    token_ids: list
    logprobs: list  # [{token id: TokenLogprob}] per generated token (the sampled token at least)
    text: str = ""
    finish_reason: str = "stop"  # "stop" (EOS / a stop), "length" (token limit) or "abort"
    stop_reason: object = None
    weight_versions: list | None = None


@dataclasses.dataclass
class FinishedRequest:
    """A finished request, shaped like vLLM's `RequestOutput` (for backends other than vLLM)."""

    request_id: str
    prompt_token_ids: list
    outputs: list  # [Completion]
    prompt: str | None = None
    prompt_logprobs: list | None = None  # [None, {token id: TokenLogprob}, ...] when asked for
    finished: bool = True


class GenerationModule(Module):
    """Base of every generation backend's module (VLLMModule, the hf backend). See the module
    docstring.

    Attributes after `setup()`: `tokenizer` (None for a model without one), `pad_token_id`,
    `vocab_size`, `hf_config` (the model's config.json as a dict), `metrics` (figures of the last
    generation call), `config`.
    """

    config_class = gc.GenerationConfig

    def __init__(self, config=None, *, name: str | None = None, config_dialect: str = "chatgen"):
        super().__init__(config, name=name, config_dialect=config_dialect)
        self.tokenizer = None
        self.pad_token_id = 0
        self.vocab_size = None
        self.hf_config = None
        self.metrics = {}

    def model_provider(self) -> str:
        """Which model to run. Called once by `setup()`. Returns the Hugging Face model directory
        (config.json + safetensors). Default: the `load` key. Override to pick the model in code."""
        if not self.config.load:
            raise ConfigError(
                ["load: not set; set it to the Hugging Face model directory to generate with"]
            )
        return self.config.load

    # ------------------------------------------------------------------ prompts

    def build_dataset(self, prompts, is_eval=False) -> list:
        """Turn prompt strings into dataset items. The framework calls it on the train / eval
        prompts.

        prompts: list of str, or of chats (lists of {"role", "content"} messages:
        runtime.messages_key). Returns list[dict], one per prompt: {"input_ids": list[int],
        "prompt": str (as given; a chat: its rendered text)}, plus "prompt_cut": True on a prompt
        that was cut (the RLHF run stops when too many are).
        Each text prompt is put into `prompt_template` (if set), rendered as a user message with the
        tokenizer's chat template when `chat_template` is true, then tokenized with the model's
        tokenizer (BOS included); a chat is always rendered with the chat template, ending with the
        assistant's prefix. An empty prompt is an error. A prompt over the budget
        seq_length - max_new_tokens tokens (`chatgen.generation.config.prompt_budget`) is cut to
        it, keeping its beginning as ChatLearn does (`prompt[:max_prompt_length]`); one warning per
        call gives the count.
        """
        if self.tokenizer is None:
            raise RuntimeError(
                "build_dataset needs a tokenizer; this model has none: pass token ids to generate()"
            )
        budget = gc.prompt_budget(self.config)
        template = self.config.prompt_template
        texts, chats, trimmed, span = [], {}, set(), None
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, list) and prompt:  # a chat: rendered whole, no prompt_template
                chats[i] = prompt
                texts.append("")
                continue
            if not isinstance(prompt, str) or not prompt:
                raise ValueError(
                    f"build_dataset: prompt {i} is empty or not a string ({prompt!r}); drop it"
                )
            if len(prompt) > budget and hasattr(self.tokenizer, "get_vocab"):
                # cut, before tokenizing, to what `budget` tokens can span (the longest token's
                # length each): a 10 MB prompt would otherwise be tokenized whole to keep its start
                span = span or budget * max(map(len, self.tokenizer.get_vocab()))
                if len(prompt) > span:
                    prompt = prompt[:span]
                    trimmed.add(i)
            texts.append(template.replace("{prompt}", prompt) if template else prompt)
        encoded = []
        # batched calls (the fast tokenizer's batch path: one encode per prompt took seconds for 20k
        # prompts), a chunk at a time: one call over 20k prompts left ~40 MiB of its freed objects
        # resident for the run
        for start in range(0, len(texts), TOKENIZE_CHUNK):
            encoded += encode(
                self.tokenizer, texts[start : start + TOKENIZE_CHUNK], self.config.chat_template
            )
        if chats:
            if not getattr(self.tokenizer, "chat_template", None):
                raise ValueError(
                    "build_dataset: the prompts are chats (runtime.messages_key), but "
                    "this model's tokenizer has no chat template; use text prompts "
                    "(runtime.prompt_key) or a tokenizer with one (tokenizer key)"
                )
            rendered = self.tokenizer.apply_chat_template(
                list(chats.values()), tokenize=False, add_generation_prompt=True
            )
            for i, text in zip(chats, rendered):
                texts[i] = text
                encoded[i] = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        items, cut = [], []
        for i, (prompt, ids) in enumerate(zip(prompts, encoded)):
            item = {"input_ids": list(ids), "prompt": texts[i] if i in chats else prompt}
            if len(ids) > budget or i in trimmed:
                cut.append(i)
                item.update(input_ids=list(ids[:budget]), prompt_cut=True)
            items.append(item)
        if cut:
            logger.warning(
                "build_dataset: cut %d of %d prompts to the prompt budget seq_length - max_new_tokens = "
                "%d tokens, keeping their beginning (prompts %s); raise seq_length or lower "
                "max_new_tokens to keep them whole",
                len(cut),
                len(items),
                budget,
                ", ".join(map(str, cut[:10])) + (", ..." if len(cut) > 10 else ""),
            )
        return items

    def prepare_dataset(self, prompts, is_eval=False) -> list:
        """Framework: `build_dataset(prompts, is_eval)` as a list of items (what `run_generation`
        takes)."""
        dataset = self.build_dataset(prompts, is_eval)
        return [dataset[i] for i in range(len(dataset))]

    def check_item(self, item: dict, name: str) -> None:
        """A ValueError naming the item when its prompt is over the budget or holds an id outside
        the vocabulary."""
        gc.check_prompt_length(self.config, len(item["input_ids"]), name)
        gc.check_prompt_ids(item["input_ids"], self.vocab_size, name)

    # ------------------------------------------------------------------ generation

    def run_generation(self, data, is_eval=False) -> RolloutBatch:
        """Generate for a batch of dataset items (from `prepare_dataset`); returns a RolloutBatch
        of S = items x n samples, prompt-major. An item over the prompt budget is an error naming
        it (never cut here)."""
        return rollout_batch(self.finished(data, is_eval=is_eval), self.pad_token_id)

    def finished(self, items: list, is_eval: bool = False, greedy: bool = False) -> list:
        """Generate for dataset items ({"input_ids", optional "prompt", "stop_strings",
        "stop_token_ids", "greedy", "logprobs"}); returns their finished requests in item order,
        each with n samples (1 when greedy, or for an item with "greedy": True). An item with
        "logprobs": False says the caller reads no log-probs (a backend may skip them: its
        samples' `logprobs` None). Records `self.metrics`."""
        raise NotImplementedError(f"{type(self).__name__} does not implement finished()")

    def generate(self, batch, greedy=False) -> dict:
        """Token in, token out (NeMo RL's generation interface), with the train sampling parameters.

        batch: {"input_ids": (B, T) int tensor, right-padded with `pad_token_id`; "input_lengths":
        (B,) int tensor;
                optional "stop_strings" / "stop_token_ids": lists (length B) of list[str] / list[int] or None,
                added to stop_token_list (a token of stop_token_ids ends its row and is kept, as EOS is)}.
        Other keys of the batch (NeMo RL's BatchedDataDict carries its own) are not read.
        Returns, with S = B x n rows (sample j of prompt i at row i * n + j; n = 1 when greedy) and
        L = T + longest generation:
            output_ids                 (S, L) long   prompt + generated tokens, right-padded with pad_token_id
            logprobs                   (S, L) float  logprob of each generated token, 0 on prompt and padding
            generation_lengths         (S,)   long   generated tokens
            unpadded_sequence_lengths  (S,)   long   prompt + generated tokens
            truncated                  (S,)   bool   stopped by the token limit, not by EOS / a stop
            weight_versions            (S, L) long   weight version each generated token was sampled under, -1 elsewhere
            prompt_logprobs            (S, L) float  only when prompt_logprobs is set: logprob of each prompt
                                                     token after the first, 0 elsewhere
        """
        items = self._token_items(batch, "generate()")
        outputs = self.finished(items, greedy=greedy)
        return generation_output(
            outputs, batch["input_ids"].shape[1], self.pad_token_id, batch["input_ids"].dtype
        )

    async def generate_async(self, batch, greedy=False):
        """`generate`, streaming: an async iterator of (row index, one-row output), each as soon as
        its prompt's samples finish (rows i * n .. i * n + n - 1 of prompt i, one at a time).

        Each output has the keys of `generate` for one row, L = T + that row's generation. Requests
        of other callers run alongside (continuous batching). Leaving the iterator early aborts this
        call's requests.
        """
        items = self._token_items(batch, "generate_async()")
        params = [
            self.sampling_params(
                len(item["input_ids"]),
                greedy=greedy,
                stop_strings=item["stop_strings"] or (),
                stop_token_ids=item["stop_token_ids"] or (),
            )
            for item in items
        ]
        width, dtype = batch["input_ids"].shape[1], batch["input_ids"].dtype
        async with contextlib.aclosing(
            self.stream([item["input_ids"] for item in items], params)
        ) as outputs:
            async for i, output in outputs:
                rows = generation_output([output], width, self.pad_token_id, dtype)
                n = rows["output_ids"].shape[0]
                for j in range(n):
                    yield i * n + j, {key: value[j : j + 1] for key, value in rows.items()}

    def _token_items(self, batch, name: str) -> list:
        """The rows of a token batch as dataset items, every row checked before any is queued
        (never cut: the trainer owns them)."""
        prompts = unpad_batch(batch, self.pad_token_id)
        stops = batch.get("stop_strings") or [None] * len(prompts)
        stop_ids = batch.get("stop_token_ids") or [None] * len(prompts)
        items = [
            {"input_ids": ids, "stop_strings": stop, "stop_token_ids": stop_id}
            for ids, stop, stop_id in zip(prompts, stops, stop_ids)
        ]
        for i, item in enumerate(items):
            self.check_item(item, f"{name}: row {i}")
            gc.check_prompt_ids(
                item["stop_token_ids"] or (), self.vocab_size, f"{name}: stop_token_ids[{i}]"
            )
        return items

    def sampling_params(
        self, prompt_len, *, is_eval=False, greedy=False, stop_strings=(), stop_token_ids=()
    ):
        """The backend's settings of one request of `prompt_len` tokens, from the config's
        sampling keys (chatgen.generation.config.sampling_kwargs) plus `stop_strings` and
        `stop_token_ids`."""
        raise NotImplementedError(f"{type(self).__name__} does not implement sampling_params()")

    def sampling_kwargs(
        self, prompt_len, *, is_eval=False, greedy=False, stop_strings=(), stop_token_ids=()
    ) -> dict:
        """What every backend's `sampling_params` builds from: config.sampling_kwargs with the
        stops of stop_token_list added to `stop_strings` / `stop_token_ids`. Stop strings without
        a tokenizer: ValueError."""
        config_strings, config_ids = gc.parse_stop_list(self.config.stop_token_list, self.tokenizer)
        stop = [*config_strings, *stop_strings]
        if stop and self.tokenizer is None:
            raise ValueError(
                f"stop strings {stop} need a tokenizer to match text, and this model has none: add "
                "one (tokenizer files in the model directory, or the `tokenizer` key), or remove "
                "them (stop_token_list / stop_strings); without a tokenizer only EOS stops"
            )
        return gc.sampling_kwargs(
            self.config,
            prompt_len,
            is_eval=is_eval,
            greedy=greedy,
            stop_strings=stop,
            stop_token_ids=[*config_ids, *stop_token_ids],
        )

    async def stream(self, prompts: list, params, deltas: bool = False):
        """Generate for `prompts` (lists of token ids) with `params` (one `sampling_params`
        result for all, or a list with one per prompt); yield (prompt index, request output) as
        each finishes (deltas: every step's new tokens as they come, the last one finished; each
        delta's samples carry the `weight_versions` of its tokens). Leaving the iterator early
        aborts the rest."""
        raise NotImplementedError(f"{type(self).__name__} does not stream")
        yield  # pragma: no cover

    # ------------------------------------------------------------------ weights

    def weight_manifest(self) -> dict:
        """{HF name: shape} of every weight the model takes (what a full sync must send): from
        its config.json for a family of chatgen/models, else (any family an fsdp trainer trains)
        the checkpoint's own."""
        if self.hf_config.get("model_type") not in models.supported():
            return hf_weight_shapes(self.model_provider())
        return layout.hf_param_shapes(models.spec_from_hf_config(self.hf_config))

    def load_weights(self, buckets, mode: str = "wait") -> int:
        """Write HF-named weights: `buckets`, an iterable of lists of (HF name, full tensor),
        each bucket holding whole layers (chatgen.param_sync streams them so). Returns the new
        weight version (0 = the weights the model started with, +1 per call). mode, for requests
        in flight: wait (run them to the end under the old weights first), keep (they continue
        under the new ones), recompute (they are re-prefilled under the new ones), abort (they
        end now). If a write fails after the old weights were released, the module refuses to
        generate (`needs_resync` says why) until a later full write succeeds."""
        raise NotImplementedError(f"{type(self).__name__} does not take weights")

    def update_weights(self, named_tensors, mode: str = "wait") -> int:
        """Write (HF name, tensor) pairs (any iterable; a generator streams) as one update; see
        `load_weights`."""
        return self.load_weights([named_tensors], mode)

    @property
    def weight_version(self) -> int:
        """0 at start, +1 per weight update."""
        raise NotImplementedError

    @property
    def needs_resync(self) -> str | None:
        """Why the module refuses to generate (a weight write failed midway), or None."""
        return None

    @property
    def health_problem(self) -> str | None:
        """Why the module cannot serve now (e.g. its engine hangs), or None; /health answers 503."""
        return None

    # ------------------------------------------------------------------ memory and serving control

    def sleep(self, level: int = 1) -> None:
        """Between episodes: free the device memory the engine holds, for a colocated trainer."""

    def wake_up(self, tags: list | None = None) -> None:
        """Before generating again after `sleep`: everything, or only `tags` ("weights" first,
        for a weight sync while a colocated trainer still holds its memory; then "kv_cache")."""

    def is_sleeping(self) -> bool:
        return False

    def pause(self) -> None:
        """Stop running requests until `resume`; weights can still be updated (modes keep /
        recompute / abort)."""
        raise NotImplementedError(f"{type(self).__name__} cannot pause")

    def resume(self) -> None:
        raise NotImplementedError(f"{type(self).__name__} cannot pause")

    def reset_prefix_cache(self) -> bool:
        """Drop cached prompt KV that no request holds; returns whether the cache was reset."""
        return True

    def check_tokenizer(self, tokenizer_from, model_dir) -> None:
        """Setup's checks of the tokenizer (set) against the config and the model (vocab_size
        set): a chat template when chat_template is true; no more tokens than the model has rows
        (ConfigError); fewer: a warning."""
        if self.config.chat_template and not getattr(self.tokenizer, "chat_template", None):
            raise ConfigError(
                [
                    f"chat_template: true, but the tokenizer of {tokenizer_from} has no chat template; set "
                    "it to false (and use prompt_template), or use a tokenizer that has one"
                ]
            )
        if self.tokenizer is not None:
            mismatch = gc.check_vocab(
                len(self.tokenizer), self.vocab_size, tokenizer_from, model_dir
            )
            if mismatch:
                logger.warning("%s: %s", self.name, mismatch)

    def _decode_texts(self, request_outputs) -> None:
        """Fill the text of samples generated without detokenization, in one batch decode, so
        that hooks and outputs always see texts. A sample that stopped on a stop string was
        detokenized (stop strings need it) and its text cut before the string: it is left as it
        is, even when that text is empty."""
        if self.tokenizer is None:
            return
        todo = [
            s
            for _, s in iter_samples(request_outputs)
            if not s.text and s.token_ids and not isinstance(s.stop_reason, str)
        ]
        for sample, text in zip(
            todo,
            self.tokenizer.batch_decode(
                [list(s.token_ids) for s in todo], skip_special_tokens=True
            ),
        ):
            sample.text = text
