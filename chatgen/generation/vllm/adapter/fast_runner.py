"""Exact shortcuts through vLLM 0.32's CPU model runner's per-step Python.

Each engine step the model runner prepares its inputs and files the sampled tokens with code
written for GPUs and every feature (device copies, Triton kernels, speculative decoding, async
scheduling). On the tiny model's 256-prompt evaluation three pieces of it cost more than the work
they do (docs/long_context.md, issue 52's evaluation item, issue 48's per-step cost):

- the KV-cache slot of each scheduled token: on CPU a C++ op that runs an OpenMP parallel region
  for ~256 numbers, which waits for torch's other intra-op thread (~10 us alone, 0.1-1.4 ms when
  the two shared cores are busy); here numpy computes the same slots on this thread;
- the "host to device" copies of the runner's buffers, whose device side on CPU is the host
  tensor itself (torch returns at once; the Python around each call remains): skipped;
- `_bookkeeping_sync`'s loop writing each request's sampled token into the input batch (three
  numpy item writes and a list extend per request and step, ~1.6 us each): one array write per
  step and the list appends.

Each falls back to vLLM's code outside its plain case. `RELIES_ON` names the vLLM code each
mirrors (checked with adapter/patches.py's by tests/integration/test_vllm_patches.py), and
tests/integration/test_vllm_step_fast_paths.py generates with and without them and compares.
"""

import numpy as np

_RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
_BLOCK_TABLE = "vllm.v1.worker.block_table:BlockTable"
# what the shortcuts need of vLLM, in patches.RELIES_ON's form
RELIES_ON = {
    "plain_step_fast_paths": [
        # _numpy_slot_mapping
        (
            f"{_BLOCK_TABLE}.compute_slot_mapping",
            ("self", "num_reqs", "query_start_loc", "positions"),
        ),
        (f"{_BLOCK_TABLE}.compute_slot_mapping", "self.slot_mapping.gpu,"),
        (f"{_BLOCK_TABLE}.compute_slot_mapping", "self.block_table.gpu,"),
        (
            "vllm.utils.cpu_triton_utils:_compute_slot_mapping_kernel_impl",
            "compute_slot_mapping_kernel_impl(",
        ),
        ("vllm.platforms.cpu:CpuPlatform", "cpu_tl._compute_slot_mapping_kernel_impl"),
        "vllm.triton_utils:HAS_TRITON",
        # _no_self_copies
        (
            "vllm.v1.utils:CpuGpuBuffer.copy_to_gpu",
            "return gpu.copy_(cpu.pin_memory() if PIN_MEMORY else cpu",
        ),
        ("vllm.v1.worker.cpu_model_runner:CPUModelRunner._postprocess_tensors", "v.gpu = v.cpu"),
        # _plain_bookkeeping
        (
            f"{_RUNNER}._bookkeeping_sync",
            (
                "self",
                "scheduler_output",
                "sampler_output",
                "logits",
                "hidden_states",
                "num_scheduled_tokens",
            ),
        ),
        (f"{_RUNNER}._bookkeeping_sync", "gen.set_offset(gen.get_offset() - 4)"),
        (f"{_RUNNER}._bookkeeping_sync", "with gpu_sync_allowed():"),
        (
            f"{_RUNNER}._bookkeeping_sync",
            "self.input_batch.token_ids_cpu[req_idx, start_idx:end_idx] = sampled_ids",
        ),
        (
            f"{_RUNNER}._bookkeeping_sync",
            "self.input_batch.is_token_ids[req_idx, start_idx:end_idx] = True",
        ),
        (f"{_RUNNER}._bookkeeping_sync", "self.input_batch.num_tokens_no_spec[req_idx] = end_idx"),
        (f"{_RUNNER}._bookkeeping_sync", "req_state.output_token_ids.extend(sampled_ids)"),
        (f"{_RUNNER}._bookkeeping_sync", "hidden_states[:num_scheduled_tokens],"),
        (f"{_RUNNER}.sample_tokens", ") = self._bookkeeping_sync("),
    ],
}


def plain_step_fast_paths(worker) -> None:
    """Install the shortcuts on a CPU worker's model runner (through collective_rpc; idempotent;
    nothing elsewhere). `runner.chatgen_fast_paths` lists them as (object, attribute, function):
    deleting the attribute from the object's `vars()` leaves vLLM's method (the benchmark's
    toggle)."""
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    runner = getattr(worker, "model_runner", None)
    if not isinstance(runner, CPUModelRunner) or hasattr(runner, "chatgen_fast_paths"):
        return
    installed = [
        *_no_self_copies(runner),
        *_numpy_slot_mapping(runner),
        *_plain_bookkeeping(runner),
    ]
    for owner, name, function in installed:
        setattr(owner, name, function)
    runner.chatgen_fast_paths = installed


def _numpy_slot_mapping(runner) -> list:
    """Each token's KV slot, `block_table[request, position // block_size] * block_size +
    position % block_size` (what vLLM's CPU op writes; it leaves the slots past the step's tokens
    alone), with numpy on this thread. A position past the block table goes to vLLM's op (which
    raises)."""
    from vllm.triton_utils import HAS_TRITON
    from vllm.v1.worker.block_table import SlotMappingMode

    if HAS_TRITON:  # the Triton kernel, not the CPU op
        return []
    installed = []
    for table in runner.input_batch.block_table.block_tables:
        if (
            table.slot_mapping_mode != SlotMappingMode.TOKEN_TO_KV_SLOT
            or table.dcp_world_size != 1
            or table.block_table.gpu.device.type != "cpu"
        ):
            continue
        installed.append((table, "compute_slot_mapping", _slot_mapping(table)))
    return installed


def _slot_mapping(table):
    vllm_slots = table.compute_slot_mapping
    block_size, (max_reqs, width) = table.block_size, table.block_table.gpu.shape
    blocks, slots = table.block_table.gpu.numpy().reshape(-1), table.slot_mapping.gpu.numpy()
    rows = np.arange(max_reqs, dtype=np.int64)

    def compute_slot_mapping(num_reqs, query_start_loc, positions):
        position = positions.numpy()
        request = np.repeat(rows[:num_reqs], np.diff(query_start_loc.numpy()))
        block = position // block_size
        if len(request) != len(position) or block.max(initial=0) >= width:
            return vllm_slots(num_reqs, query_start_loc, positions)
        out = slots[: len(position)]
        np.multiply(blocks.take(request * width + block), block_size, out=out, dtype=np.int64)
        out += position % block_size

    return compute_slot_mapping


def _no_self_copies(runner) -> list:
    """The buffers whose device tensor is their host tensor (`_postprocess_tensors`): copying one
    onto itself changes nothing and returns the device view."""
    from vllm.v1.utils import CpuGpuBuffer

    holders = [runner, *runner.input_batch.block_table.block_tables]
    return [
        (buffer, "copy_to_gpu", _device_view(buffer.gpu))
        for holder in holders
        for buffer in vars(holder).values()
        if isinstance(buffer, CpuGpuBuffer) and buffer.gpu is buffer.cpu
    ]


def _device_view(tensor):
    def copy_to_gpu(n=None):
        return tensor if n is None else tensor[:n]

    return copy_to_gpu


def _plain_bookkeeping(runner) -> list:
    """`_bookkeeping_sync` of a step that sampled one token a request, without async scheduling
    or NaN counting: vLLM's code but its per-request loop, which becomes one array write each for
    the tokens, their flags and the counts, and the appends to each request's output ids."""
    from vllm import envs
    from vllm.utils.gpu_sync_debug import gpu_sync_allowed

    if runner.use_async_scheduling:
        return []
    bookkeeping, max_len = runner._bookkeeping_sync, runner.max_model_len

    def bookkeeping_sync(
        scheduler_output, sampler_output, logits, hidden_states, num_scheduled_tokens
    ):
        sampled = sampler_output.sampled_token_ids
        batch = runner.input_batch
        num_reqs = batch.num_reqs
        if (
            envs.VLLM_COMPUTE_NANS_IN_LOGITS
            or sampled.shape[-1] != 1
            or sampled.shape[0] != num_reqs
            or batch.num_tokens_no_spec[:num_reqs].max(initial=0) >= max_len  # vLLM asserts
        ):
            return bookkeeping(
                scheduler_output, sampler_output, logits, hidden_states, num_scheduled_tokens
            )
        discarded = np.nonzero(runner.discard_request_mask.np[:num_reqs])[0]
        for i in discarded:
            gen = batch.generators.get(int(i))
            if gen is not None:
                gen.set_offset(gen.get_offset() - 4)
        req_ids_output_copy = batch.req_ids.copy()
        req_id_to_index_output_copy = batch.req_id_to_index.copy()
        logprobs_tensors = sampler_output.logprobs_tensors
        logprobs_lists = None
        with gpu_sync_allowed():
            valid_sampled_token_ids = runner._to_list(sampled)
            for i in discarded:
                valid_sampled_token_ids[int(i)].clear()
            if logprobs_tensors is not None:
                logprobs_lists = logprobs_tensors.tolists()
        # vLLM's loop: each kept request's token at its row's end, flagged, the row one longer
        kept = np.ones(num_reqs, dtype=bool)
        kept[discarded] = False
        rows = np.flatnonzero(kept)
        ends = batch.num_tokens_no_spec[rows]
        batch.token_ids_cpu[rows, ends] = sampled[:, 0].numpy()[rows]
        batch.is_token_ids[rows, ends] = True
        batch.num_tokens_no_spec[rows] = ends + 1
        requests = runner.requests
        for req_id, sampled_ids in zip(batch.req_ids, valid_sampled_token_ids):
            if sampled_ids:
                requests[req_id].output_token_ids.extend(sampled_ids)
        prompt_logprobs_dict = runner._get_prompt_logprobs_dict(
            hidden_states[:num_scheduled_tokens], scheduler_output.num_scheduled_tokens
        )
        return (
            {},
            None,
            logprobs_lists,
            valid_sampled_token_ids,
            prompt_logprobs_dict,
            req_ids_output_copy,
            req_id_to_index_output_copy,
            [],
        )

    return [(runner, "_bookkeeping_sync", bookkeeping_sync)]
