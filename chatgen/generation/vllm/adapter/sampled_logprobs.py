"""Sampled-token log-probs at tensor speed: `record_sampled_logprobs(llm)` makes the split step hand
each request that asks for its sampled tokens' log-probs only (`SamplingParams.logprobs == 0`, one
output when it finishes) a `SampledLogprobs` on `CompletionOutput.logprobs`, gathered once per step
for the whole batch, instead of vLLM's per-request machinery.

Why: for such a request vLLM 0.32 ranks the sampled token over the vocabulary
(`batched_count_greater_than`), slices a `LogprobsLists` per request in the scheduler and builds a
`{token: Logprob}` dict per token in the output processor, at every step. On the tiny GRPO job (256
samples of ~13 tokens per call, a 2-layer model) that was 11% of a generation call (engine only, 30
calls each way, alternating, in one process: 258 vs 290 ms with log-probs turned off altogether).
Here the sampler's own computation, `Sampler.compute_logprobs` of the raw logits (vLLM's
`logprobs_mode` "raw_logprobs", chatgen's `logprobs_mode: raw`), is gathered at the sampled tokens:
the values are the bits vLLM returns (tests/integration/test_sampled_logprobs.py), without the rank.
An engine in "processed" mode, with speculative decoding, or with its workers in other processes
keeps vLLM's path (`build_llm` installs this only where it applies).
"""

from collections.abc import Sequence

from vllm import LLM
from vllm.logprobs import Logprob
from vllm.sampling_params import RequestOutputKind


class SampledLogprobs(Sequence):
    """A sample's log-probs as vLLM gives them for `logprobs=0`, one `{token: Logprob}` per
    generated token, built when read from `token_logprobs` (each sampled token's log-prob;
    `Logprob.rank` is None: not computed)."""

    __slots__ = ("token_ids", "token_logprobs")

    def __init__(self, token_ids, token_logprobs):
        self.token_ids, self.token_logprobs = token_ids, token_logprobs

    def __len__(self) -> int:
        return len(self.token_logprobs)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return {self.token_ids[i]: Logprob(self.token_logprobs[i])}

    def __repr__(self) -> str:
        return f"SampledLogprobs({self.token_logprobs!r})"


class _SampledLogprobRecorder:
    """Each wanted request's sampled-token log-probs, one per step it was sampled in.

    `want` (after the request is added) files its engine request ids (n of them for n samples);
    the wrapped `Sampler.forward` computes the raw log-probs of those rows before vLLM samples
    (vLLM scales the logits in place after), gathers them at the sampled tokens and appends each,
    skipping the rows vLLM discards (a prefill chunk that is not a prompt's last); `hand_out`
    puts them on each finished sample."""

    def __init__(self, runner):
        self.runner = runner
        self.token_logprobs = {}  # engine request id -> [float], one per generated token
        self.sample = {}  # (request id, sample index) -> engine request id

    @staticmethod
    def takes(params, output_kind) -> bool:
        """Whether a request with these params is served here: only its sampled tokens'
        log-probs, one output when it finishes (a stream, top-k log-probs or chosen token ids
        keep vLLM's entries)."""
        return (
            output_kind == RequestOutputKind.FINAL_ONLY
            and params.logprobs == 0
            and params.logprob_token_ids is None
        )

    def want(self, request_id: str, output_processor) -> None:
        for rid in output_processor.external_req_ids.get(request_id, ()):
            state = output_processor.request_states.get(rid)
            if state is not None:
                self.token_logprobs[rid] = []
                self.sample[(request_id, state.request_index)] = rid

    def wrap(self, sampler) -> None:
        forward = sampler.forward

        def sampled_logprobs_forward(logits, sampling_metadata, *args, **kwargs):
            if not self.token_logprobs:
                return forward(logits, sampling_metadata, *args, **kwargs)
            batch = self.runner.input_batch
            ids = batch.req_ids[: batch.num_reqs]
            rows = [i for i, rid in enumerate(ids) if rid in self.token_logprobs]
            if not rows:
                return forward(logits, sampling_metadata, *args, **kwargs)
            mode = kwargs.get("logprobs_mode_override") or sampler.logprobs_mode
            if logits.shape[0] != len(ids) or mode != "raw_logprobs":
                raise RuntimeError(
                    f"chatgen's sampled log-probs: the sampler got {logits.shape[0]} rows for {len(ids)} "
                    f"requests in logprobs_mode {mode!r}; it needs one row per request and raw_logprobs "
                    "(see chatgen/generation/vllm/adapter/sampled_logprobs.py)"
                )
            every = len(rows) == len(ids)
            logprobs = sampler.compute_logprobs(logits if every else logits[rows])
            output = forward(logits, sampling_metadata, *args, **kwargs)
            tokens = output.sampled_token_ids[:, 0]
            if not every:
                tokens = tokens[rows]
            picked = logprobs.gather(1, tokens.long().unsqueeze(1)).squeeze(1).tolist()
            discard = self.runner.discard_request_mask.np
            for row, value in zip(rows, picked):
                if not discard[row]:
                    self.token_logprobs[ids[row]].append(value)
            return output

        sampler.forward = sampled_logprobs_forward

    def hand_out(self, request_outputs) -> None:
        for output in request_outputs:
            if not output.finished:
                continue
            for completion in output.outputs:
                rid = self.sample.pop((output.request_id, completion.index), None)
                if rid is None:
                    continue
                values = self.token_logprobs.pop(rid)
                if len(values) != len(completion.token_ids):
                    raise RuntimeError(
                        f"chatgen's sampled log-probs: request {output.request_id} sample {completion.index} "
                        f"has {len(completion.token_ids)} tokens but {len(values)} log-probs"
                    )
                completion.logprobs = SampledLogprobs(completion.token_ids, values)

    def forget(self, engine_request_ids) -> None:
        for rid in engine_request_ids:
            self.token_logprobs.pop(rid, None)
        gone = set(engine_request_ids)
        for key in [key for key, rid in self.sample.items() if rid in gone]:
            del self.sample[key]


def applies(llm: LLM, in_process: bool) -> bool:
    """Whether `record_sampled_logprobs` can serve this engine: its workers in this process (`in_process`:
    engine.in_process_workers, which builds the engine and this recorder), raw log-probs, no speculative
    decoding."""
    config = llm.llm_engine.vllm_config
    return (
        in_process
        and config.model_config.logprobs_mode == "raw_logprobs"
        and config.speculative_config is None
    )


def record_sampled_logprobs(llm: LLM, in_process: bool) -> None:
    """Where it `applies(llm, in_process)`, from now on requests that want only their sampled
    tokens' log-probs get them from one gather per step (see `_SampledLogprobRecorder`;
    `split_step.add_request` picks them); elsewhere the engine keeps vLLM's path
    (`llm.chatgen_sampled_logprobs` None)."""
    llm.chatgen_sampled_logprobs = None
    if not applies(llm, in_process):
        return

    def install(worker):
        runner = worker.model_runner
        if not all(hasattr(runner, a) for a in ("sampler", "input_batch", "discard_request_mask")):
            return None  # another model runner: vLLM's own log-probs (split_step.add_request)
        recorder = _SampledLogprobRecorder(runner)
        recorder.wrap(runner.sampler)
        return recorder

    llm.chatgen_sampled_logprobs = llm.collective_rpc(install)[0]
