"""Registries of the recipe knobs: small functions found by the YAML value that names them.

    from chatgen.rlhf.recipe import advantage

    @advantage("centred")                       # runtime.algorithm.advantage_estimator: centred
    def centred(rewards, n, batch, algo):       # (S,) rewards -> (S,) or (S, L-1) advantages
        return rewards - rewards.view(-1, n).mean(1).repeat_interleave(n)

A YAML value is a registered name, or the path of a function in the user's own module
(`my_pkg.my_module:centred` or `my_file.py:centred`, as reward functions are named): importing it
runs its module's registrations, so a new knob is a new function in a new file and changes no file
of chatgen. A registration may carry `check(algo)`, yielding (key, problem) pairs for the keys the
function reads: its rules sit beside it. The function itself (not its name) travels to a trainer
process, where pickling names its module, which that process imports.
"""

from chatgen.config.typed import did_you_mean
from chatgen.core.imports import import_object


class Registry:
    """Named functions of one kind, chosen by one key of `runtime.algorithm`."""

    def __init__(self, kind: str, key: str, signature: str):
        self.kind, self.key, self.signature = kind, key, signature
        self.functions, self.checks = {}, {}

    def __call__(self, name: str, check=None):
        """The decorator: `@registry("name")` or `@registry("name", check=fn)`."""

        def register(fn):
            if name in self.functions and self.functions[name] is not fn:
                raise ValueError(
                    f"{self.kind} {name!r} is registered twice ({self.functions[name].__module__} "
                    f"and {fn.__module__}); give one of them another name"
                )
            self.functions[name] = fn
            if check is not None:
                self.checks[name] = check
            return fn

        return register

    def names(self) -> list:
        return sorted(self.functions)

    def problem(self, value) -> str | None:
        """Why `value` names no function of this registry (None when it does)."""
        try:
            self.get(value)
        except ValueError as e:
            return str(e)
        return None

    def get(self, value: str):
        """The function `value` names: a registered name, or 'module:function' /
        'file.py:function'."""
        if value in self.functions:
            return self.functions[value]
        if isinstance(value, str) and ":" in value:
            fn = import_object(value, self.kind)
            if not callable(fn):
                raise ValueError(f"{value!r} is not a function: a {self.kind} is {self.signature}")
            return fn
        close = did_you_mean(value, self.functions)
        hint = f"did you mean {close!r}? " if close else ""
        raise ValueError(
            f"unknown {self.kind} {value!r}; {hint}valid names: {', '.join(self.names())}, or the "
            f"path of your own function ('my_module:name', {self.signature}; docs/extending.md)"
        )

    def rules(self, value: str, algo):
        """(key, problem) pairs of the registered check of `value` (none for a path)."""
        check = self.checks.get(value)
        return check(algo) if check is not None else ()


advantage = Registry(
    "advantage estimator",
    "advantage_estimator",
    "fn(rewards (S,), n, batch: TrainBatch, algo) -> (S,) or (S, L-1)",
)
ratio = Registry(
    "policy ratio",
    "ratio_level",
    "fn(logprobs, old_logprobs, mask) -> (B, T) log-ratio whose exp is the clipped ratio",
)
aggregation = Registry(
    "loss aggregation",
    "loss_aggregation",
    "fn(per_token (B, T), mask (B, T), norm_length) -> scalar loss",
)
correction = Registry(
    "importance weighting",
    "importance_sampling_level",
    "fn(old_logprobs, infer_logprobs, mask, cap) -> (B,) or (B, T) detached weights",
)
policy_loss = Registry(
    "policy loss",
    "policy_loss",
    "fn(log_ratio, logprobs, advantages, mask, options) -> (per_token (B, T), clipped (B, T) bool)",
)
