"""Which trainer's weights go into which model after each update, and how (the algorithm's
Role.syncs_to).

    links = WeightLinks(runtime, {"policy_trainer": "policy"})   # opens a channel for each non-colocated pair
    links.sync()        # every trainer -> its target; the first sync of a run validates every tensor
    links.wake()        # before generating: the engine back from sleep (GPU colocation)
    links.release()     # after generating: the engine sleeps, its memory to the colocated trainers (GPU only)
    links.before_training()  # CPU, release_during_training: the engine frees its weights and KV cache

Colocated on GPUs, the Megatron models of the engine's group hand the memory back before the engine
wakes (`MegatronModule.offload`: gradients, optimizer state and, unless a sync is about to read
them, weights; each trainer call brings back what it needs). For a sync the engine wakes its weights
only, takes the new ones, and wakes its KV cache once the trainers' weights are out too: the two
never hold the device at once.

Colocated on CPU, vLLM's sleep frees nothing; an engine whose config sets release_during_training
sleeps at level 2 when training begins (`before_training`: its weights and KV cache freed,
chatgen.generation.vllm.adapter.cpu_release) and the sync that follows, which writes every weight,
wakes it as above. Not after generating: an evaluation's generation comes after the sync, and the
next episode's generation follows it with no sync between.

A trainer in the same colocation group as its target (same actor processes) writes into it in place
on every rank (chatgen.param_sync.sync_weights; each rank's engine, whatever its replica and TP
rank, takes the full tensors and keeps its own shard). Otherwise the target is a generation model on
devices of its own (chatgen.rlhf .generation_group): the trainer's rank 0 and every engine rank of
every replica form one broadcast group (chatgen.param_sync.group, through the target's refit calls;
every member proves the run's token over the group before each sync), kept for the run on the
workers (`ModelWorker.attach`). After every sync each engine rank must hold the same weight version:
a replica that missed an update stops the run.
"""

from chatgen.param_sync import GroupSender, plan_manifest, sync_weights, weight_source
from chatgen.rlhf.placement import TRAINER_BACKENDS
from chatgen.rlhf.runtime import ActorFailure, rendezvous_host

ENGINE_DEATH_WAIT_S = 10.0  # after a failed sync: how long the engines may take to report a death

SENDER = "group_sender"


# Functions run inside the actors (ModelWorker.run): module level, so Ray pickles them by reference.


def _sync_colocated(worker, trainer, target, validate, mode="wait"):
    sync_weights(worker.models[trainer], worker.models[target], validate=validate, mode=mode)


def _open_sender(worker, trainer, token, world_size, multi_node):
    sender = worker.attach(
        trainer, SENDER, GroupSender(token, world_size, host=rendezvous_host(multi_node))
    )
    return sender.host, sender.port


def _connect_sender(worker, trainer):
    worker.attached[(trainer, SENDER)].connect()


def _manifest(worker, trainer):
    return plan_manifest(weight_source(worker.models[trainer]).plan)


def _send(worker, trainer, validate):
    worker.attached[(trainer, SENDER)].send(worker.models[trainer], validate=validate)


class WeightLinks:
    """The trainer -> model weight paths of a run (see the module docstring)."""

    def __init__(self, runtime, pairs: dict):
        self.runtime, self.pairs = runtime, dict(pairs)
        self.colocated, self.syncs, self.asleep, self.sleeps = {}, 0, False, False
        self.offloading = []  # the Megatron models that hand the GPUs to an engine while it is awake
        self.releasing = []  # the CPU engines that free their memory while their trainers train
        for trainer_name, target_name in self.pairs.items():
            trainer, target = runtime[trainer_name], runtime[target_name]
            colocated = self.colocated[trainer_name] = trainer.group is target.group
            if colocated:
                self.sleeps = self.sleeps or target.entry.num_gpu > 0  # CPU: sleep frees nothing
                if not target.entry.num_gpu and getattr(
                    target.entry.config, "release_during_training", False
                ):
                    self.releasing.append(target_name)
                continue
            # the trainer's rank 0 sends, every engine rank receives
            world = 1 + target.group.world_size
            host, port = trainer.get(
                trainer.group.run_async(
                    _open_sender, trainer.name, target.token, world, trainer.group.multi_node
                ),
                "open sync",
            )[0]
            trainer.get(
                target.open_weight_channel(host, port, world)
                + trainer.group.run_async(_connect_sender, trainer.name),
                "connect sync",
            )
            # a wrong model fails now
            target.check_weight_manifest(trainer.run(_manifest, trainer.name)[0])
        if self.sleeps:
            groups = [runtime[target].group for target in self.pairs.values()]
            self.offloading = [
                name
                for name, h in runtime.handles.items()
                if h.backend in TRAINER_BACKENDS and any(h.group is g for g in groups)
            ]

    def sync(self, mode: str = "wait") -> None:
        """Each trainer's weights -> the model it syncs to; the first sync of a run validates
        every tensor. mode: what the engine does with requests in flight
        (GenerationModule.load_weights)."""
        validate = self.syncs == 0
        # weights first: the trainers keep theirs (what the sync sends) until it is done
        if self.asleep:
            self._offload(weights=False)
            self._call_targets("wake_up", ["weights"])
        for trainer_name, target_name in self.pairs.items():
            trainer, target = self.runtime[trainer_name], self.runtime[target_name]
            if self.colocated[trainer_name]:
                trainer.get(
                    trainer.group.run_async(
                        _sync_colocated, trainer.name, target.name, validate, mode
                    ),
                    "sync",
                )
            else:
                receiving = target.receive_weights(mode)
                try:
                    sending = trainer.group.run_async(_send, trainer.name, validate)
                    trainer.get(receiving + sending, "sync")
                except ActorFailure as e:  # the trainer's side fails first when an engine dies
                    raise engine_death(target_name, receiving) or e
            # every engine rank of every replica: the same update
            versions = target.weight_versions()
            if len(set(versions)) > 1:
                by_replica = {r // target.tp: v for r, v in enumerate(versions)}
                raise ActorFailure(
                    f"{target_name}: its replicas hold weight versions {by_replica} after sync "
                    f"{self.syncs + 1}; a replica missed an update and would sample with old weights "
                    "(--resume syncs every replica from the last checkpoint)"
                )
        self._offload(weights=True)  # the engine generates next
        if self.asleep:
            self._call_targets("wake_up", ["kv_cache"])
            self.asleep = False
        self.syncs += 1

    def wake(self) -> None:
        """Wake the targets put to sleep by `release`, the colocated trainers' memory handed back
        first."""
        if self.asleep:
            self._offload(weights=True)  # before the engine takes its memory back
            self._call_targets("wake_up")
            self.asleep = False

    def release(self) -> None:
        """Colocated on GPUs: the targets sleep, freeing their memory for the trainers until
        `wake`."""
        if self.sleeps:
            self._call_targets("sleep")
            self.asleep = True

    def before_training(self) -> None:
        """Colocated on CPU: the engines with release_during_training free their weights and KV
        cache until the next `sync`, which writes every weight."""
        if self.releasing and not self.asleep:
            for target_name in self.releasing:
                self.runtime[target_name].call("sleep", 2)
            self.asleep = True

    def _call_targets(self, method: str, *args) -> None:
        for target_name in dict.fromkeys(self.pairs.values()):
            self.runtime[target_name].call(method, *args)

    def _offload(self, weights: bool) -> None:
        for name in self.offloading:
            self.runtime[name].offload(weights)


def engine_death(target_name: str, receiving: list) -> ActorFailure | None:
    """An ActorFailure naming the engine when one of its actors died during a sync (`receiving`:
    the engine ranks' calls); None otherwise. The trainer's send then fails too, usually first,
    and the failure read as the trainer's own."""
    if not receiving or type(receiving[0]).__name__ != "ObjectRef":  # in process: no actor to die
        return None
    import ray

    ready, _ = ray.wait(receiving, num_returns=len(receiving), timeout=ENGINE_DEATH_WAIT_S)
    for ref in ready:
        try:
            ray.get(ref)
        except ray.exceptions.RayActorError as e:
            return ActorFailure(
                f"{target_name}: an engine actor died during the weight sync "
                f"(rank {receiving.index(ref)}); the trainer's side failed because "
                f"of it:\n{e}"
            )
        except Exception:  # the engine's own error: the trainer's report names the sync already
            continue
    return None
