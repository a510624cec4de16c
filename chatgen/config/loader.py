"""Load a config: YAML files + `includes:` + `${VAR:default}` + command-line `key=value` overrides, into a dataclass.

    vllm_cfg = load_model_config("configs/grpo_tiny/policy.yaml", VLLMConfig, ["temperature=0"])

Layers, lowest first: included files (in list order), the including file, command-line overrides. Mappings
merge key by key; anything else is replaced whole. `${VAR}` is substituted after merging, so only the values
that survive need their variables. Validation runs against a dataclass (schema.py's `opt` fields) and
collects every problem into one ConfigError, one line each: `<file>: <dotted.key>: <problem>; <fix>`.

This module knows no schema: the main YAML (runtime + models + algorithm) is assembled with these pieces by
chatgen.rlhf.config.load_config, and a `Dialect` (chatgen.compat: chatgen's own, ChatLearn's) says how a
per-model YAML's keys are read before validation.
"""

import dataclasses
import difflib
import logging
import os
import re
import types
import typing
from typing import Any, Callable, Literal

import yaml

from chatgen.config.safe_yaml import (
    MAX_YAML_CHARS,
    MAX_YAML_VALUES,
    YAMLTooLarge,  # noqa: F401
    parse_yaml,
)  # the bounds, YAMLTooLarge: importable from here too

logger = logging.getLogger(__name__)

CLI = "command line"


class ConfigError(ValueError):
    """Every problem found in a config, one per line; `.errors` holds the lines."""

    def __init__(self, errors: list[str]):
        self.errors = list(errors)
        super().__init__(
            f"{len(self.errors)} config error(s):\n" + "\n".join(f"  {e}" for e in self.errors)
        )


def show(path) -> str:
    """A path (str or os.PathLike) as the user would type it: relative to the current directory when below it."""
    path = os.fspath(path)
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


# --- provenance: `where` maps a key path (tuple) to (file, shown key prefix) -------------------------------


def source_of(where: dict, path: tuple) -> tuple[str, str]:
    """(file, shown key prefix) of the file that set the key at `path` (or its nearest parent)."""
    return next(where[path[:i]] for i in range(len(path), -1, -1) if path[:i] in where)


def at(where: dict, path: tuple) -> str:
    """'<file>: <dotted.key>' for error lines; the file is the one that set the key (or its nearest parent)."""
    file, prefix = source_of(where, path)
    return f"{file}: {prefix}{'.'.join(map(str, path))}" if path else file


def key_paths(data: dict, prefix: tuple = ()):
    for key, value in data.items():
        yield (*prefix, key)
        if isinstance(value, dict):
            yield from key_paths(value, (*prefix, key))


def merge(dst: dict, dst_where: dict, src: dict, src_where: dict, prefix: tuple = ()) -> None:
    """Deep-merge `src` into `dst` in place: `src` wins; mappings merge key by key, other values are replaced."""
    for key, value in src.items():
        path = (*prefix, key)
        if isinstance(value, dict) and isinstance(dst.get(key), dict):
            merge(dst[key], dst_where, value, src_where, path)
            continue
        dst[key] = value
        for old in [p for p in dst_where if p[: len(path)] == path]:
            del dst_where[old]
        dst_where.update((p, w) for p, w in src_where.items() if p[: len(path)] == path)


# --- reading files ------------------------------------------------------------------------------------------


def read_yaml(
    path: str, errors: list, files: list, ref: str | None = None, stack: tuple = ()
) -> tuple[dict, dict]:
    """(data, where) of one YAML file with its `includes:` merged under it (the including file wins)."""
    path = os.path.abspath(os.path.expanduser(path))
    shown = show(path)
    empty = {}, {(): (shown, "")}
    if path in stack:
        cycle = " -> ".join(show(p) for p in (*stack[stack.index(path) :], path))
        errors.append(
            f"{show(stack[-1])}: includes: include cycle {cycle}; remove one of these includes"
        )
        return empty
    try:
        with open(path, encoding="utf-8") as f:
            data = parse_yaml(f)
    except OSError as e:
        errors.append(
            f"{ref or shown}: cannot read {shown} ({e.strerror}); fix the path "
            "(relative paths resolve against the directory of the file that names them)"
        )
        return empty
    except YAMLTooLarge as e:
        errors.append(f"{shown}: refused: {e}")
        return empty
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f"line {mark.line + 1}: " if mark else ""
        problem = getattr(e, "problem", None) or str(e).replace("\n", " ")
        errors.append(f"{shown}: {line}YAML syntax error: {problem}; fix the YAML syntax")
        return empty
    files.append(path)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        errors.append(
            f"{shown}: the top level is a {type(data).__name__}; write a mapping of `key: value` lines"
        )
        return empty
    before = len(errors)
    includes = substitute(
        data.pop("includes", None) or [], {(): (shown, "")}, errors, ("includes",)
    )
    if len(errors) > before:
        includes = []  # a missing variable: the path is not known
    if isinstance(includes, str):
        includes = [includes]
    if not isinstance(includes, list) or not all(isinstance(i, str) for i in includes):
        errors.append(
            f"{shown}: includes: expected a file name or a list of them; write `includes: [base.yaml]`"
        )
        includes = []
    merged, where = {}, {}
    for include in includes:
        target = os.path.join(os.path.dirname(path), os.path.expanduser(include))
        sub, sub_where = read_yaml(target, errors, files, f"{shown}: includes", (*stack, path))
        merge(merged, where, sub, sub_where)
    merge(merged, where, data, dict.fromkeys(key_paths(data), (shown, "")))
    where[()] = (shown, "")
    return merged, where


_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::([^}]*))?\}")
# a key that names a secret: key, token, api_key, judge_api_key, hf_token, client_secret, password,
# ... (not prompt_key or pad_token: the key of a field, a special token)
SECRET_KEY = re.compile(
    r"^(key|token)$|(^|_)(api|access|private|secret|auth|client|signing|hf"
    r"|wandb|github|session|bearer|refresh)_?(key|token)$|secret|passw(or)?d",
    re.IGNORECASE,
)
MASK = "***"
MIN_ENV_SECRET = 6  # shorter environment values (a count, a flag) are not looked for when shown
_from_env = {}  # the text of each environment variable a config used -> its name (`mask_secrets`)


def mask_secrets(data, key: str = ""):
    """`data` (plain dicts / lists / scalars) fit to show or write: the value of a key named like a
    secret (SECRET_KEY: api_key, hf_token, *secret*, *password*, ...) is MASK, and the text of an
    environment variable a config read through ${VAR} is written back as `${VAR}` (so a file written
    from it reads the same once loaded again, in the same environment)."""
    if isinstance(data, dict):
        return {k: mask_secrets(v, str(k)) for k, v in data.items()}
    if isinstance(data, list):
        return [mask_secrets(v, key) for v in data]
    if data not in (None, "") and SECRET_KEY.search(key):
        return MASK
    if isinstance(data, str):
        for text, name in sorted(_from_env.items(), key=lambda item: -len(item[0])):
            data = data.replace(text, f"${{{name}}}")
    return data


def _read_env(name: str):
    text = os.environ.get(name)
    if text is not None and len(text) >= MIN_ENV_SECRET:
        _from_env[text] = name
    return text


def substitute(value, where: dict, errors: list, path: tuple = ()):
    """Replace `${VAR}` / `${VAR:default}`, reading a whole value the way ChatLearn's YAML parser does.

    A value that is one whole `${...}` gets the YAML type of its text (from the environment, else the
    default), except that `None` is null as in ChatLearn (`${X:None}`); an unset variable with no default
    makes it null, with one warning naming the variable and the key. Inside a longer string the result stays
    a string, and there an unset variable with no default is an error (null cannot be part of a string).
    """
    if isinstance(value, dict):
        return {k: substitute(v, where, errors, (*path, k)) for k, v in value.items()}
    if isinstance(value, list):
        return [substitute(v, where, errors, path) for v in value]
    if not isinstance(value, str) or "${" not in value:
        return value
    if whole := _ENV.fullmatch(value):
        name, default = whole.groups()
        text = _read_env(name)
        text = default if text is None else text
        if text is None:
            logger.warning(
                "%s: environment variable %s is not set and has no default: read as null (export %s=... "
                "or write ${%s:default})",
                at(where, path),
                name,
                name,
                name,
            )
            return None
        if text.strip() == "None":
            return None
        try:
            return parse_yaml(
                text
            )  # `${N:4}` -> 4, `${FLAG:true}` -> True, `${L:[1,2]}` -> [1, 2], `${X:}` -> None
        except yaml.YAMLError:
            return text

    def replace(match):
        name, default = match.groups()
        if name in os.environ:
            return _read_env(name)
        if default is not None:
            return default
        errors.append(
            f"{at(where, path)}: environment variable {name} is not set and has no default, and a "
            f"variable inside a longer string cannot be null; export {name}=... or write ${{{name}:default}}"
        )
        return ""

    return _ENV.sub(replace, value)  # inside a longer string: stays a string


def parse_overrides(items: list[str]) -> dict:
    """`["a.b=1", "x=[1,2]"]` -> `{"a": {"b": 1}, "x": [1, 2]}`; values are typed as YAML reads them."""
    errors = []
    out = parse_override_tree(items, errors)
    if errors:
        raise ConfigError(errors)
    return out


def parse_override_tree(items, errors: list) -> dict:
    out = {}
    for item in items:
        key, sep, raw = item.partition("=")
        keys = key.strip().split(".")
        if not sep or not all(keys):
            errors.append(
                f"{CLI}: {item!r}: not a key=value override; write e.g. runtime.num_episode=3"
            )
            continue
        node = out
        for k in keys[:-1]:
            if not isinstance(node.get(k), dict):
                node[k] = {}
            node = node[k]
        node[keys[-1]] = _override_value(raw)
    return out


def _override_value(raw: str):
    """A command-line value typed as YAML reads it (3 -> int, true -> bool, [1, 2] -> list), except where YAML
    would silently change the text: `Question: ;</s>` (a mapping), `#dir` (a comment, i.e. null) or a YAML
    syntax error stay the string as typed. Write `{a: 1}` for a mapping and `null` for null."""
    text = raw.strip()
    try:
        value = parse_yaml(raw)
    except yaml.YAMLError:
        return raw
    if isinstance(value, dict) and not text.startswith("{"):
        return raw
    if value is None and text not in ("", "~", "null", "Null", "NULL"):
        return raw
    return value


# --- validation against the dataclasses ---------------------------------------------------------------------


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

    read(data, where, schema, errors, label) -> data: rewrites the keys before validation (None: as written).
    foreign_keys() -> the keys of another system (e.g. Megatron-LM's arguments) that a file written for it
    holds: an unknown one is reported as `foreign_name` instead of with a near-miss guess, and the file's line
    of valid keys ends with `foreign_fix`.
    """

    name: str
    read: Callable | None = None
    foreign_keys: Callable = frozenset
    foreign_name: str = ""
    foreign_fix: str = ""


def _valid_keys(file: str, path: tuple, fields, unknown: list, dialect) -> str:
    """The one line per file that follows its unknown keys: the section's valid keys, and where others go."""
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
    """(ok, value) for `value` read from YAML against annotation `tp`; ints pass as floats, bools never as ints."""
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
    """An instance of dataclass `cls` from mapping `data` (None if it has errors); `dict` = any mapping. Each
    problem is appended to `errors`; `extra_check(obj)` yields more (key, problem) pairs."""
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
    kwargs, bad = (
        {},
        set(),
    )  # bad: keys whose value failed; they take their default for the range checks
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
    # The object is returned only when every key was read; failing range checks alone still return it, so the
    # checks that look across sections (colocation, batch sizes) also run.
    complete = len(errors) == before
    obj = cls(**kwargs)
    problems = [*getattr(obj, "check", tuple)(), *(extra_check(obj) if extra_check else ())]
    for key, problem in problems:
        if key not in bad:
            errors.append(f"{at(where, (*path, key))}: {problem}")
    return obj if complete else None


# --- public entry points ------------------------------------------------------------------------------------


def load_model_config(
    path: str | os.PathLike | None,
    schema,
    overrides: list[str] | dict = (),
    extra_check=None,
    dialect: Dialect | None = None,
):
    """One per-model YAML (flat keys; includes, ${VAR}) plus flat `key=value` overrides, as `schema` (a
    dataclass, or `dict` for a free mapping).

    `path=None` starts from the schema's defaults. `overrides` may also be a dict of typed values (keys set
    from code, e.g. `load_model_config(None, VLLMConfig, {"load": d, "n": 4})`), checked the same way.
    `extra_check(obj)` yields (key, problem) pairs for checks that need more than the config (e.g. the
    platform it runs on); they are reported with every other problem. `dialect` (chatgen.compat.dialect(name))
    says how the file's keys are read, e.g. ChatLearn's (Megatron-LM keys ignored, unknown keys -> `args:`;
    docs/migrating_from_chatlearn.md). Raises ConfigError listing every problem.
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
