"""CPU stand-ins for the NeMo RL pieces its generation tests build around VllmGeneration (its BatchedDataDict,
configure_generation_config, get_tokenizer, RayVirtualCluster, the HF `Policy` trainer and
refit_policy_generation), written for chatgen's tests from their documented behaviour, on the tiny models.
The class under test is chatgen's own: chatgen.compat.nemo_rl.VllmGeneration.
"""

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from chatgen.param_sync import GroupSender


class BatchedDataDict(dict):
    """NeMo RL's batch dict: tensors with one row per sample, sliced and re-joined."""

    def make_microbatch_iterator(self, microbatch_size: int):
        rows = len(next(iter(self.values())))
        for start in range(0, rows, microbatch_size):
            yield BatchedDataDict({k: v[start : start + microbatch_size] for k, v in self.items()})

    @classmethod
    def from_batches(cls, batches: list, pad_value_dict: dict | None = None):
        """One batch of `batches`, 2-D tensors right-padded to the widest (pad_value_dict[key], else 0)."""
        out = cls()
        for key in batches[0]:
            parts = [b[key] for b in batches]
            if parts[0].dim() == 2:
                width = max(p.shape[1] for p in parts)
                fill = (pad_value_dict or {}).get(key, 0)
                parts = [
                    torch.nn.functional.pad(p, (0, width - p.shape[1]), value=fill) for p in parts
                ]
            out[key] = torch.cat(parts)
        return out


def get_tokenizer(tokenizer_config: dict):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_config["name"])
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def configure_generation_config(config: dict, tokenizer, is_eval: bool = False) -> dict:
    """What NeMo RL's configure_generation_config writes into a vLLM generation config."""
    config["_pad_token_id"] = tokenizer.pad_token_id
    if config["stop_token_ids"] is None:
        config["stop_token_ids"] = [tokenizer.eos_token_id]
    config["vllm_cfg"]["load_format"] = "auto" if is_eval else "dummy"
    config["_mtp_weights_from_refit"] = False
    if "skip_tokenizer_init" not in config["vllm_cfg"]:
        config["vllm_cfg"]["skip_tokenizer_init"] = not (
            is_eval or config["stop_strings"] is not None
        )
    return config


class RayVirtualCluster:
    """The test's two-device cluster: VllmGeneration(cluster, config) makes world_size() workers."""

    def __init__(self, num_gpus_per_node: int = 2):
        self.num_gpus_per_node = num_gpus_per_node

    def world_size(self) -> int:
        return self.num_gpus_per_node

    def shutdown(self) -> None:
        pass


class Policy:
    """NeMo RL's trainer as far as refit goes: the HF model in fp32, its refit info (every name of its
    state dict, a tied model's lm_head.weight too, as NeMo RL's trainers send it) and its weights sent."""

    def __init__(self, cluster, config: dict, tokenizer):
        self.model = AutoModelForCausalLM.from_pretrained(
            config["model_name"], torch_dtype=torch.float32
        )

    def prepare_refit_info(self) -> dict:
        return {n: (t.shape, t.dtype) for n, t in self.model.state_dict().items()}

    def add_noise_to_weights(self, scale: float = 0.05) -> None:
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * scale)

    def weights(self) -> list:
        return list(self.model.state_dict().items())

    def stream_weights_via_ipc_zmq(self, generation) -> dict:
        """NeMo RL pairs the trainer's ZMQ socket with the engine on its device; here the generation's
        IpcStream is that socket."""
        return generation.ipc_stream().send(self.weights())

    def shutdown(self) -> None:
        pass


def refit_policy_generation(policy: Policy, generation, colocated: bool) -> None:
    """NeMo RL's refit: colocated by IPC (shared memory here), else by the trainer's broadcast, waited on."""
    if colocated:
        generation.prepare_for_generation()
        policy.stream_weights_via_ipc_zmq(generation)
        assert all(f.result() for f in generation.update_weights_via_ipc_zmq())
        return
    sender = GroupSender(generation.token, 1 + generation.inference_world_size)
    futures = generation.init_collective(sender.host, sender.port, 1 + len(generation.workers))
    sender.connect()
    [f.result() for f in futures]
    futures = generation.update_weights_from_collective()
    sender.send(policy.weights())
    assert all(f.result() for f in futures)
    sender.close()
