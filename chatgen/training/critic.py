"""A PPO critic on megatron-core (`value_trainer: {backend: megatron, model_class:
chatgen.training.critic:CriticModule}`) or on the fsdp trainer (`backend: fsdp, model_class:
chatgen.training.critic:FSDPCriticModule`): the policy's architecture whose output at each position
is a value, not a distribution over tokens.

The value head is one row of the output layer: V(prefix up to t) = logit of token `VALUE_TOKEN` at
position t, i.e. a linear head on the final hidden state. Reusing a row keeps everything else of
MegatronModule as is: loading the HF checkpoint, TP/PP sharding, checkpoints, the optimizer. The row
of a rarely used token (<unk>, id 0) is spent on it; this model is a separate copy, so the policy
keeps its own.

`forward_tokens` therefore returns values (B, T-1), aligned with the policy's log-probs: entry t is
the value of the prefix that token t+1 is sampled from.
"""

import torch

from chatgen.training.fsdp_module import FSDPModule
from chatgen.training.megatron_module import MegatronModule

VALUE_TOKEN = 0


class CriticModule(MegatronModule):
    def token_outputs(self, logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """(b, T, V/TP) vocab-parallel logits -> (b, T-1) float32 values, with gradient."""
        from megatron.core import tensor_parallel

        shard = logits.shape[-1]
        owner = VALUE_TOKEN // shard  # the TP rank whose vocab shard holds the value row
        local = logits[:, :-1, VALUE_TOKEN % shard].float()
        if self.tp == 1:
            return local
        local = local if self.tp_rank == owner else torch.zeros_like(local)
        # the owner's values, every rank
        return tensor_parallel.reduce_from_tensor_model_parallel_region(local)


class FSDPCriticModule(FSDPModule):
    """The same value head on the fsdp trainer (`value_trainer: {backend: fsdp, model_class:
    chatgen.training.critic:FSDPCriticModule}`): the logit of `VALUE_TOKEN`, all of the
    vocabulary on every rank."""

    def token_outputs(self, logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """(b, T, V) logits -> (b, T-1) float32 values, with gradient."""
        return logits[:, :-1, VALUE_TOKEN].float()
