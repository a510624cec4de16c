"""`TrainBatch`: what an algorithm hands a trainer, checked once where it is built.

    batch = TrainBatch(input_ids=ids, attention_mask=attn, loss_mask=mask, old_logprobs=old,
                       advantages=adv)                     # a misspelt field is a TypeError here
    batch.check()                                          # shapes, once, before it travels
    for mb in batch.split(4): loss, stats = loss_fn(logprobs, mb)   # mb.advantages, mb.is_weights

S samples of L tokens: `input_ids` and `attention_mask` are (S, L); every per-token field is (S,
L-1) (entry t scores token t+1); per-sample fields are (S,). Optional fields are None when absent,
and reading one is reading a declared attribute, never a string key that a typo turns into None.

`extras` carries the tensors of a user's own loss (`MegatronModule.train_step` with keys of its
own): `TrainBatch.of(dict)` files the keys it does not know there, and `mb["key"]` reads them. A
trainer's internals read the fields through the same mapping view (`mb["input_ids"]`,
`mb.get("loss_mask")`); a name that is neither a field nor an extra is a KeyError, not None.
"""

import dataclasses
from typing import Optional

import torch

Tensor = torch.Tensor


def loss_declares(normalized_by, rows_together: int = 1):
    """Decorator of a trainer loss function (loss_fn(logprobs, micro_batch)): what its mean runs
    over, "tokens" (the loss-masked ones) or "samples" (or a function of the functools.partial
    keywords it is bound with, giving a unit or a function whose declared unit holds: policy_loss
    gives its aggregation), and how many consecutive rows it reads together (2:
    DPO's (chosen, rejected) pairs). Token micro-batches (chatgen.training.micro_batches) weigh
    each micro-batch's loss by its share of those units and keep such rows in one micro-batch."""

    def mark(fn):
        fn.normalized_by, fn.rows_together = normalized_by, rows_together
        return fn

    return mark


@dataclasses.dataclass
class TrainBatch:
    input_ids: Tensor  # (S, L) long
    attention_mask: Optional[Tensor] = None  # (S, L): 1 = token, 0 = padding
    loss_mask: Optional[Tensor] = None  # (S, L-1): 1 = a token the loss reads
    routed_experts: Optional[Tensor] = None  # (S, L, layers, k): the experts the engine chose
    old_logprobs: Optional[Tensor] = None  # (S, L-1): the policy before this update
    ref_logprobs: Optional[Tensor] = None  # (S, L-1): the frozen reference
    advantages: Optional[Tensor] = None  # (S,) per sample or (S, L-1) per token
    is_weights: Optional[Tensor] = None  # (S,) or (S, L-1): rollout-correction weights
    old_values: Optional[Tensor] = None  # (S, L-1): the critic before this update (PPO)
    returns: Optional[Tensor] = None  # (S, L-1): the value targets (PPO)
    pair_weights: Optional[Tensor] = None  # (S,): DPO's weight of each row's pair
    extras: dict = dataclasses.field(default_factory=dict)  # a user's loss's own tensors

    @classmethod
    def fields(cls) -> tuple:
        return tuple(f.name for f in dataclasses.fields(cls) if f.name != "extras")

    @classmethod
    def of(cls, data) -> "TrainBatch":
        """`data` as a TrainBatch: itself, or a dict whose known keys become fields and the rest
        `extras` (a trainer's public entry points take either)."""
        if isinstance(data, cls):
            return data
        if "input_ids" not in data:
            raise KeyError(f"a trainer batch needs 'input_ids' (S, L); got keys {sorted(data)}")
        known = set(cls.fields())
        return cls(
            **{k: v for k, v in data.items() if k in known},
            extras={k: v for k, v in data.items() if k not in known},
        )

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    # ---- the mapping view: the fields that are set, then the extras
    def keys(self) -> list:
        return [k for k in self.fields() if getattr(self, k) is not None] + list(self.extras)

    def items(self) -> list:
        return [(k, self[k]) for k in self.keys()]

    def __iter__(self):
        return iter(self.keys())

    def __contains__(self, key) -> bool:
        return key in self.keys()

    def __getitem__(self, key):
        value = self.get(key)
        if value is None:
            raise KeyError(f"this batch has no {key!r}; it has {', '.join(self.keys())}")
        return value

    def get(self, key, default=None):
        """A field's value (None when not set) or an extra; a name that is neither is a KeyError
        naming the fields (a typo must not read as an absent tensor)."""
        if key in self.extras:
            return self.extras[key]
        if key not in self.fields():
            raise KeyError(
                f"{key!r} is not a TrainBatch field ({', '.join(self.fields())}) nor one of this "
                f"batch's extras ({', '.join(self.extras) or 'none'})"
            )
        value = getattr(self, key)
        return default if value is None else value

    def replace(self, **changes) -> "TrainBatch":
        return dataclasses.replace(self, **changes)

    def _map(self, fn) -> "TrainBatch":
        """fn applied to every per-sample tensor (first dimension S); other values kept."""
        n = len(self)

        def each(v):
            return fn(v) if torch.is_tensor(v) and v.dim() > 0 and v.shape[0] == n else v

        return dataclasses.replace(
            self,
            **{k: each(getattr(self, k)) for k in self.fields()},
            extras={k: each(v) for k, v in self.extras.items()},
        )

    def select(self, index) -> "TrainBatch":
        """The rows at `index` (a 1-D long tensor or a list), in that order."""
        index = torch.as_tensor(index, dtype=torch.long)
        return self._map(lambda v: v[index])

    def split(self, micro_batch_size: int) -> list:
        """Consecutive micro-batches of `micro_batch_size` rows."""
        n = len(self)
        if n % micro_batch_size:
            raise ValueError(
                f"batch of {n} samples is not a multiple of micro_batch_size={micro_batch_size}"
            )
        return [
            self._map(lambda v, i=i: v[i : i + micro_batch_size])
            for i in range(0, n, micro_batch_size)
        ]

    def to(self, device) -> "TrainBatch":
        return dataclasses.replace(
            self,
            **{
                k: getattr(self, k).to(device)
                for k in self.fields()
                if torch.is_tensor(getattr(self, k))
            },
            extras={k: v.to(device) if torch.is_tensor(v) else v for k, v in self.extras.items()},
        )

    def check(self) -> "TrainBatch":
        """Shapes against input_ids (S, L), once, where an algorithm builds the batch; a
        ValueError names the field, its shape and the one expected. Returns self."""
        s, length = self.input_ids.shape
        per_token, per_sample = (s, length - 1), (s,)
        expected = {
            "attention_mask": [(s, length)],
            "loss_mask": [per_token],
            "old_logprobs": [per_token],
            "ref_logprobs": [per_token],
            "advantages": [per_sample, per_token],
            "is_weights": [per_sample, per_token],
            "old_values": [per_token],
            "returns": [per_token],
            "pair_weights": [per_sample],
        }
        for name, shapes in expected.items():
            value = getattr(self, name)
            if value is not None and tuple(value.shape) not in shapes:
                raise ValueError(
                    f"TrainBatch.{name} has shape {tuple(value.shape)}; with input_ids of shape "
                    f"{(s, length)} it must be {' or '.join(map(str, shapes))}"
                )
        return self
