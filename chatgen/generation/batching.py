"""Token batches in and out of `VLLMModule.generate`: right-padding checks (`verify_right_padding`,
public in chatgen.generation), the output tensors, the rows of a batch one worker takes
(`select_rows`) and several workers' row streams merged as they come (`interleave`) (no vLLM).

Input: right-padded `input_ids` (B, T) + `input_lengths` (B,). Output: S = B x n rows, sample j of
prompt i at row i * n + j, each prompt + generation right-padded to T + the longest generation.
Unit-tested in tests/unit/test_generation.py on stand-ins for vLLM's RequestOutput.
"""

import asyncio
import contextlib

import torch

from chatgen.core.rollout import RolloutBatch, Sample


def unpad_batch(batch, pad_token_id) -> list:
    """B lists of prompt token ids, or a ValueError naming the first bad row and the fix."""
    for key in ("input_ids", "input_lengths"):
        if key not in batch:
            raise ValueError(
                f"generate(): batch has no {key!r}; pass right-padded input_ids (B, T) and "
                "input_lengths (B,)"
            )
    ids, lengths = torch.as_tensor(batch["input_ids"]), torch.as_tensor(batch["input_lengths"])
    for key, t in (("input_ids", ids), ("input_lengths", lengths)):
        if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
            raise ValueError(
                f"generate(): {key} is a {t.dtype} tensor; pass token ids and lengths as an integer "
                "tensor (torch.long)"
            )
    if ids.dim() != 2 or lengths.shape != (ids.shape[0],):
        raise ValueError(
            f"generate(): input_ids must be (B, T) and input_lengths (B,); got {tuple(ids.shape)} "
            f"and {tuple(lengths.shape)}"
        )
    stops = batch.get("stop_strings")
    if stops is not None and (isinstance(stops, str) or len(stops) != ids.shape[0]):
        raise ValueError(
            f"generate(): stop_strings must be a list with one entry per row ({ids.shape[0]}), each a "
            f"list of strings or None; got {stops!r}"
        )
    for i, row_stops in enumerate(stops or ()):
        if row_stops is not None and (
            isinstance(row_stops, str)
            or not isinstance(row_stops, (list, tuple))
            or not all(isinstance(s, str) and s for s in row_stops)
        ):
            raise ValueError(
                f"generate(): stop_strings[{i}] = {row_stops!r}; give a list of non-empty strings "
                f"(e.g. [{row_stops!r}] for one stop string) or None"
            )
    stop_ids = batch.get("stop_token_ids")
    if stop_ids is not None and (
        not isinstance(stop_ids, (list, tuple))
        or len(stop_ids) != ids.shape[0]
        or not all(row is None or isinstance(row, (list, tuple)) for row in stop_ids)
    ):
        raise ValueError(
            f"generate(): stop_token_ids must be a list with one entry per row ({ids.shape[0]}), each a "
            f"list of token ids or None (e.g. [[2]] * {ids.shape[0]} to stop every row at id 2); got "
            f"{stop_ids!r:.200}"
        )
    for i, row_ids in enumerate(stop_ids or ()):
        if row_ids is not None and not all(type(t) is int and t >= 0 for t in row_ids):
            raise ValueError(
                f"generate(): stop_token_ids[{i}] = {row_ids!r}; give a list of token ids (int >= 0) "
                "or None"
            )
    for i, n in enumerate(lengths.tolist()):
        if not 1 <= n <= ids.shape[1]:
            raise ValueError(
                f"generate(): row {i}: input_lengths[{i}]={n} is outside 1..{ids.shape[1]}"
            )
    verify_right_padding(batch, pad_token_id, raise_error=True)
    return [row[:n] for row, n in zip(ids.tolist(), lengths.tolist())]


def verify_right_padding(data, pad_value: int = 0, raise_error: bool = False) -> tuple:
    """Check that every row of a batch is right-padded: its tokens first, then only `pad_value`.

    data: {"input_ids" (B, T), "input_lengths" (B,)} (a generation input) or {"output_ids" (B, L),
    "unpadded_sequence_lengths" (B,)} (a generation output). Returns (True, None), or (False,
    message) naming each offending row: a length beyond the row's width, positions past the length
    that hold something other than the pad; raise_error raises a ValueError with that message
    instead.
    """
    for ids_key, lengths_key in (
        ("input_ids", "input_lengths"),
        ("output_ids", "unpadded_sequence_lengths"),
    ):
        if ids_key in data and lengths_key in data:
            break
    else:
        raise ValueError(
            "verify_right_padding: data needs input_ids + input_lengths or output_ids + "
            f"unpadded_sequence_lengths; it has {sorted(data)}"
        )
    ids, lengths = torch.as_tensor(data[ids_key]), torch.as_tensor(data[lengths_key])
    problems = [  # a length past the row's width (NeMo RL refuses it too)
        f"{lengths_key}[{row}]={int(lengths[row])} exceeds the width {ids.shape[1]} of {ids_key}"
        for row in (lengths > ids.shape[1]).nonzero().flatten().tolist()
    ]
    positions = torch.arange(ids.shape[1])[None, :]
    # (B, T): a non-pad token after the length
    bad = (positions >= lengths[:, None]) & (ids != pad_value)
    if not bad.any() and not problems:
        return True, None
    for row in bad.any(dim=1).nonzero().flatten().tolist():
        cols = bad[row].nonzero().flatten().tolist()
        shown = ", ".join(map(str, cols[:8])) + (", ..." if len(cols) > 8 else "")
        problems.append(
            f"row {row} is not right-padded: {lengths_key}[{row}]={int(lengths[row])} but "
            f"{ids_key}[{row}] holds tokens other than the pad {pad_value} at positions {shown}"
        )
    message = "; ".join(problems) + (
        "; put each sequence first and the padding after it, lengths within the width"
    )
    if raise_error:
        raise ValueError(f"generate(): {message}" if ids_key == "input_ids" else message)
    return False, message


def select_rows(batch, share: list) -> dict:
    """The rows `share` of a batch: tensors and per-row lists indexed, other entries as they are."""
    rows = len(batch["input_ids"])
    out = {}
    for key, value in batch.items():
        if torch.is_tensor(value) and value.dim() and len(value) == rows:
            out[key] = value[share]
        elif isinstance(value, list) and len(value) == rows:
            out[key] = [value[i] for i in share]
        else:
            out[key] = value
    return out


async def interleave(streams: list):
    """(share, row, output) of several async iterators [(share, iterator)] as each yields;
    closing this one cancels them all (each closes its iterator: the worker aborts the requests
    left)."""
    queue, done = asyncio.Queue(), object()

    async def pump(share, stream):
        try:
            async with contextlib.aclosing(stream) as rows:
                async for row, out in rows:
                    queue.put_nowait((share, row, out))
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which raises it
            queue.put_nowait(e)
        finally:
            queue.put_nowait(done)

    tasks = [asyncio.ensure_future(pump(share, stream)) for share, stream in streams]
    left = len(tasks)
    try:
        while left:
            item = await queue.get()
            if item is done:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def iter_samples(request_outputs):
    """(RequestOutput, CompletionOutput) for every sample: prompts in the given order, samples by
    index."""
    for request in request_outputs:
        for sample in sorted(request.outputs, key=lambda s: s.index):
            yield request, sample


def sample_logprobs(sample) -> list:
    """The logprob of each generated token of a `CompletionOutput` (requested with logprobs=0);
    0.0 each when it was requested without (an item with "logprobs": False)."""
    if sample.logprobs is None:
        return [0.0] * len(sample.token_ids)
    values = getattr(sample.logprobs, "token_logprobs", None)  # vllm/adapter/sampled_logprobs.py
    if values is not None:
        return list(values)
    return [step[token].logprob for step, token in zip(sample.logprobs, sample.token_ids)]


def prompt_logprobs(request) -> list:
    """log p(prompt[t] | prompt[:t]) for every prompt position, 0.0 at t = 0 (requires
    prompt_logprobs set)."""
    steps, tokens = request.prompt_logprobs, request.prompt_token_ids
    return [0.0] + [steps[t][tokens[t]].logprob for t in range(1, len(tokens))]


def generation_output(
    request_outputs, input_width: int, pad_token_id: int, dtype=torch.long
) -> dict:
    """Finished requests (sorted) -> output_ids / logprobs (S, L), generation_lengths /
    unpadded_sequence_lengths / truncated (S,), with L = input_width + the longest generation;
    plus prompt_logprobs (S, L) (0 outside the prompt) when the requests asked for them, and
    weight_versions (S, L): the engine's weight version of each generated token
    (`sample.weight_versions`, set by the engine loop), -1 on prompt and padding."""
    samples = list(iter_samples(request_outputs))
    width = input_width + max((len(s.token_ids) for _, s in samples), default=0)
    output_ids = torch.full((len(samples), width), pad_token_id, dtype=dtype)
    logprobs = torch.zeros((len(samples), width), dtype=torch.float32)
    prompt_lengths = torch.tensor([len(r.prompt_token_ids) for r, _ in samples], dtype=torch.long)
    generation_lengths = torch.tensor([len(s.token_ids) for _, s in samples], dtype=torch.long)
    versions = torch.full((len(samples), width), -1, dtype=torch.long)
    for row, (request, sample) in enumerate(samples):
        p, g = len(request.prompt_token_ids), len(sample.token_ids)
        output_ids[row, : p + g] = torch.tensor(
            [*request.prompt_token_ids, *sample.token_ids], dtype=dtype
        )
        logprobs[row, p : p + g] = torch.tensor(sample_logprobs(sample), dtype=torch.float32)
        if getattr(sample, "weight_versions", None) is not None:
            versions[row, p : p + g] = torch.tensor(sample.weight_versions, dtype=torch.long)
    out = {
        "output_ids": output_ids,
        "logprobs": logprobs,
        "generation_lengths": generation_lengths,
        "unpadded_sequence_lengths": prompt_lengths + generation_lengths,
        "truncated": torch.tensor(
            [s.finish_reason == "length" for _, s in samples], dtype=torch.bool
        ),
        "weight_versions": versions,
    }
    if samples and samples[0][0].prompt_logprobs is not None:
        out["prompt_logprobs"] = torch.zeros((len(samples), width), dtype=torch.float32)
        for row, (request, _) in enumerate(samples):
            out["prompt_logprobs"][row, : len(request.prompt_token_ids)] = torch.tensor(
                prompt_logprobs(request)
            )
    return out


def call_metrics(request_outputs, elapsed: float) -> dict:
    """Figures of one generation call that took `elapsed` seconds (`module.metrics`)."""
    prompt_tokens = sum(len(o.prompt_token_ids) for o in request_outputs)
    generation_tokens = sum(len(s.token_ids) for _, s in iter_samples(request_outputs))
    return {
        "prompts": len(request_outputs),
        "samples": sum(len(o.outputs) for o in request_outputs),
        "prompt_tokens": prompt_tokens,
        "generation_tokens": generation_tokens,
        "elapsed_s": elapsed,
        "prompt_tokens_per_s": prompt_tokens / elapsed,
        "generation_tokens_per_s": generation_tokens / elapsed,
    }


def rollout_batch(request_outputs, pad_token_id: int):
    """Finished requests (sorted by request id = prompt order) -> a
    `chatgen.core.rollout.RolloutBatch`, prompt-major."""
    samples = [
        Sample(
            prompt_ids=list(request.prompt_token_ids),
            response_ids=list(sample.token_ids),
            response_logprobs=sample_logprobs(sample),
            prompt_index=k,
            text=sample.text or "",
            prompt_text=request.prompt,
            finish_reason=sample.finish_reason or "abort",
            prompt_logprobs=prompt_logprobs(request)
            if request.prompt_logprobs is not None
            else None,
            weight_versions=getattr(sample, "weight_versions", None),
            routed_experts=getattr(sample, "routed_experts", None),
        )
        for k, request in enumerate(request_outputs)
        for sample in sorted(request.outputs, key=lambda s: s.index)
    ]
    return RolloutBatch.from_samples(samples, pad_token_id)


def assign(costs: list, outstanding: list) -> list:
    """Which prompts go to which replica: [prompt indices of replica i, ascending]. Largest
    first, each to the replica with the fewest tokens outstanding (`outstanding`, plus what this
    call gave it so far)."""
    load, shares = list(outstanding), [[] for _ in outstanding]
    for i in sorted(range(len(costs)), key=lambda i: -costs[i]):
        replica = min(range(len(load)), key=lambda r: load[r])
        shares[replica].append(i)
        load[replica] += costs[i]
    return [sorted(share) for share in shares]
