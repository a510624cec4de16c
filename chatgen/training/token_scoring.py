"""What `MegatronModule`'s per-token outputs are: by default each token's log-prob under the model's
logits (divided by a sampling temperature when set); a head that is not a token distribution
overrides `token_outputs` (the PPO critic, chatgen/training/critic.py).

`TokenScoring` is a mixin of `chatgen.training.megatron_module.MegatronModule`.

Without tensor parallelism or top-k / top-p truncation the log-probs come from `token_logprobs`, which
holds no tensor of vocabulary width but the logits themselves: megatron-core's cross entropy copies
the (b, T-1, V) slice of the logits, keeps its softmax for the backward and the slice's backward makes
a third (b, T, V) tensor; at SmolLM2's 49152-token vocabulary each is 0.2 GiB for a 16-sample
micro-batch (docs/long_context.md, "SmolLM2's memory, per phase").
"""

import torch

# rows of logits a step of token_logprobs works on: ~32 MiB of fp32 temporaries at a 49152 vocabulary
CHUNK_ELEMENTS = 8 << 20


class _TokenLogProbs(torch.autograd.Function):
    """log-softmax(logits)[label] per position, computed and differentiated a chunk of rows at a
    time; the backward writes the gradient into the saved logits (nothing else reads them: the output
    layer's backward needs its input and weight, not its output). The arithmetic is megatron-core's
    `_VocabParallelCrossEntropy` at TP 1 (max subtracted, exp, sum, log; grad softmax - onehot), so
    values and gradients are the same bits."""

    @staticmethod
    def forward(ctx, logits, labels):
        v = logits.shape[-1]
        rows, targets = logits.view(-1, v), labels.reshape(-1)
        maxes = torch.empty(rows.shape[0], dtype=rows.dtype, device=rows.device)
        sums, out = torch.empty_like(maxes), torch.empty_like(maxes)
        step = max(1, CHUNK_ELEMENTS // v)
        for i in range(0, rows.shape[0], step):
            chunk = rows[i : i + step]
            m = torch.max(chunk, dim=-1)[0]
            shifted = chunk - m.unsqueeze(-1)
            picked = shifted.gather(-1, targets[i : i + step, None]).squeeze(-1)
            s = torch.exp(shifted, out=shifted).sum(dim=-1)
            maxes[i : i + step], sums[i : i + step] = m, s
            out[i : i + step] = -(torch.log(s) - picked)
        ctx.save_for_backward(logits, targets, maxes, sums)
        return out.view(labels.shape)

    @staticmethod
    def backward(ctx, grad_out):
        logits, targets, maxes, sums = ctx.saved_tensors
        v = logits.shape[-1]
        rows, grads = logits.view(-1, v), grad_out.reshape(-1)
        step = max(1, CHUNK_ELEMENTS // v)
        for i in range(0, rows.shape[0], step):
            chunk = rows[i : i + step]  # becomes this chunk's gradient, in place
            chunk.sub_(maxes[i : i + step, None]).exp_().div_(sums[i : i + step, None])
            index = torch.arange(chunk.shape[0], device=chunk.device)
            chunk[index, targets[i : i + step]] -= 1.0
            chunk.mul_(-grads[i : i + step, None])
        return logits, None


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log p(labels[i, t]) under softmax(logits[i, t]): logits (b, T, V) float32, labels (b, T) long;
    returns (b, T) float32, differentiable in logits. A row it scores for nothing still needs a valid
    label (any id; its output is ignored, its gradient is then 0 as the caller's is). Backward
    overwrites the logits with their gradient: pass a tensor no one else reads."""
    return _TokenLogProbs.apply(logits.contiguous(), labels)


class TokenScoring:
    """The `token_outputs` hook and the temperature it scores at (uses the module's `tp_rank`,
    `spec` and `name`)."""

    def token_outputs(self, logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """Hook: the model's per-token outputs, from its logits. Called on the last pipeline stage
        by `forward_tokens` and `train_step` (with gradient).

        logits: (b, T, V/TP) vocab-parallel (this rank's vocab shard); input_ids: (b, T). Returns
        (b, T-1) float32: entry t belongs to token t+1. Default: its log-prob (vocab-parallel
        log-softmax; padded vocab rows, ids >= the HF vocab, are masked so the distribution is
        HF's). Override for a head that is not a token distribution, e.g. a PPO critic
        (chatgen/training/critic.py).
        """
        from megatron.core import tensor_parallel

        whole = self.tp == 1 and not self.truncates  # every position at once: token_logprobs
        logits = logits.float() if whole else logits[:, :-1].float()
        if self.logits_temperature != 1.0:  # what a policy sampling at that temperature draws from
            logits = logits / self.logits_temperature
        shard = logits.shape[-1]
        first = self.tp_rank * shard
        if first + shard > self.spec.vocab_size:
            col = torch.arange(first, first + shard, device=logits.device)
            logits = logits.masked_fill(col >= self.spec.vocab_size, -1e30)
        if whole:
            # the last position scores nothing: label 0 there, its output dropped, its gradient 0
            return token_logprobs(logits, torch.nn.functional.pad(input_ids[:, 1:], (0, 1)))[:, :-1]
        labels = input_ids[:, 1:].contiguous()
        if self.truncates:
            logits = self.truncate(logits, labels, first, self.tp > 1)
        return -tensor_parallel.vocab_parallel_cross_entropy(logits.contiguous(), labels)

    @property
    def truncates(self) -> bool:
        """Whether token_outputs renormalises over a top-k / top-p set (the config's logits_top_k
        / logits_top_p; an RLHF run derives them from the policy's sampling)."""
        top_k = getattr(self.config, "logits_top_k", None)  # a user config class may lack them
        top_p = getattr(self.config, "logits_top_p", None)
        return bool(top_k and top_k > 0) or (top_p is not None and top_p < 1)

    def truncate(self, logits, labels, first: int = 0, vocab_parallel: bool = False):
        """logits (b, T-1, V/TP) after the temperature, with the tokens outside vLLM's top-k then
        top-p set of each position at -1e30 (chatgen.core.truncation), so that the log-softmax
        is the engine's processed log-prob. Under tensor parallelism the set is decided on the
        whole vocabulary (the shards gathered, without gradient) and each rank keeps its slice
        from `first`. The scored token (labels, (b, T-1)) always stays: a token the engine drew
        is in its set anyway, and a prompt token or one an update pushed out keeps a finite
        log-prob."""
        from chatgen.core.truncation import top_k_top_p_keep

        with torch.no_grad():
            whole = logits
            if vocab_parallel:
                from megatron.core import tensor_parallel

                whole = tensor_parallel.gather_from_tensor_model_parallel_region(logits.detach())
            rows = whole.reshape(-1, whole.shape[-1])
            keep = top_k_top_p_keep(
                rows, self.config.logits_top_k or 0, self.config.logits_top_p or 1.0
            )
            keep = keep.view(*whole.shape)[..., first : first + logits.shape[-1]]
            col = torch.arange(first, first + logits.shape[-1], device=logits.device)
            keep = keep | (col == labels[..., None])
        return logits.masked_fill(~keep, -1e30)

    @property
    def logits_temperature(self) -> float:
        """token_outputs' divisor: the config's logits_temperature (an RLHF run derives it from
        the policy's sampling temperature when the model's role scores the policy's samples); 1.0
        = the model's own distribution. A head that overrides token_outputs (a critic) ignores
        it."""
        return self.config.logits_temperature or 1.0
