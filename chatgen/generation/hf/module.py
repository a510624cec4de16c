"""`HFGeneration` (`backend: hf`): generation with a transformers model, one token at a time, in
this process.

    from chatgen.generation.hf.module import HFGeneration        # or a model entry's `backend: hf`
    policy = HFGeneration({"load": "outputs/tiny-llama", "new_token_limit": True, "max_new_tokens": 16}).start()
    batch = policy.run_generation(policy.prepare_dataset(["sort: 3 1 2 ="]))   # a chatgen.core.rollout.RolloutBatch
    out = policy.generate({"input_ids": ids, "input_lengths": lengths}, greedy=True)     # token in / token out
    chatgen.param_sync.sync_weights(trainer, policy)                           # HF names, copied in place

A call's prompts run in batches of whole prompts (up to generation_batch_size sequences: each of a
prompt's n samples is a row), left-padded with an attention mask, prefilled once, then decoded with
the KV cache one forward per token until every row has stopped. Each token is chosen as vLLM's
sampler chooses it (sampling.py) and each row stops as vLLM stops a request: the tokenizer's EOS
(finish_reason "stop"), a stop token id (generation config EOS ids and special-token entries of
stop_token_list; stop_reason = the id), a stop string on the decoded text (stop_reason = the string,
the text cut before it), else max_tokens ("length").

One generation call or weight write runs at a time (a lock): a write waits for the running call, so
every `load_weights` mode acts as "wait" and every token of a call has one weight version.
docs/hf_backend.md.
"""

import asyncio
import itertools
import threading
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from chatgen.config import ConfigError
from chatgen.generation import config as gc
from chatgen.generation.base import (
    UPDATE_MODES,
    Completion,
    FinishedRequest,
    GenerationModule,
    TokenLogprob,
)
from chatgen.generation.batching import call_metrics
from chatgen.generation.hf.config import HFConfig
from chatgen.generation.hf.sampling import (
    RowSettings,
    SamplingParams,
    next_tokens,
    stop_string_at,
    top_logprobs,
)

DEFAULT_BATCH_SEQUENCES = 256  # generation_batch_size: null (vLLM's max_num_seqs default on CPU)


class HFGeneration(GenerationModule):
    """A transformers generation model. Construct with its per-model config, `start()` it, then
    generate.

    config: an `HFConfig`, a dict of its keys, or the path of a per-model YAML
    (docs/generation_keys.md). Attributes after `setup()`: `model` (the transformers model, eval
    mode, on CUDA when there is one, else CPU), `tokenizer`, `pad_token_id`, `vocab_size`,
    `hf_config`, `metrics` (figures of the last call), `config`. Sampling keys are read at every
    call.
    """

    config_class = HFConfig

    def __init__(self, config=None, *, name: str | None = None, config_dialect: str = "chatgen"):
        super().__init__(config, name=name, config_dialect=config_dialect)
        self.model = None
        self._lora_base = None  # {HF name: base weight} of the adapted weights (load_lora_adapter)
        self.device = None
        self._generator = None  # the sampling draws, seeded once at setup() (vLLM's engine seed)
        self._eos = None  # the tokenizer's EOS: stops with no stop_reason (vLLM's eos_token_id)
        self._eos_stops = ()  # generation_config's other EOS ids: stop tokens unless ignore_eos
        self._lock = threading.Lock()
        self._version = 0
        self._broken = None
        self._request_ids = itertools.count()

    # ------------------------------------------------------------------ setup

    def setup(self) -> None:
        """Load the model and tokenizer of `model_provider()` (load_format dummy: random weights
        of its shape, seeded by `seed`, for a policy whose weights come from a trainer's sync).
        Override to add work around it and call `super().setup()`."""
        model_dir = self.model_provider()
        if not (Path(model_dir) / "config.json").is_file():
            raise ConfigError(
                [
                    f"load: {model_dir} has no config.json; the hf backend loads a Hugging Face model "
                    "directory (convert a chatgen Megatron checkpoint with `chatgen convert --to hf`)"
                ]
            )
        self.config = cfg = gc.resolve_seq_length(self.config, model_dir)
        tokenizer_dir = gc.tokenizer_dir(cfg, model_dir)
        if gc.has_tokenizer(tokenizer_dir):
            self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        hf = AutoConfig.from_pretrained(model_dir)
        dtype = getattr(torch, cfg.dtype)
        if cfg.load_format == "dummy":
            # seeded random weights, the caller's RNG left as it was
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(cfg.seed)
                model = AutoModelForCausalLM.from_config(hf, dtype=dtype)
        else:
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.model = model.to(self.device).eval().requires_grad_(False)
        self.hf_config = hf.to_dict()
        self.vocab_size = hf.vocab_size
        self.pad_token_id = gc.pad_token_id(self.tokenizer, model_dir, self.config.pad_token_id)
        self.check_tokenizer(tokenizer_dir, model_dir)
        # vLLM's EOS rule (SamplingParams.update_from_generation_config): the tokenizer's EOS, and
        # the EOS ids of generation_config.json (else of config.json) as stop tokens
        try:
            generation = GenerationConfig.from_pretrained(model_dir)
        except OSError:
            generation = GenerationConfig.from_model_config(hf)
        self._eos = getattr(self.tokenizer, "eos_token_id", None)
        eos = generation.eos_token_id
        self._eos_stops = tuple(
            i for i in ([eos] if isinstance(eos, int) else eos or ()) if i != self._eos
        )
        self._generator = torch.Generator(self.device).manual_seed(cfg.seed)

    # ------------------------------------------------------------------ generation

    def sampling_params(
        self, prompt_len, *, is_eval=False, greedy=False, stop_strings=(), stop_token_ids=()
    ) -> SamplingParams:
        """The settings of one prompt of `prompt_len` tokens (config.sampling_kwargs): train or
        eval sampling keys, stop_token_list plus `stop_strings` and `stop_token_ids`."""
        return SamplingParams(
            **self.sampling_kwargs(
                prompt_len,
                is_eval=is_eval,
                greedy=greedy,
                stop_strings=stop_strings,
                stop_token_ids=stop_token_ids,
            )
        )

    def finished(self, items: list, is_eval: bool = False, greedy: bool = False) -> list:
        for i, item in enumerate(items):
            self.check_item(item, f"run_generation: item {i}")
        params = [
            self.sampling_params(
                len(item["input_ids"]),
                is_eval=is_eval,
                greedy=greedy or item.get("greedy", False),
                stop_strings=item.get("stop_strings") or (),
            )
            for item in items
        ]
        start = time.perf_counter()
        prompts, texts = (
            [item["input_ids"] for item in items],
            [item.get("prompt") for item in items],
        )
        batches = list(self._batches(prompts, params, texts))
        outputs = [output for batch in batches for _, output in batch]
        # forward passes: a batch runs until its longest sample ends (the prefill gives its first
        # token)
        steps = sum(
            max(len(s.token_ids) for _, output in batch for s in output.outputs)
            for batch in batches
        )
        self.metrics = {**call_metrics(outputs, time.perf_counter() - start), "engine_steps": steps}
        return outputs

    async def stream(self, prompts: list, params, deltas: bool = False):
        """See GenerationModule.stream. Each batch of prompts runs on a worker thread; its
        prompts are yielded when it ends, each as one finished output (with deltas too: one delta
        holding every token). Leaving the iterator early drops the batches not started."""
        per_prompt = list(params) if isinstance(params, list) else [params] * len(prompts)
        for i, ids in enumerate(prompts):
            if not ids:
                raise ValueError(
                    f"stream: prompt {i} is empty; every prompt needs at least one token (e.g. BOS)"
                )
        batches = self._batches(prompts, per_prompt)
        while (batch := await asyncio.to_thread(next, batches, None)) is not None:
            for i, output in batch:
                yield i, output

    def _batches(self, prompts, params, texts=None):
        """Generate `prompts` (token id lists, one SamplingParams each) in batches of whole
        prompts of at most generation_batch_size sequences; yield each batch's [(prompt index,
        FinishedRequest)] as it ends."""
        limit = self.config.generation_batch_size or DEFAULT_BATCH_SEQUENCES
        groups, size = [[]], 0
        for i, p in enumerate(params):
            if groups[-1] and size + p.n > limit:
                groups.append([])
                size = 0
            groups[-1].append(i)
            size += p.n
        for group in groups:
            if group:
                with self._lock:
                    self._check_ready()
                    outputs = self._generate(
                        [prompts[i] for i in group], [params[i] for i in group]
                    )
                for i, output in zip(group, outputs):
                    output.prompt = texts[i] if texts else None
                yield list(zip(group, outputs))

    @torch.inference_mode()
    def _generate(self, prompts: list, params: list) -> list:
        """One batch: a FinishedRequest per prompt, its params.n samples each (rows
        prompt-major). Each prompt is prefilled once; its KV cache is then copied to each of its
        samples' rows."""
        device, width = self.device, max(map(len, prompts))
        ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        # left padding: every row's next token is at the last position
        for k, prompt in enumerate(prompts):
            ids[k, width - len(prompt) :] = torch.tensor(prompt)
            mask[k, width - len(prompt) :] = 1
        ids, mask = ids.to(device), mask.to(device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        want_prompt = any(p.prompt_logprobs is not None for p in params)
        # 0: every position's logits
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=0 if want_prompt else 1,
        )
        prompt_logprobs = [
            self._prompt_logprobs(out.logits[k], prompt, params[k].prompt_logprobs)
            if params[k].prompt_logprobs is not None
            else None
            for k, prompt in enumerate(prompts)
        ]
        row_prompt = [k for k, p in enumerate(params) for _ in range(p.n)]
        row_params = [params[k] for k in row_prompt]
        rows, index = len(row_prompt), torch.tensor(row_prompt, device=device)
        seen = None  # (rows, V): the tokens of each row's prompt and output, for the repetition penalty
        if any(p.repetition_penalty != 1 for p in row_params):
            seen = torch.zeros((len(prompts), self.vocab_size), dtype=torch.bool, device=device)
            seen[mask.nonzero(as_tuple=True)[0], ids[mask.bool()]] = True
            seen = seen[index]
        # (prompts, ...) -> (rows, ...): n copies of each prompt
        out.past_key_values.batch_select_indices(index)
        logits, mask, positions = out.logits[index, -1], mask[index], positions[index]
        settings = RowSettings.of(row_params, device)
        tokens = [[] for _ in range(rows)]
        logprobs = [[] for _ in range(rows)]
        ends = [None] * rows  # (finish_reason, stop_reason, text or None) once the row has stopped
        for _ in range(max(p.max_tokens for p in row_params)):
            chosen, dist = next_tokens(
                logits, settings, seen, self._generator, self.config.logprobs_mode
            )
            chosen_list = chosen.tolist()
            chosen_logprobs = dist.gather(1, chosen[:, None])[:, 0].tolist()
            for r in range(rows):
                if ends[r] is None:
                    tokens[r].append(chosen_list[r])
                    top = (
                        top_logprobs(dist[r], chosen_list[r], row_params[r].logprobs)
                        if row_params[r].logprobs
                        else {chosen_list[r]: chosen_logprobs[r]}
                    )
                    logprobs[r].append({t: TokenLogprob(lp) for t, lp in top.items()})
                    ends[r] = self._stop(tokens[r], row_params[r])
            if all(ends):
                break
            if seen is not None:
                seen[torch.arange(rows, device=device), chosen] = True
            mask = torch.cat([mask, mask.new_ones((rows, 1))], dim=1)
            positions = positions[:, -1:] + 1
            out = self.model(
                input_ids=chosen[:, None],
                attention_mask=mask,
                position_ids=positions,
                past_key_values=out.past_key_values,
                use_cache=True,
            )
            logits = out.logits[:, -1]
        texts = (
            self.tokenizer.batch_decode(tokens, skip_special_tokens=True)
            if self.tokenizer
            else [""] * rows
        )
        requests = [
            FinishedRequest(
                request_id=str(next(self._request_ids)),
                prompt_token_ids=list(prompt),
                outputs=[],
                prompt_logprobs=prompt_logprobs[k],
            )
            for k, prompt in enumerate(prompts)
        ]
        for r, k in enumerate(row_prompt):
            finish_reason, stop_reason, text = ends[r]
            requests[k].outputs.append(
                Completion(
                    index=len(requests[k].outputs),
                    token_ids=tokens[r],
                    logprobs=logprobs[r],
                    text=texts[r] if text is None else text,
                    finish_reason=finish_reason,
                    stop_reason=stop_reason,
                    weight_versions=[self._version] * len(tokens[r]),
                )
            )
        return requests

    def _stop(self, tokens: list, params: SamplingParams):
        """(finish_reason, stop_reason, text cut before a stop string or None) once a row's last
        token stops it, else None. vLLM's order: EOS, stop token ids, stop strings, then the
        token limit."""
        last = tokens[-1]
        if last == self._eos and not params.ignore_eos:
            return "stop", None, None
        if last in params.stop_token_ids or (last in self._eos_stops and not params.ignore_eos):
            return "stop", last, None
        if params.stop:
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
            stop, at = stop_string_at(text, params.stop)
            if stop is not None:
                return "stop", stop, text[:at]
        if len(tokens) >= params.max_tokens:
            return "length", None, None
        return None

    @staticmethod
    def _prompt_logprobs(logits, prompt: list, n: int) -> list:
        """vLLM's prompt_logprobs of one prompt from its row's (width, V) logits (left-padded):
        None for the first token, then {token id: TokenLogprob} of each prompt token (and the n
        most likely) under the raw model."""
        logprobs = logits[logits.shape[0] - len(prompt) : -1].float().log_softmax(dim=-1)
        return [None] + [
            {t: TokenLogprob(lp) for t, lp in top_logprobs(row, token, n).items()}
            for row, token in zip(logprobs, prompt[1:])
        ]

    def _check_ready(self) -> None:
        if self.model is None:
            raise RuntimeError(f"{type(self).__name__}: call setup() before generating")
        if self._broken:
            raise RuntimeError(self._broken)

    # ------------------------------------------------------------------ weights

    def load_weights(self, buckets, mode: str = "wait") -> int:
        """See GenerationModule.load_weights. Each bucket is checked (names and shapes against
        the model's parameters) before any of its tensors is copied in; a tied LM head is the
        embedding (an `lm_head.weight` sent for a tied model is skipped, as vLLM skips it). A
        write waits for the running generation call, so every mode acts as "wait". If it fails
        once a tensor was copied, the module refuses to generate (`needs_resync`) until a later
        write of every parameter succeeds."""
        if mode not in UPDATE_MODES:
            raise ValueError(f"load_weights: mode={mode!r}; use one of {', '.join(UPDATE_MODES)}")
        if self.model is None:
            raise RuntimeError(f"{type(self).__name__}: call setup() before writing weights")
        parameters = dict(self.model.named_parameters())
        tied = self.model.config.get_text_config().tie_word_embeddings
        written = set()
        self._lora_base = None  # the written weights are the base an adapter goes on
        with self._lock, torch.no_grad():
            try:
                for bucket in buckets:
                    bucket = [
                        (name, t) for name, t in bucket if not (tied and name == "lm_head.weight")
                    ]
                    for name, t in bucket:
                        _check_tensor(parameters, name, t)
                    for name, t in bucket:
                        parameters[name].copy_(t)
                        written.add(name)
            except BaseException as e:
                if written:
                    self._broken = (
                        f"a weight update failed after writing {len(written)} tensors ({type(e).__name__}: "
                        f"{e}); the model holds a mix of old and new weights and needs a re-sync: it "
                        "refuses to generate until all weights are written again (load_weights / "
                        "chatgen.param_sync.sync_weights with the full set)"
                    )
                raise
            if written == set(parameters):
                self._broken = None
            self._version += 1
            return self._version

    def load_lora_adapter(self, directory) -> None:
        """`load_lora_tensors` of the PEFT LoRA adapter in `directory`."""
        from chatgen.models.lora_format import read_peft

        self.load_lora_tensors(*read_peft(directory, key=str(directory)))

    def load_lora_tensors(self, config: dict, tensors: dict) -> int:
        """Run the base weights plus this LoRA adapter (adapter_config.json as a dict, tensors by
        PEFT name; merged in fp32), replacing the previous adapter: the base of each adapted
        weight is kept from the first adapter on (adapter-only sync, docs/lora.md; a later
        load_weights makes its weights the base). Needs enable_lora. Returns the new weight
        version."""
        from chatgen.models.lora_format import adapted_weights, check_finite_adapter, merge_lora

        if not self.config.enable_lora:
            raise ValueError(
                f"{self.name}: load_lora_tensors needs enable_lora: true in its config"
            )
        check_finite_adapter(tensors, f"{self.name}: load_lora_tensors")
        parameters = dict(self.model.named_parameters())
        with self._lock, torch.no_grad():
            self._lora_base = self._lora_base or {}
            for name in adapted_weights(tensors):
                self._lora_base.setdefault(name, parameters[name].detach().clone())
            weights = {name: base.clone() for name, base in self._lora_base.items()}
            # weights the previous adapter had and this one lacks: the base
            merge_lora(weights, config, tensors)
            for name, w in weights.items():
                parameters[name].copy_(w)
            self._version += 1
            return self._version

    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def needs_resync(self) -> str | None:
        return self._broken

    def shutdown(self) -> None:
        """Drop the model (its memory goes with the last reference)."""
        self.model = None


def _check_tensor(parameters: dict, name: str, t) -> None:
    """ValueError naming a tensor the model has no parameter for, or one of the wrong shape."""
    if name not in parameters:
        raise ValueError(
            f"load_weights: the model has no parameter {name!r}; send Hugging Face names "
            "(e.g. model.layers.0.self_attn.q_proj.weight), as chatgen.param_sync does"
        )
    if tuple(t.shape) != tuple(parameters[name].shape):
        raise ValueError(
            f"load_weights: {name} has shape {tuple(t.shape)}, the model's is "
            f"{tuple(parameters[name].shape)}"
        )
