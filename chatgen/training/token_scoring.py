"""What `MegatronModule`'s per-token outputs are: by default each token's log-prob under the model's
logits (divided by a sampling temperature when set); a head that is not a token distribution
overrides `token_outputs` (the PPO critic, chatgen/training/critic.py).

`TokenScoring` is a mixin of `chatgen.training.megatron_module.MegatronModule`.
"""

import torch


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

        logits = logits[:, :-1].float()
        if self.logits_temperature != 1.0:  # what a policy sampling at that temperature draws from
            logits = logits / self.logits_temperature
        shard = logits.shape[-1]
        first = self.tp_rank * shard
        if first + shard > self.spec.vocab_size:
            col = torch.arange(first, first + shard, device=logits.device)
            logits = logits.masked_fill(col >= self.spec.vocab_size, -1e30)
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
