"""The run's prompts: train and held-out records, the items the policy made of them, and the order they are drawn in.

    data = RunData(cfg.runtime, records_per_episode=8)    # reads runtime.data_path / eval_data_path
    data.prepare(policy_handle, log)                       # the policy's build_dataset on every record, once
    index = data.sampler.next_batch()                      # this episode's records (deterministic, resumable)

`order` is what the sequence of prompts depends on (seed, batch size, the data file's contents): a checkpoint
records it, and a resume with another order is refused unless runtime.allow_data_order_change says otherwise.
"""
import hashlib

import torch

from chatgen.core.jsonl import read_prompt_records
from chatgen.rlhf.checkpoint import CheckpointError
from chatgen.rlhf.health import check_cut_prompts


class PromptSampler:
    """Deterministic batches of prompt indices: a fresh permutation per pass, resumable from (epoch, index).

    The state is two integers, so resuming at episode k+1 draws exactly the prompts an uninterrupted run
    would have drawn.
    """

    def __init__(self, num_prompts: int, batch_size: int, seed: int, shuffle: bool = True):
        if num_prompts < batch_size:
            raise ValueError(f"the dataset has {num_prompts} prompts, fewer than one batch of {batch_size}")
        self.num_prompts, self.batch_size, self.seed, self.shuffle = num_prompts, batch_size, seed, shuffle
        self.epoch, self.index = 0, 0

    def _order(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_prompts))
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.num_prompts, generator=g).tolist()

    def next_batch(self) -> list[int]:
        if self.index + self.batch_size > self.num_prompts:  # drop the ragged tail, start the next pass
            self.epoch, self.index = self.epoch + 1, 0
        batch = self._order()[self.index: self.index + self.batch_size]
        self.index += self.batch_size
        return batch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.index = state["epoch"], state["index"]


def file_digest(path) -> str:
    """sha256 of a file (the data order of a run depends on its contents)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class RunData:
    """Records of runtime.data_path (and eval_data_path), their sampler, and the policy's items for both."""

    def __init__(self, rt, records_per_episode: int):
        self.records = read_prompt_records(rt.data_path)
        self.eval_records = read_prompt_records(rt.eval_data_path) if rt.eval_data_path else []
        self.sampler = PromptSampler(len(self.records), records_per_episode, rt.seed)
        self.order = {"seed": rt.seed, "records_per_episode": records_per_episode, "records": len(self.records),
                      "data_sha256": file_digest(rt.data_path)}
        self.items = self.eval_items = None

    def prepare(self, policy, max_cut_fraction: float, log) -> None:
        """The policy's dataset items of every train and held-out record (`prepare_dataset`, once per run); too
        many prompts cut to the prompt budget stop the run (chatgen.rlhf.health)."""
        self.items = policy.first("prepare_dataset", [r["prompt"] for r in self.records])
        self.eval_items = policy.first("prepare_dataset", [r["prompt"] for r in self.eval_records], True)
        check_cut_prompts(self.items, max_cut_fraction, log)

    def check_order(self, saved: dict, path, allow_change: bool) -> None:
        """Refuse (CheckpointError) to resume checkpoint `path`, saved with data order `saved`, under another one."""
        changed = {k: (saved.get(k), v) for k, v in self.order.items() if saved.get(k) != v}
        if changed and not allow_change:
            raise CheckpointError(
                f"{path} was saved with another data order ({', '.join(f'{k}: {a} -> {b}' for k, (a, b) in changed.items())}"
                "); its data position would apply to a different order of the prompts. Resume with the checkpoint's "
                "settings, or set runtime.allow_data_order_change=true to accept that")
