"""`chatgen.VLLMGeneration`: vLLM generation for any PyTorch trainer: `generate` token ids, `sync_weights` from a model.

    from chatgen import VLLMGeneration
    gen = VLLMGeneration("outputs/tiny-llama-sft", max_completion_length=16)      # colocate: engine in this process
    prompt_ids, completion_ids, logprobs = gen.generate([[1, 77, 5, 9]], num_generations=4)
    ...a training step on a transformers model...
    gen.sync_weights(model)                  # nn.Module (HF names; DDP/FSDP/compile unwrapped), (name, tensor) pairs,
                                             # or a chatgen MegatronModule

The generator knows nothing of the trainer: it is built from generation parameters and fed weights. Colocate mode
runs a `VLLMModule` in this process and writes weights with `chatgen.param_sync.sync_weights` (manifest and
finiteness checked before anything is written: a refused sync leaves the engine on its old weights).
Guide and example: docs/vllm_generation.md, examples/grpo_with_hf_trainer.py.
"""
import dataclasses

import torch

MODES = ("colocate",)


class VLLMGeneration:
    """A vLLM engine on the HF model directory `model`, with sampling fixed at construction.

    Sampling: temperature, top_p, top_k (0 = off), min_p, repetition_penalty; max_completion_length tokens per
    completion, stopping at EOS (kept in the completion). max_model_length: prompt + completion tokens at most
    (None = the model's max_position_embeddings); a prompt longer than max_model_length - max_completion_length
    is an error. logprobs: 0 = return the log-prob of each sampled token (the only value supported).
    engine_kwargs: further per-model generation keys (docs/generation_keys.md), e.g. dtype, seed,
    kv_cache_memory_bytes, enforce_eager, logprobs_mode ("raw" makes log-probs those of the untempered model,
    what a trainer computes; the default "processed" is after temperature / top-k / top-p).
    """

    def __init__(self, model, mode="colocate", *, server_base_url=None, api_key=None, tensor_parallel_size=1,
                 max_model_length=None, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0,
                 max_completion_length=16, logprobs=0, **engine_kwargs):
        if mode not in MODES:
            raise ValueError(f"VLLMGeneration: mode={mode!r} is not one of {MODES}")
        if logprobs != 0:
            raise ValueError(f"VLLMGeneration: logprobs={logprobs!r}; only 0 (the sampled token's log-prob) is "
                             "supported")
        if top_k < 0:
            raise ValueError(f"VLLMGeneration: top_k={top_k}; use 0 to turn top-k off, or a positive count")
        from chatgen.generation.vllm_module import VLLMModule

        self.mode = mode
        config = dict(load=str(model), tensor_parallel_size=tensor_parallel_size, seq_length=max_model_length,
                      temperature=temperature, top_p=top_p, top_k=top_k or -1, min_p=min_p,
                      repetition_penalty=repetition_penalty, new_token_limit=True,
                      max_new_tokens=max_completion_length, **engine_kwargs)
        self.module = VLLMModule(config, name="generation").start()

    def generate(self, prompts, num_generations=1, greedy=False):
        """Sample `num_generations` completions of each prompt.

        prompts: list of prompts, each a non-empty list[int] of token ids. greedy: decode greedily (one
        completion per prompt: num_generations must be 1). Returns (prompt_ids, completion_ids, logprobs): three
        lists of len(prompts) * num_generations entries, prompt-major (completion j of prompt i at
        i * num_generations + j): the prompt's ids, the completion's ids (ending with EOS unless the length
        limit stopped it), and the log-prob of each completion token (list[float], same length).
        """
        if num_generations < 1:
            raise ValueError(f"generate: num_generations={num_generations}; ask for at least 1")
        if greedy and num_generations > 1:
            raise ValueError(f"generate: greedy decoding gives one completion per prompt; got num_generations="
                             f"{num_generations}: pass num_generations=1, or greedy=False to sample")
        for i, p in enumerate(prompts):
            if not isinstance(p, (list, tuple)) or not p or not all(isinstance(t, int) for t in p):
                raise ValueError(f"generate: prompts[{i}] must be a non-empty list of token ids (int), got {p!r:.80}")
        module = self.module
        module.config = dataclasses.replace(module.config, n=num_generations)
        width = max(map(len, prompts))
        input_ids = torch.full((len(prompts), width), module.pad_token_id, dtype=torch.long)
        for i, p in enumerate(prompts):
            input_ids[i, :len(p)] = torch.tensor(p)
        out = module.generate({"input_ids": input_ids, "input_lengths": torch.tensor(list(map(len, prompts)))},
                              greedy=greedy)
        prompt_ids, completion_ids, logprobs = [], [], []
        ends, generated = out["unpadded_sequence_lengths"].tolist(), out["generation_lengths"].tolist()
        for row, (end, n) in enumerate(zip(ends, generated)):
            prompt_ids.append(out["output_ids"][row, :end - n].tolist())
            completion_ids.append(out["output_ids"][row, end - n:end].tolist())
            logprobs.append(out["logprobs"][row, end - n:end].tolist())
        return prompt_ids, completion_ids, logprobs

    def sync_weights(self, source):
        """Write `source`'s weights into the engine; returns a `chatgen.param_sync.SyncReport`.

        source: a `torch.nn.Module` with Hugging Face parameter names (a transformers model; DDP / FSDP /
        torch.compile wrappers unwrapped), an iterable of (HF name, tensor), or a chatgen `MegatronModule`.
        Names, shapes and finiteness are checked before anything is written: on a mismatch a `SyncError` names
        the parameters and the engine keeps its old weights. The prefix cache is reset after the write (vLLM's
        reload alone keeps KV computed with the old weights). Call between `generate` calls.
        """
        from chatgen.param_sync import sync_weights

        return sync_weights(source, self.module)

    def shutdown(self) -> None:
        """Stop the engine and free its memory."""
        self.module.shutdown()
