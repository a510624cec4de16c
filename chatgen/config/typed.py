"""Typed configs: a merged YAML tree checked against a dataclass schema and built into it (`build`:
every problem collected, with the file and key it came from and a fix), and `load_model_config`, one
per-model YAML (read, merged and substituted by chatgen.config.loader) as its dataclass.

    vllm_cfg = load_model_config("configs/grpo_tiny/policy.yaml", VLLMConfig, ["temperature=0"])

A `Dialect` (chatgen.compat: chatgen's own, ChatLearn's) says how a per-model YAML's keys are read before
validation.
"""

import dataclasses
import difflib
import os
import types
import typing
from typing import Any, Callable, Literal

import yaml

from chatgen.config.loader import (
    CLI,
    ConfigError,
    at,
    key_paths,
    merge,
    parse_override_tree,
    read_yaml,
    show,
    source_of,
    substitute,
)
from chatgen.config.safe_yaml import parse_yaml

# --- validation against the dataclasses
# ---------------------------------------------------------------------


def did_you_mean(word, choices, cutoff=0.6) -> str | None:
    """The choice closest to `word` (a likely typo of it), or None."""
    match = difflib.get_close_matches(str(word), sorted(map(str, choices)), n=1, cutoff=cutoff)
    return match[0] if match else None


def closest(word, choices, what="keys") -> str:
    match = did_you_mean(word, choices)
    return (
        f"did you mean {match!r}?"
        if match
        else f"valid {what}: {', '.join(sorted(map(str, choices)))}"
    )


@dataclasses.dataclass(frozen=True)
class Dialect:
    """How a per-model YAML's keys are read (chatgen.compat has chatgen's own and ChatLearn's).

    read(data, where, schema, errors, label) -> data: rewrites the keys before validation (None: as
    written). foreign_keys() -> the keys of another system (e.g. Megatron-LM's arguments) that a
    file written for it holds: an unknown one is reported as `foreign_name` instead of with a
    near-miss guess, and the file's line of valid keys ends with `foreign_fix`.
    """

    name: str
    read: Callable | None = None
    foreign_keys: Callable = frozenset
    foreign_name: str = ""
    foreign_fix: str = ""


def _valid_keys(file: str, path: tuple, fields, unknown: list, dialect) -> str:
    """The one line per file that follows its unknown keys: the section's valid keys, and where
    others go."""
    section = f" of {'.'.join(map(str, path))}" if path else ""
    line = f"{file}: valid keys{section}: {', '.join(sorted(fields))}"
    if "args" in fields:
        line += "; put your own keys under `args:`"
        if dialect is not None and any(key in dialect.foreign_keys() for key in unknown):
            line += f" ({dialect.foreign_fix})"
    return line


def type_name(tp) -> str:
    if tp is type(None):
        return "null"
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join(type_name(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(map(repr, typing.get_args(tp)))
    return (
        tp.__name__
        if isinstance(tp, type) and not typing.get_args(tp)
        else str(tp).replace("typing.", "")
    )


def _convert(value, tp) -> tuple[bool, Any]:
    """(ok, value) for `value` read from YAML against annotation `tp`; ints pass as floats, bools
    never as ints."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return True, value
    if origin in (typing.Union, types.UnionType):
        if value is None:
            return type(None) in args, None
        for arg in args:
            ok, converted = _convert(value, arg)
            if ok:
                return True, converted
        return False, value
    if origin is Literal:
        return value in args, value
    if origin in (list, dict):
        if not isinstance(value, origin):
            return False, value
        if not args:
            return True, value
        if origin is dict:
            items = [_convert(v, args[1]) for v in value.values()]
            keys_ok = all(_convert(k, args[0])[0] for k in value)
            return keys_ok and all(ok for ok, _ in items), dict(zip(value, (v for _, v in items)))
        items = [_convert(v, args[0]) for v in value]
        return all(ok for ok, _ in items), [v for _, v in items]
    if isinstance(value, bool) and tp is not bool:
        return False, value
    if tp is float and isinstance(value, int):
        return True, float(value)
    return isinstance(value, tp), value


def _type_error(value, tp) -> str:
    if typing.get_origin(tp) is Literal:
        hint = closest(value, typing.get_args(tp), "values") if isinstance(value, str) else ""
        return f"{value!r} is not {type_name(tp)}; use one of those" + (
            f" ({hint})" if "mean" in hint else ""
        )
    fix = f"set it to {type_name(tp)}"
    if isinstance(value, str):
        try:
            if _convert(parse_yaml(value), tp)[0]:
                fix = "remove the quotes"
        except yaml.YAMLError:
            pass
    return f"expected {type_name(tp)}, got {type(value).__name__} {value!r}; {fix}"


def build(
    cls,
    data,
    where: dict,
    errors: list,
    path: tuple = (),
    extra_check=None,
    dialect: Dialect | None = None,
):
    """An instance of dataclass `cls` from mapping `data` (None if it has errors); `dict` = any
    mapping. Each problem is appended to `errors`; `extra_check(obj)` yields more (key, problem)
    pairs."""
    if not isinstance(data, dict):
        errors.append(
            f"{at(where, path)}: expected a mapping of `key: value`, got {type(data).__name__} "
            f"{data!r}; write the keys indented under it"
        )
        return None
    if cls is dict:
        return data
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    before = len(errors)
    # bad: keys whose value failed; they take their default for the range checks
    kwargs, bad = (
        {},
        set(),
    )
    unknown = {}  # file -> its unknown keys with no close match: one line per file lists the valid keys
    for key, value in data.items():
        key_path = (*path, key)
        if key not in fields:
            foreign = "args" in fields and dialect is not None and key in dialect.foreign_keys()
            match = None if foreign else did_you_mean(key, fields)
            errors.append(
                f"{at(where, key_path)}: unknown key"
                + (f"; did you mean {match!r}?" if match else "")
                + (f" ({dialect.foreign_name})" if foreign else "")
            )
            if match is None:
                unknown.setdefault(source_of(where, key_path)[0], []).append(key)
            continue
        if dataclasses.is_dataclass(hints[key]):
            ok, built = True, build(hints[key], value, where, errors, key_path)
            ok = built is not None
        else:
            ok, built = _convert(value, hints[key])
            if not ok:
                errors.append(f"{at(where, key_path)}: {_type_error(value, hints[key])}")
        if ok:
            kwargs[key] = built
        else:
            bad.add(key)
    errors.extend(_valid_keys(file, path, fields, keys, dialect) for file, keys in unknown.items())
    required = [
        n
        for n, f in fields.items()
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    for name in required:
        if name not in data:
            doc = fields[name].metadata.get("doc")
            errors.append(
                f"{at(where, (*path, name))}: required key is missing; add `{name}: ...`"
                + (f" ({doc})" if doc else "")
            )
    if any(name not in kwargs for name in required):
        return None
    # Run the range checks even when other keys were wrong, so that one load reports every problem.
    # The object is returned only when every key was read; failing range checks alone still return
    # it, so the checks that look across sections (colocation, batch sizes) also run.
    complete = len(errors) == before
    obj = cls(**kwargs)
    problems = [*getattr(obj, "check", tuple)(), *(extra_check(obj) if extra_check else ())]
    for key, problem in problems:
        if key not in bad:
            errors.append(f"{at(where, (*path, key))}: {problem}")
    return obj if complete else None


# --- public entry points
# ------------------------------------------------------------------------------------


def load_model_config(
    path: str | os.PathLike | None,
    schema,
    overrides: list[str] | dict = (),
    extra_check=None,
    dialect: Dialect | None = None,
):
    """One per-model YAML (flat keys; includes, ${VAR}) plus flat `key=value` overrides, as `schema`
    (a dataclass, or `dict` for a free mapping).

    `path=None` starts from the schema's defaults. `overrides` may also be a dict of typed values
    (keys set from code, e.g. `load_model_config(None, VLLMConfig, {"load": d, "n": 4})`), checked
    the same way. `extra_check(obj)` yields (key, problem) pairs for checks that need more than the
    config (e.g. the platform it runs on); they are reported with every other problem. `dialect`
    (chatgen.compat.dialect(name)) says how the file's keys are read, e.g. ChatLearn's (Megatron-LM
    keys ignored, unknown keys -> `args:`; docs/migrating_from_chatlearn.md). Raises ConfigError
    listing every problem.
    """
    errors, files = [], []
    source = "overrides" if isinstance(overrides, dict) else CLI
    data, where = (
        read_yaml(os.fspath(path), errors, files) if path is not None else ({}, {(): (source, "")})
    )
    overrides_tree = (
        dict(overrides) if isinstance(overrides, dict) else parse_override_tree(overrides, errors)
    )
    merge(data, where, overrides_tree, dict.fromkeys(key_paths(overrides_tree), (source, "")))
    label = show(os.path.abspath(os.fspath(path))) if path is not None else source
    if dialect is not None and dialect.read is not None:
        data = dialect.read(data, where, schema, errors, label)
    data = substitute(data, where, errors)
    obj = build(schema, data, where, errors, extra_check=extra_check, dialect=dialect)
    if errors:
        raise ConfigError(errors)
    return obj
