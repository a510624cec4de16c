"""Atomic episode checkpoints and the driver state a resume needs.

Layout under `save_dir`:

    episode_000010/              one complete checkpoint (appears only once everything is in it)
        engine_state.json        episode, data position, driver RNG state, written last
        policy_trainer/ ...      whatever each trainable model's save(path) wrote (weights, optimizer, RNG)
    latest                       text file naming the newest complete checkpoint ("episode_000010")

A checkpoint is written into a hidden staging directory and moved into place once complete, and `latest` is
replaced the same way (chatgen.checkpoint_io's atomic writes), so a crash at any point leaves the previous
checkpoint intact and `latest` pointing at it. The trainer actors write into the temporary directory, so on a multi-node cluster
`save_dir` must be on a filesystem every node sees.
"""
import json
import random
from pathlib import Path

import torch

from chatgen.checkpoint_io import atomic_file, begin_directory, commit_directory, staging_path

STATE_FILE = "engine_state.json"


def episode_dir_name(episode: int) -> str:
    return f"episode_{episode:06d}"


def begin_checkpoint(save_dir, episode: int) -> Path:
    """Create (fresh) the staging directory the checkpoint of `episode` is written into; returns it."""
    return begin_directory(Path(save_dir) / episode_dir_name(episode))


def commit_checkpoint(staging: Path, state: dict) -> Path:
    """Write `state` as engine_state.json into the staged checkpoint (from `begin_checkpoint`), move it into place
    (replacing the same episode's checkpoint after a resume), then point `latest` at it."""
    final = Path(staging).parent / episode_dir_name(state["episode"])
    if Path(staging) != staging_path(final):
        raise ValueError(f"{staging} is not the staging directory of episode {state['episode']}")
    save_dir = final.parent
    with atomic_file(Path(staging) / STATE_FILE) as tmp:
        tmp.write_text(json.dumps(state, indent=1))
    commit_directory(final)
    with atomic_file(Path(save_dir) / "latest") as tmp:
        tmp.write_text(final.name + "\n")
    return final


def latest_checkpoint(save_dir) -> Path | None:
    """The newest complete checkpoint under save_dir, or None when there is none."""
    save_dir = Path(save_dir)
    pointer = save_dir / "latest"
    if pointer.exists():
        candidate = save_dir / pointer.read_text().strip()
        if (candidate / STATE_FILE).exists():
            return candidate
    # `latest` missing or stale: fall back to the highest complete episode directory.
    done = sorted(p for p in save_dir.glob("episode_*") if (p / STATE_FILE).exists()) if save_dir.exists() else []
    return done[-1] if done else None


def load_state(checkpoint_dir) -> dict:
    with open(Path(checkpoint_dir) / STATE_FILE, encoding="utf-8") as f:
        return json.load(f)


def rng_state() -> dict:
    """The driver's Python and torch RNG state as JSON-safe values."""
    return {"python": _to_json(random.getstate()), "torch": torch.get_rng_state().tolist()}


def set_rng_state(state: dict) -> None:
    random.setstate(_to_tuple(state["python"]))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))


def _to_json(x):
    return [_to_json(v) for v in x] if isinstance(x, (tuple, list)) else x


def _to_tuple(x):
    return tuple(_to_tuple(v) for v in x) if isinstance(x, list) else x


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
