"""A generation model's engines as one model: its replicas behind the generation contract, as the
run uses them.

    policy = runtime["policy"]                        # a GenerationGroup: num_replicas engines of T ranks each
    batch = policy.run_generation(items, is_eval)     # prompts spread over the replicas by load; one RolloutBatch
    policy.pop_metrics()                              # {"replica/<i>/samples", "replica/<i>/tokens_per_s"}

    # weights from a trainer on other devices (chatgen's names; NeMo RL's beside them, chatgen.compat.nemo_rl)
    refs = policy.open_weight_channel(ip, port, world_size)   # init_collective: every engine rank joins
    policy.check_weight_manifest({name: shape})               # prepare_refit_info: every engine checks it now
    refs = policy.receive_weights()                           # update_weights_from_collective: one broadcast
    policy.load_shared_weights(handles)                       # update_weights_via_ipc: same-host shared memory
    policy.devices()                                          # report_device_id

Replica i is ranks i*T .. i*T + T - 1 of the model's group (chatgen.rlhf.placement): colocated with
a trainer the replicas tile its ranks, alone they are a group of their own. `run_generation` gives
each prompt (with its n samples: they share a prefix-cache entry) to the replica with the fewest
outstanding tokens (prompt + budget of every sample of the prompts it is working on, across
concurrent calls), largest prompts first; the replicas generate at once, each with the contract's
`run_generation` on its own prompts, and the batches come back as one RolloutBatch in the caller's
order. With one replica every call goes to the engine unchanged. A call made inside
chatgen.generation.handover.hold_after carries its mark to the engines (their actors serve calls
concurrently when they are apart: chatgen.rlhf.runtime.engines_apart).

The weight channel is chatgen.param_sync.group: the trainer's rank 0 broadcasts each bucket once to
every engine rank of every replica; the trainer signs with `token`, this group's secret, which the
run hands to the trainer through Ray (a NeMo RL caller gives `group.token` to its trainer's sender
the same way).
"""

import secrets
import socket
import threading

import torch

from chatgen.compat.nemo_rl import NemoRLRefit
from chatgen.core.rollout import RolloutBatch
from chatgen.generation import config as gc
from chatgen.generation import handover
from chatgen.generation.batching import assign
from chatgen.param_sync import GroupReceiver, check_manifest, load_shm
from chatgen.rlhf.placement import engine_tp

RECEIVER = "group_receiver"


class GenerationGroup(NemoRLRefit):
    """The handle of a generation model (see the module docstring). Everything a model handle
    answers (`call`, `first`, `run`, `get`, `group`, `entry`, `name`) goes to every rank, as for
    any model."""

    def __init__(self, handle):
        self.handle = handle
        self.name, self.entry, self.backend, self.group = (
            handle.name,
            handle.entry,
            handle.backend,
            handle.group,
        )
        self.dp_ranks = None
        self.replicas, self.tp = handle.entry.num_replicas, engine_tp(handle.entry)
        self.token = secrets.token_hex(16)
        self._lock = threading.Lock()
        self._outstanding = [0] * self.replicas  # tokens of the prompts each replica is working on
        # samples, generated tokens, engine seconds
        self._stats = [[0, 0, 0.0] for _ in range(self.replicas)]
        self._pad_token_id = None

    def call(self, method: str, *args, **kwargs) -> list:
        return self.handle.call(method, *args, **kwargs)

    def first(self, method: str, *args, **kwargs):
        return self.handle.first(method, *args, **kwargs)

    def run(self, fn, *args) -> list:
        return self.handle.run(fn, *args)

    def get(self, refs, what, labels=None):
        return self.handle.get(refs, what, labels)

    # ---- generation
    # ---------------------------------------------------------------------------------

    def run_generation(self, items: list, is_eval: bool = False):
        """The contract's `run_generation` over the replicas: S = items x n samples, prompt-major
        in the order of `items` (a RolloutBatch; with one replica, whatever the engine's
        decode_internal returns)."""
        hold = handover.requested()  # the caller's mark, carried into the actors' threads
        if self.replicas == 1 and hold is None:
            return self.first("run_generation", items, is_eval)
        if self.replicas == 1:
            return self.run(_generate, self.name, items, is_eval, hold)[0][0]
        costs = [
            self._samples(is_eval) * (len(item["input_ids"]) + self.entry.config.max_new_tokens)
            for item in items
        ]
        with self._lock:
            shares = assign(costs, self._outstanding)
            for replica, share in enumerate(shares):
                self._outstanding[replica] += sum(costs[i] for i in share)
        try:
            # a replica without prompts is not called
            per_rank = [
                (self.name, [items[i] for i in shares[r // self.tp]], is_eval, hold)
                if shares[r // self.tp]
                else None
                for r in range(self.group.world_size)
            ]
            called = [r for r, args in enumerate(per_rank) if args is not None]
            results = self.get(
                self.group.run_each(_generate, per_rank),
                "run_generation",
                [f"replica {r // self.tp}, rank {r}" for r in called],
            )
        finally:
            with self._lock:
                for replica, share in enumerate(shares):
                    self._outstanding[replica] -= sum(costs[i] for i in share)
        batches = []
        for r, (batch, metrics) in zip(called, results):
            if r % self.tp:
                continue  # the other ranks of a replica return the same batch
            if not isinstance(batch, RolloutBatch):
                return batch  # a decode_internal of the user's own: Run names the fix
            replica = r // self.tp
            batch.prompt_index = torch.tensor(shares[replica], dtype=torch.long)[batch.prompt_index]
            batches.append(batch)
            with self._lock:
                stats = self._stats[replica]
                stats[0] += len(batch)
                stats[1] += metrics.get("generation_tokens", 0)
                stats[2] += metrics.get("elapsed_s", 0.0)
        merged = RolloutBatch.concat(batches, self.pad_token_id)
        return merged.select(torch.argsort(merged.prompt_index, stable=True))

    def _samples(self, is_eval: bool) -> int:
        """Samples of each prompt of a call: n (eval_n), or 1 when it decodes greedily."""
        return gc.samples_per_prompt(self.entry.config, is_eval)

    @property
    def pad_token_id(self) -> int:
        if self._pad_token_id is None:
            self._pad_token_id = self.run(_attribute, self.name, "pad_token_id")[0]
        return self._pad_token_id

    def pop_metrics(self) -> dict:
        """Per replica since the last call: `replica/<i>/samples` generated and
        `replica/<i>/tokens_per_s` (its generated tokens over the seconds its engine worked on
        them); {} with one replica."""
        if self.replicas == 1:
            return {}
        with self._lock:
            stats, self._stats = self._stats, [[0, 0, 0.0] for _ in range(self.replicas)]
        out = {}
        for i, (samples, tokens, seconds) in enumerate(stats):
            out[f"replica/{i}/samples"] = samples
            out[f"replica/{i}/tokens_per_s"] = tokens / seconds if seconds else 0.0
        return out

    @property
    def inference_world_size(self) -> int:
        """The engine ranks of every replica (NeMo RL's inference world: init_collective's
        world_size counts it)."""
        return self.group.world_size

    def weight_versions(self) -> list:
        """The weight version of every engine rank (0 = the weights it started with, +1 per
        update)."""
        return self.run(_attribute, self.name, "weight_version")

    # ---- weights from a trainer elsewhere (NeMo RL's refit calls: chatgen.compat.nemo_rl)
    # -------------

    def open_weight_channel(self, ip: str, port: int, world_size: int) -> list:
        """Every engine rank joins the trainer's broadcast group at ip:port as member 1 + its
        rank; world_size = 1 + this model's ranks (the trainer's rank 0 sends). Returns the calls
        in flight: wait for them with `get` together with the trainer's `GroupSender.connect`
        (each side blocks until all joined)."""
        if world_size != 1 + self.group.world_size:
            raise ValueError(
                f"{self.name}: world_size={world_size}, but the weight group is the trainer's sending "
                f"rank + {self.group.world_size} engine ranks = {1 + self.group.world_size}"
            )
        return self.group.run_each(
            _join_broadcast,
            [
                (self.name, ip, port, 1 + r, world_size, self.token)
                for r in range(self.group.world_size)
            ],
        )

    def check_weight_manifest(self, manifest: dict) -> None:
        """Every engine rank checks a trainer's {HF name: shape} against its architecture now
        (the same check every sync makes), so a wrong model fails before the first sync: a
        SyncError naming each mismatch."""
        self.run(
            _check_manifest, self.name, {name: tuple(shape) for name, shape in manifest.items()}
        )

    def receive_weights(self, mode: str = "wait") -> list:
        """Every engine rank receives one broadcast (the trainer sends at the same time) and
        loads it; returns the calls in flight (each gives a chatgen.param_sync.SyncReport)."""
        return self.group.run_async(_receive_broadcast, self.name, mode)

    def load_shared_weights(self, handles: dict, mode: str = "wait") -> list:
        """Every engine rank loads the weights a trainer on this host wrote into shared memory
        (chatgen.param_sync.ShmSender.owned(token).write, signed with this group's token); waits, returns the
        SyncReports."""
        return self.run(_load_shm, self.name, handles, self.token, mode)

    def devices(self) -> list:
        """The device of every engine rank: the GPU's UUID, or cpu@<host>."""
        return self.run(_device_id)


# Functions run inside the actors (ModelWorker.run): module level, so Ray pickles them by reference.


def _generate(worker, name, items, is_eval, hold=None):
    model = worker.models[name]
    with handover.hold_after(*(hold or (None,))):
        return model.run_generation(items, is_eval), dict(model.metrics)


def _attribute(worker, name, attribute):
    return getattr(worker.models[name], attribute)


def _join_broadcast(worker, name, host, port, rank, world_size, token):
    worker.attach(name, RECEIVER, GroupReceiver(host, port, rank, world_size, token))


def _receive_broadcast(worker, name, mode):
    return worker.attached[(name, RECEIVER)].receive_into(worker.models[name], mode=mode)


def _check_manifest(worker, name, manifest):
    check_manifest(manifest, worker.models[name].weight_manifest())


def _load_shm(worker, name, handles, token, mode):
    return load_shm(worker.models[name], handles, token, mode)


def _device_id(worker):
    if torch.cuda.is_available():
        return f"GPU-{torch.cuda.get_device_properties(torch.cuda.current_device()).uuid}"
    return f"cpu@{socket.gethostname()}"
