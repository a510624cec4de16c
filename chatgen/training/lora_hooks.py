"""`MegatronModule`'s LoRA methods (chatgen/training/lora.py has the adapters themselves): its
base as the KL reference, its adapter alone as a weight source, and the adapter exported as
PEFT's directory. A file of its own because it uses lora_sync.py and lora_peft.py, which build on
lora.py."""

import torch

from chatgen.module import remote
from chatgen.training import lora
from chatgen.training.lora_peft import export_peft
from chatgen.training.lora_sync import AdapterWeights


class LoRAHooks:
    """`MegatronModule`'s LoRA methods (a mixin): its base as the KL reference, its adapter for a
    sync."""

    @remote("split")
    def base_forward_tokens(self, data: dict) -> torch.Tensor:
        """`forward_tokens` of the base model (every adapter off): a LoRA policy's KL reference,
        from the same weights, no second copy. Without adapters it is `forward_tokens`."""
        with lora.adapter_disabled(self.model):
            return self.forward_tokens(data)

    def adapter_weights(self):
        """The adapter alone as a weight source (PEFT's names), for an adapter-only sync
        (chatgen.param_sync.adapter_sync); collective at its first use."""
        return AdapterWeights(self)

    def export_adapter(self, directory) -> str:
        """Write the adapter as a PEFT adapter directory (chatgen/training/lora_peft.py);
        collective."""
        return export_peft(self, directory)
