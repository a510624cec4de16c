"""ChatLearn's spellings in chatgen: its per-model YAML (the chatlearn config dialect) and its
module calls.

    policy:
      backend: vllm
      model_config_file: old_chatlearn_policy.yaml
      config_dialect: chatlearn       # Megatron-LM keys ignored, ChatLearn's spellings read, the rest -> args:

    class MyPolicy(VLLMModule):      # ChatLearn's module code runs as written:
        def _add_request(self, data, is_eval=False):
            return self._add_request_internal(data["prompt"], data["input_ids"], is_eval)
        ... self.model_args["my_key"] ... self.tokenizer.tokenizer ...

CHATLEARN / CHATGEN are the two `chatgen.config.Dialect`s (`dialect(name)` picks one);
`ChatLearnGeneration` is the mixin that gives a generation module ChatLearn's calls (`model_args`,
`_add_request_internal`, a dataset with a `collate_fn`). docs/migrating_from_chatlearn.md is the
guide.
"""

import copy
import dataclasses
import functools
import logging
import types
from pathlib import Path

from chatgen.compat import chatlearn_lora
from chatgen.config import ConfigError, Dialect, args_problem
from chatgen.config.loader import at, source_of, substitute
from chatgen.config.typed import did_you_mean

logger = logging.getLogger(__name__)


@functools.cache
def megatron_lm_keys() -> frozenset:
    """Megatron-LM's argument names, from megatron_lm_keys.txt (its header says how the list was
    made)."""
    text = Path(__file__).with_name("megatron_lm_keys.txt").read_text(encoding="utf-8")
    return frozenset(
        line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")
    )


# ChatLearn's spellings of chatgen keys: ChatLearn key -> (chatgen key, chatgen value of a ChatLearn
# value; None = sets nothing). Each applies where the schema has the chatgen key and not the
# ChatLearn one.
CHATLEARN_SPELLINGS = {
    "bf16": ("dtype", lambda on: "bfloat16" if on else None),
    "fp16": ("dtype", lambda on: "float16" if on else None),
    "tensor_model_parallel_size": (
        "tensor_parallel_size",
        lambda size: size,
    ),  # a vLLM model's TP in ChatLearn
}


def read_chatlearn(data: dict, where: dict, schema, errors: list, label: str) -> dict:
    """The keys of a ChatLearn-style per-model YAML as chatgen reads them (the chatlearn dialect).

    A key of the schema is read as usual. A ChatLearn spelling of a chatgen key
    (CHATLEARN_SPELLINGS: `bf16: true` -> `dtype: bfloat16`, a vLLM model's
    `tensor_model_parallel_size` -> `tensor_parallel_size`) is read as that key unless the file set
    the chatgen key itself; ChatLearn's `lora:` keys (enable_lora, lora_dim, ...) are read as
    chatgen's (chatgen/compat/chatlearn_lora.py). Any other Megatron-LM argument
    (megatron_lm_keys.txt) is ignored. Every remaining key is the user's and goes to `args:`, where
    an explicit `args:` entry wins; a key one typo away from a chatgen key is an error instead. One
    log line each lists the ignored keys, the spellings read and the keys sent to `args:`.
    """
    if schema is dict:
        return data  # a python model: every key is the user's already
    fields = {f.name for f in dataclasses.fields(schema)}
    if "args" not in fields:
        errors.append(
            f"{label}: the chatlearn dialect sends unknown keys to `args:`, and {schema.__name__} has no "
            "`args` field; read this file with the chatgen dialect"
        )
        return data
    out, user, ignored, spelled, routed = {}, {}, [], [], []
    for key, value in data.items():
        spelling = CHATLEARN_SPELLINGS.get(key)
        if key == "lora" and key in fields and chatlearn_lora.is_chatlearn(value):
            lora = chatlearn_lora.read_lora(substitute(value, where, errors, (key,)), where, errors)
            if lora is not None:
                out[key] = lora
                spelled.append(f"lora -> {lora}")
        elif key in fields:
            out[key] = value
        elif spelling and spelling[0] in fields:
            target, convert = spelling
            chatgen_value = convert(substitute(value, where, errors, (key,)))
            if chatgen_value is None or target in data:
                ignored.append(key)  # switched off, or the file sets the chatgen key itself
            elif target in out and out[target] != chatgen_value:
                errors.append(
                    f"{at(where, (key,))}: sets {target} to {chatgen_value!r}, and another ChatLearn key "
                    f"sets it to {out[target]!r}; keep one of them"
                )
            else:
                out[target] = chatgen_value
                where[(target,)] = source_of(where, (key,))
                spelled.append(f"{key} -> {target}: {chatgen_value}")
        elif key in megatron_lm_keys():
            ignored.append(key)
        elif match := did_you_mean(key, fields - {"args"}, cutoff=0.85):
            errors.append(
                f"{at(where, (key,))}: unknown key; did you mean {match!r}? (the chatlearn dialect sends "
                "unknown keys to `args:`, but not one this close to a chatgen key: fix its spelling, or "
                "move it under `args:` if it is yours)"
            )
        else:
            user[key] = value
            where[("args", key)] = source_of(where, (key,))
            routed.append(key)
    if routed:
        explicit = data.get("args") or {}
        # not a mapping: _build says so
        out["args"] = {**user, **explicit} if isinstance(explicit, dict) else explicit
    if ignored:
        logger.warning(
            "%s (chatlearn dialect): ignored %d Megatron-LM key(s) that %s does not have: %s",
            label,
            len(ignored),
            schema.__name__,
            ", ".join(sorted(ignored)),
        )
    if spelled:
        logger.info(
            "%s (chatlearn dialect): read ChatLearn's spellings of chatgen keys: %s",
            label,
            ", ".join(spelled),
        )
    if routed:
        logger.info(
            "%s (chatlearn dialect): %d key(s) chatgen does not know went to `args:` (your keys, in "
            "model_args): %s",
            label,
            len(routed),
            ", ".join(sorted(routed)),
        )
    return out


def model_args(config) -> dict:
    """ChatLearn's `model_args` of a per-model config: its typed keys and its `args` keys in one
    flat dict.

    A new dict (deep copy): changing it leaves the config as it is. A user key that repeats a typed
    key is an error (the loader refuses it already; this catches a config built in code).
    """
    if problem := args_problem(config):
        raise ConfigError([f"args: {problem}"])
    typed = {
        f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name != "args"
    }
    return copy.deepcopy({**typed, **config.args})


_FOREIGN = dict(
    foreign_keys=megatron_lm_keys,
    foreign_name="a Megatron-LM argument",
    foreign_fix="a ChatLearn YAML with Megatron-LM keys loads with `config_dialect: chatlearn`, "
    "docs/migrating_from_chatlearn.md",
)


def read_chatgen(data: dict, where: dict, schema, errors: list, label: str) -> dict:
    """chatgen's own dialect: the keys as written, checked after this. A file holding Megatron-LM
    arguments that are no chatgen key (a ChatLearn per-model YAML) gets one first error naming
    the chatlearn dialect, before the error per key."""
    fields = (
        {f.name for f in dataclasses.fields(schema)} if dataclasses.is_dataclass(schema) else ()
    )
    foreign = sorted(k for k in data if k in megatron_lm_keys() and k not in fields)
    if foreign:
        errors.append(
            f"{label}: {len(foreign)} key(s) are Megatron-LM arguments ({', '.join(foreign[:5])}"
            f"{', ...' if len(foreign) > 5 else ''}): a ChatLearn per-model YAML; load it with "
            "`config_dialect: chatlearn` (the model entry's key, or --config-dialect chatlearn), "
            "docs/migrating_from_chatlearn.md"
        )
    return data


# every key checked; a Megatron-LM key is named as one
CHATGEN = Dialect("chatgen", read_chatgen, **_FOREIGN)
CHATLEARN = Dialect("chatlearn", read_chatlearn, **_FOREIGN)
DIALECTS = {d.name: d for d in (CHATGEN, CHATLEARN)}


def dialect(name: str) -> Dialect:
    """The config dialect named `name` (a model entry's `config_dialect`, `--config-dialect`)."""
    if name not in DIALECTS:
        raise ValueError(f"config dialect {name!r}: use one of {', '.join(DIALECTS)}")
    return DIALECTS[name]


class ChatLearnGeneration:
    """ChatLearn's calls on a generation module (a mixin of VLLMModule): `model_args`,
    `_add_request_internal`, `self.tokenizer.tokenizer`, and a `build_dataset` that returns a
    dataset with a `collate_fn` (the batch `_add_request` gets is then collated, as ChatLearn's
    data loader does)."""

    _collate_fns: dict  # is_eval -> the collate_fn of the dataset build_dataset returned

    @property
    def model_args(self) -> types.MappingProxyType:
        """ChatLearn's `model_args`: every key of this model's config, its `args:` (user) keys
        included, as one flat read-only mapping of the current values (seq_length as resolved by
        `setup()`). Change a value through `module.config.<key>` (typed keys; sampling keys take
        effect at the next call)."""
        return types.MappingProxyType(model_args(self.config))

    def prepare_dataset(self, prompts, is_eval=False) -> list:
        """Framework: `build_dataset(prompts, is_eval)` as a list of items. A dataset with a
        `collate_fn` (a ChatLearn `torch.utils.data.Dataset`) is remembered: `run_generation`
        then hands `_add_request` the collated batch, as ChatLearn's data loader does."""
        dataset = self.build_dataset(prompts, is_eval)
        self._collate_fns = {
            **getattr(self, "_collate_fns", {}),
            bool(is_eval): getattr(dataset, "collate_fn", None),
        }
        return [dataset[i] for i in range(len(dataset))]

    def collate(self, data, is_eval=False):
        """The batch `_add_request` gets: `data` collated by the dataset's `collate_fn` when it
        had one."""
        collate = getattr(self, "_collate_fns", {}).get(bool(is_eval))
        return collate(list(data)) if collate is not None else data

    def _add_request_internal(self, prompt_list, prompt_token_id_list, is_eval=False) -> list:
        """ChatLearn's call: queue prompts (their texts, or None) with their token ids (lists or
        1-D tensors) with the train or eval sampling parameters; returns the request ids. A
        prompt over the budget seq_length - max_new_tokens is an error naming it (cut prompts in
        `build_dataset`)."""
        if len(prompt_list) != len(prompt_token_id_list):
            raise ValueError(
                f"_add_request_internal: {len(prompt_list)} prompts but {len(prompt_token_id_list)} "
                "prompt_token_ids; pass one list of token ids per prompt"
            )
        items = [
            {"input_ids": ids.tolist() if hasattr(ids, "tolist") else list(ids), "prompt": text}
            for text, ids in zip(prompt_list, prompt_token_id_list)
        ]
        return self._queue(items, is_eval=is_eval)

    @staticmethod
    def alias_tokenizer(tokenizer) -> None:
        """ChatLearn's modules reach the HF tokenizer as `self.tokenizer.tokenizer`."""
        try:
            tokenizer.tokenizer = tokenizer
        except AttributeError:
            pass
