"""`ModelHandle`: one model of a run as the driver sees it (chatgen.rlhf.runtime builds one per model):
calls go to every rank of its group and come back per rank; the methods its class declares with
`chatgen.module.remote` are its own methods here, dispatched as declared (all, first, split over its
data-parallel ranks)."""

import functools

import torch

from chatgen.core.tensors import select


class ModelHandle:
    """One model as the engine sees it: calls go to every rank of its group; results come back
    per rank."""

    def __init__(self, name: str, entry, group):
        self.name, self.entry, self.group = name, entry, group
        self.backend = entry.backend
        self.dp_ranks = None  # Megatron: data-parallel rank of each actor (set by Runtime.start)
        self.declared = {}  # {method: dispatch} its class declares with chatgen.module.remote

    def __getattr__(self, method: str):
        """A method its class declares with `@remote(dispatch)`: all -> call, split ->
        split_call."""
        declared = self.__dict__.get("declared") or {}
        if method.startswith("_") or method not in declared:
            raise AttributeError(
                f"{self.__dict__.get('name')}: {method!r} is not a method its class declares for the "
                f"run (@chatgen.module.remote); declared: {', '.join(sorted(declared)) or 'none'}"
            )
        dispatch = {"all": self.call, "first": self.first, "split": self.split_call}
        return functools.partial(dispatch[declared[method]], method)

    def call(self, method: str, *args, **kwargs) -> list:
        return self.group.get(
            self.group.call_async(self.name, method, *args, **kwargs), f"{self.name}.{method}"
        )

    def first(self, method: str, *args, **kwargs):
        """Call on every rank (collective), return rank 0's result."""
        return self.call(method, *args, **kwargs)[0]

    def run(self, fn, *args) -> list:
        """`fn(worker, *args)` on every rank of the group (a module-level function; see
        ModelWorker.run)."""
        return self.get(self.group.run_async(fn, *args), fn.__name__)

    def get(self, refs, what, labels=None):
        return self.group.get(refs, f"{self.name}.{what}", labels)

    def split_call(self, method: str, data: dict, *args) -> list:
        """`method(shard, *args)` on every rank, the batch's rows split over the model's DP
        ranks (a Megatron model: `dp_ranks`); returns one result per DP rank, in DP order."""
        dp = max(self.dp_ranks) + 1
        n = data["input_ids"].shape[0]
        if n % dp:
            raise ValueError(
                f"{self.name}: a batch of {n} samples does not split over {dp} data-parallel ranks"
            )
        shards = [select(data, torch.arange(d * n // dp, (d + 1) * n // dp)) for d in range(dp)]
        results = self.get(
            self.group.run_each(
                call_model, [(self.name, method, shards[d], *args) for d in self.dp_ranks]
            ),
            method,
        )
        first = {}
        for d, result in zip(self.dp_ranks, results):
            first.setdefault(d, result)
        return [first[d] for d in range(dp)]


def call_model(worker, name, method, *args):
    """`models[name].method(*args)` in a worker (for `run_each`, which passes each rank its own
    arguments)."""
    return getattr(worker.models[name], method)(*args)
