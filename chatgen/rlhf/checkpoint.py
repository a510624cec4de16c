"""Atomic episode checkpoints and the driver state a resume needs.

Layout under `save_dir`:

    episode_000010/              one complete checkpoint (appears only once everything is in it)
        engine_state.json        episode, data position and order, RNG states of the driver and of every actor
        manifest.json            every other file of the checkpoint with its size, checked before a resume
        policy_trainer/ ...      whatever each trainable model's save(path) wrote (weights, optimizer)
    latest                       text file naming the newest complete checkpoint ("episode_000010")

A checkpoint is written into a hidden staging directory and moved into place once complete, and
`latest` is replaced the same way (chatgen.core.checkpoint_io's atomic writes), so a crash at any
point leaves the previous checkpoint intact and `latest` pointing at it. The trainer actors write
into the staging directory, so on a multi-node cluster `save_dir` must be on a filesystem every node
sees. A checkpoint damaged afterwards (a file deleted or truncated) is refused at resume with the
file named and the previous checkpoint suggested.

`lock_output_dir` keeps two runs from writing into one output directory. A new output directory and
every checkpoint are this user's only (0700), engine_state.json, manifest.json and `latest` 0600;
the config kept in engine_state.json is masked like every config chatgen writes
(chatgen.config.loader.mask_secrets).
"""

import errno
import fcntl
import json
import os
import random
from pathlib import Path

import torch
from safetensors import safe_open

from chatgen.config.loader import mask_secrets
from chatgen.core.checkpoint_io import (
    begin_directory,
    commit_directory,
    staging_path,
    write_private_text,
)

STATE_FILE = "engine_state.json"
MANIFEST_FILE = "manifest.json"
LOCK_FILE = ".chatgen.lock"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be resumed from; the message names the file and the way out."""


def lock_output_dir(out_dir):
    """Hold an exclusive lock on `out_dir` for this process's life (released when it exits, however it exits);
    a second run into the same directory fails at once naming the first one's pid. A new `out_dir` is made
    0700; the lock file is opened without following a link planted at its name (its target would be
    truncated)."""
    out_dir = Path(out_dir)
    try:
        out_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        handle = os.fdopen(os.open(out_dir / LOCK_FILE, flags, 0o600), "r+")
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise OSError(
                f"{out_dir / LOCK_FILE} is a symbolic link; chatgen opens no lock through a link (its "
                "target would be overwritten): remove the link"
            ) from None
        raise OSError(
            f"runtime.output_dir: cannot write into {out_dir} ({e.strerror or e}); choose a directory "
            "this user can create and write"
        ) from None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "unknown"
        handle.close()
        raise FileExistsError(
            f"{out_dir} is in use by another chatgen run (pid {holder}); wait for it to finish or "
            "choose another runtime.output_dir"
        ) from None
    handle.truncate(0)
    handle.write(str(os.getpid()))
    handle.flush()
    return handle


def episode_dir_name(episode: int) -> str:
    return f"episode_{episode:06d}"


def begin_checkpoint(save_dir, episode: int) -> Path:
    """Create (fresh) the staging directory the checkpoint of `episode` is written into (0700, as
    is a new save_dir); returns it."""
    Path(save_dir).mkdir(mode=0o700, parents=True, exist_ok=True)
    staging = begin_directory(Path(save_dir) / episode_dir_name(episode))
    staging.chmod(0o700)
    return staging


def commit_checkpoint(staging: Path, state: dict) -> Path:
    """Write `state` as engine_state.json into the staged checkpoint (from `begin_checkpoint`),
    move it into place (replacing the same episode's checkpoint after a resume), then point
    `latest` at it. A `config` in `state` is written masked (mask_secrets: secret-named keys,
    text read through ${VAR})."""
    final = Path(staging).parent / episode_dir_name(state["episode"])
    if Path(staging) != staging_path(final):
        raise ValueError(f"{staging} is not the staging directory of episode {state['episode']}")
    save_dir = final.parent
    files = {
        str(f.relative_to(staging)): f.stat().st_size
        for f in sorted(Path(staging).rglob("*"))
        if f.is_file()
    }
    write_private_text(Path(staging) / MANIFEST_FILE, json.dumps(files, indent=1))
    if "config" in state:
        state = {**state, "config": mask_secrets(state["config"])}
    # last: its presence marks a complete checkpoint
    write_private_text(Path(staging) / STATE_FILE, json.dumps(state, indent=1))
    commit_directory(final)
    write_private_text(Path(save_dir) / "latest", final.name + "\n")
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
    done = (
        sorted(p for p in save_dir.glob("episode_*") if (p / STATE_FILE).exists())
        if save_dir.exists()
        else []
    )
    return done[-1] if done else None


def resume_point(save_dir, resume_from=None) -> Path:
    """The checkpoint to resume from: `resume_from` (a checkpoint directory, or an episode
    directory name under save_dir), else the latest. Verified (`verify_checkpoint`); a
    CheckpointError says what to do."""
    save_dir = Path(save_dir)
    if resume_from is not None:
        path = Path(resume_from)
        path = path if path.is_dir() else save_dir / str(resume_from)
        if not path.is_dir():  # a flag naming no checkpoint: the input must change (exit 2)
            raise FileNotFoundError(
                f"--resume-from {resume_from}: no checkpoint there; the checkpoints of this run "
                f"are {', '.join(available(save_dir)) or 'none'}"
            )
    else:
        path = latest_checkpoint(save_dir)
        if path is None:
            raise FileNotFoundError(
                f"--resume: no complete checkpoint under {save_dir}; start without --resume"
            )
    problems = verify_checkpoint(path)
    if problems:
        earlier = [name for name in available(save_dir) if name < path.name]
        fix = (
            f"resume from the previous one with --resume-from {earlier[-1]}"
            if earlier
            else "no earlier checkpoint exists: start the run again"
        )
        raise CheckpointError(
            f"checkpoint {path} is damaged: {'; '.join(problems)}; {fix} (or restore the file)"
        )
    return path


def available(save_dir) -> list[str]:
    """Names of the complete checkpoints under save_dir, oldest first."""
    save_dir = Path(save_dir)
    return (
        sorted(p.name for p in save_dir.glob("episode_*") if (p / STATE_FILE).exists())
        if save_dir.exists()
        else []
    )


def verify_checkpoint(path) -> list[str]:
    """Problems of a checkpoint on disk: unreadable state, files of its manifest missing or of
    another size."""
    path = Path(path)
    try:
        load_state(path)
        files = json.loads((path / MANIFEST_FILE).read_text())
    except (OSError, ValueError) as e:
        return [f"{e.filename or path / MANIFEST_FILE} cannot be read ({type(e).__name__}: {e})"]
    problems = []
    for name, size in files.items():
        f = path / name
        if not f.is_file():
            problems.append(f"{f} is missing")
        elif f.stat().st_size != size:
            problems.append(f"{f} has {f.stat().st_size} bytes, {size} when saved")
        # overwritten in place: its header (names, offsets) must still parse
        elif f.suffix == ".safetensors":
            try:
                with safe_open(str(f), framework="pt") as weights:
                    weights.keys()
            except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
                problems.append(f"{f} is not a readable safetensors file ({type(e).__name__}: {e})")
    return problems


def load_state(checkpoint_dir) -> dict:
    with open(Path(checkpoint_dir) / STATE_FILE, encoding="utf-8") as f:
        return json.load(f)


def rng_state() -> dict:
    """This process's Python, NumPy and torch (CPU and CUDA) RNG states as JSON-safe values."""
    state = {"python": _to_json(random.getstate()), "torch": torch.get_rng_state().tolist()}
    if torch.cuda.is_available():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    try:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = [kind, keys.tolist(), pos, has_gauss, gauss]
    except ImportError:
        pass
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(_to_tuple(state["python"]))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))


def _to_json(x):
    return [_to_json(v) for v in x] if isinstance(x, (tuple, list)) else x


def _to_tuple(x):
    return tuple(_to_tuple(v) for v in x) if isinstance(x, list) else x
