"""Load a chatgen config: YAML files + `includes:` + `${VAR:default}` + command-line `key=value` overrides.

    cfg = load_config("configs/grpo_tiny.yaml", ["runtime.num_episode=3", "policy.temperature=0.5"])
    vllm_cfg = load_model_config("configs/grpo_tiny/policy.yaml", "vllm", ["temperature=0"])

Layers, lowest first: included files (in list order), the including file, command-line overrides. Mappings
merge key by key; anything else is replaced whole. `${VAR}` is substituted after merging, so only the values
that survive need their variables. Validation runs against the dataclasses in schema.py and collects every
problem into one ConfigError, one line each: `<file>: <dotted.key>: <problem>; <fix>`.

A per-model YAML written for ChatLearn is read with `dialect="chatlearn"` (`config_dialect: chatlearn` in its
model entry): Megatron-LM keys are ignored and the user's keys go to `args:` (see `_read_chatlearn`).
"""
import copy
import dataclasses
import difflib
import functools
import importlib
import logging
import os
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from chatgen.config.schema import (
    SCHEMAS,
    ChatgenConfig,
    MegatronConfig,
    ModelEntry,
    RuntimeConfig,
    VLLMConfig,
    args_problem,
)

logger = logging.getLogger(__name__)

CLI = "command line"
RESOLVED_NAME = "resolved_config.yaml"
DIALECTS = ("chatgen", "chatlearn")


class ConfigError(ValueError):
    """Every problem found in a config, one per line; `.errors` holds the lines."""

    def __init__(self, errors: list[str]):
        self.errors = list(errors)
        super().__init__(f"{len(self.errors)} config error(s):\n" + "\n".join(f"  {e}" for e in self.errors))


class _Loader(yaml.SafeLoader):
    """SafeLoader that reads `1e-5` as a float (YAML 1.1 wants `1.0e-5`) and dates as plain strings, and refuses
    a key given twice in one mapping (PyYAML would keep the last value without a word)."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, (str, int, float, bool)):
                continue  # an unhashable key: SafeLoader's own error follows
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} appears twice in one mapping (lines {seen[key] + 1} and "
                                f"{key_node.start_mark.line + 1}); keep one", key_node.start_mark)
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep)


_Loader.yaml_implicit_resolvers = {
    first: [(tag, regex) for tag, regex in resolvers if tag != "tag:yaml.org,2002:timestamp"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*(\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789")
)


def _yaml(text):
    return yaml.load(text, Loader=_Loader)


def _show(path: str) -> str:
    """A path as the user would type it: relative to the current directory when below it."""
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


# --- provenance: `where` maps a key path (tuple) to (file, shown key prefix) -------------------------------


def _source(where: dict, path: tuple) -> tuple[str, str]:
    """(file, shown key prefix) of the file that set the key at `path` (or its nearest parent)."""
    return next(where[path[:i]] for i in range(len(path), -1, -1) if path[:i] in where)


def _at(where: dict, path: tuple) -> str:
    """'<file>: <dotted.key>' for error lines; the file is the one that set the key (or its nearest parent)."""
    file, prefix = _source(where, path)
    return f"{file}: {prefix}{'.'.join(map(str, path))}" if path else file


def _paths(data: dict, prefix: tuple = ()):
    for key, value in data.items():
        yield (*prefix, key)
        if isinstance(value, dict):
            yield from _paths(value, (*prefix, key))


def _merge(dst: dict, dst_where: dict, src: dict, src_where: dict, prefix: tuple = ()) -> None:
    """Deep-merge `src` into `dst` in place: `src` wins; mappings merge key by key, other values are replaced."""
    for key, value in src.items():
        path = (*prefix, key)
        if isinstance(value, dict) and isinstance(dst.get(key), dict):
            _merge(dst[key], dst_where, value, src_where, path)
            continue
        dst[key] = value
        for old in [p for p in dst_where if p[: len(path)] == path]:
            del dst_where[old]
        dst_where.update((p, w) for p, w in src_where.items() if p[: len(path)] == path)


# --- reading files ------------------------------------------------------------------------------------------


def _read(path: str, errors: list, files: list, ref: str | None = None, stack: tuple = ()) -> tuple[dict, dict]:
    """(data, where) of one YAML file with its `includes:` merged under it (the including file wins)."""
    path = os.path.abspath(os.path.expanduser(path))
    shown = _show(path)
    empty = {}, {(): (shown, "")}
    if path in stack:
        cycle = " -> ".join(_show(p) for p in (*stack[stack.index(path):], path))
        errors.append(f"{_show(stack[-1])}: includes: include cycle {cycle}; remove one of these includes")
        return empty
    try:
        with open(path, encoding="utf-8") as f:
            data = _yaml(f)
    except OSError as e:
        errors.append(f"{ref or shown}: cannot read {shown} ({e.strerror}); fix the path "
                      "(relative paths resolve against the directory of the file that names them)")
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
        errors.append(f"{shown}: the top level is a {type(data).__name__}; write a mapping of `key: value` lines")
        return empty
    before = len(errors)
    includes = _substitute(data.pop("includes", None) or [], {(): (shown, "")}, errors, ("includes",))
    if len(errors) > before:
        includes = []  # a missing variable: the path is not known
    if isinstance(includes, str):
        includes = [includes]
    if not isinstance(includes, list) or not all(isinstance(i, str) for i in includes):
        errors.append(f"{shown}: includes: expected a file name or a list of them; write `includes: [base.yaml]`")
        includes = []
    merged, where = {}, {}
    for include in includes:
        target = os.path.join(os.path.dirname(path), os.path.expanduser(include))
        sub, sub_where = _read(target, errors, files, f"{shown}: includes", (*stack, path))
        _merge(merged, where, sub, sub_where)
    _merge(merged, where, data, dict.fromkeys(_paths(data), (shown, "")))
    where[()] = (shown, "")
    return merged, where


_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::([^}]*))?\}")


def _substitute(value, where: dict, errors: list, path: tuple = ()):
    """Replace `${VAR}` / `${VAR:default}`, reading a whole value the way ChatLearn's YAML parser does.

    A value that is one whole `${...}` gets the YAML type of its text (from the environment, else the
    default), except that `None` is null as in ChatLearn (`${X:None}`); an unset variable with no default
    makes it null, with one warning naming the variable and the key. Inside a longer string the result stays
    a string, and there an unset variable with no default is an error (null cannot be part of a string).
    """
    if isinstance(value, dict):
        return {k: _substitute(v, where, errors, (*path, k)) for k, v in value.items()}
    if isinstance(value, list):
        return [_substitute(v, where, errors, path) for v in value]
    if not isinstance(value, str) or "${" not in value:
        return value
    if whole := _ENV.fullmatch(value):
        name, default = whole.groups()
        text = os.environ.get(name, default)
        if text is None:
            logger.warning("%s: environment variable %s is not set and has no default: read as null (export %s=... "
                           "or write ${%s:default})", _at(where, path), name, name, name)
            return None
        if text.strip() == "None":
            return None
        try:
            return _yaml(text)  # `${N:4}` -> 4, `${FLAG:true}` -> True, `${L:[1,2]}` -> [1, 2], `${X:}` -> None
        except yaml.YAMLError:
            return text

    def replace(match):
        name, default = match.groups()
        if name in os.environ:
            return os.environ[name]
        if default is not None:
            return default
        errors.append(f"{_at(where, path)}: environment variable {name} is not set and has no default, and a "
                      f"variable inside a longer string cannot be null; export {name}=... or write ${{{name}:default}}")
        return ""

    return _ENV.sub(replace, value)  # inside a longer string: stays a string


def parse_overrides(items: list[str]) -> dict:
    """`["a.b=1", "x=[1,2]"]` -> `{"a": {"b": 1}, "x": [1, 2]}`; values are typed as YAML reads them."""
    errors = []
    out = _parse_overrides(items, errors)
    if errors:
        raise ConfigError(errors)
    return out


def _parse_overrides(items, errors: list) -> dict:
    out = {}
    for item in items:
        key, sep, raw = item.partition("=")
        keys = key.strip().split(".")
        if not sep or not all(keys):
            errors.append(f"{CLI}: {item!r}: not a key=value override; write e.g. runtime.num_episode=3")
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
        value = _yaml(raw)
    except yaml.YAMLError:
        return raw
    if isinstance(value, dict) and not text.startswith("{"):
        return raw
    if value is None and text not in ("", "~", "null", "Null", "NULL"):
        return raw
    return value


# --- validation against the dataclasses ---------------------------------------------------------------------


def _did_you_mean(word, choices, cutoff=0.6) -> str | None:
    """The choice closest to `word` (a likely typo of it), or None."""
    match = difflib.get_close_matches(str(word), sorted(map(str, choices)), n=1, cutoff=cutoff)
    return match[0] if match else None


def _closest(word, choices, what="keys") -> str:
    match = _did_you_mean(word, choices)
    return f"did you mean {match!r}?" if match else f"valid {what}: {', '.join(sorted(map(str, choices)))}"


def _valid_keys(file: str, path: tuple, fields, unknown: list) -> str:
    """The one line per file that follows its unknown keys: the section's valid keys, and where others go."""
    section = f" of {'.'.join(map(str, path))}" if path else ""
    line = f"{file}: valid keys{section}: {', '.join(sorted(fields))}"
    if "args" in fields:
        line += "; put your own keys under `args:`"
        if any(key in megatron_lm_keys() for key in unknown):
            line += (" (a ChatLearn YAML with Megatron-LM keys loads with `config_dialect: chatlearn`, "
                     "docs/migrating_from_chatlearn.md)")
    return line


def _type_name(tp) -> str:
    if tp is type(None):
        return "null"
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(map(repr, typing.get_args(tp)))
    return tp.__name__ if isinstance(tp, type) and not typing.get_args(tp) else str(tp).replace("typing.", "")


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
        hint = _closest(value, typing.get_args(tp), "values") if isinstance(value, str) else ""
        return f"{value!r} is not {_type_name(tp)}; use one of those" + (f" ({hint})" if "mean" in hint else "")
    fix = f"set it to {_type_name(tp)}"
    if isinstance(value, str):
        try:
            if _convert(_yaml(value), tp)[0]:
                fix = "remove the quotes"
        except yaml.YAMLError:
            pass
    return f"expected {_type_name(tp)}, got {type(value).__name__} {value!r}; {fix}"


def _build(cls, data, where: dict, errors: list, path: tuple = (), extra_check=None):
    """An instance of dataclass `cls` from mapping `data` (None if it has errors); `dict` = any mapping."""
    if not isinstance(data, dict):
        errors.append(f"{_at(where, path)}: expected a mapping of `key: value`, got {type(data).__name__} "
                      f"{data!r}; write the keys indented under it")
        return None
    if cls is dict:
        return data
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    before = len(errors)
    kwargs, bad = {}, set()  # bad: keys whose value failed; they take their default for the range checks
    unknown = {}  # file -> its unknown keys with no close match: one line per file lists the valid keys
    for key, value in data.items():
        key_path = (*path, key)
        if key not in fields:
            megatron = "args" in fields and key in megatron_lm_keys()  # a per-model file written for ChatLearn
            match = None if megatron else _did_you_mean(key, fields)
            errors.append(f"{_at(where, key_path)}: unknown key" + (f"; did you mean {match!r}?" if match else "")
                          + (" (a Megatron-LM argument)" if megatron else ""))
            if match is None:
                unknown.setdefault(_source(where, key_path)[0], []).append(key)
            continue
        if dataclasses.is_dataclass(hints[key]):
            ok, built = True, _build(hints[key], value, where, errors, key_path)
            ok = built is not None
        else:
            ok, built = _convert(value, hints[key])
            if not ok:
                errors.append(f"{_at(where, key_path)}: {_type_error(value, hints[key])}")
        if ok:
            kwargs[key] = built
        else:
            bad.add(key)
    errors.extend(_valid_keys(file, path, fields, keys) for file, keys in unknown.items())
    required = [n for n, f in fields.items()
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    for name in required:
        if name not in data:
            doc = fields[name].metadata.get("doc")
            errors.append(f"{_at(where, (*path, name))}: required key is missing; add `{name}: ...`"
                          + (f" ({doc})" if doc else ""))
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
            errors.append(f"{_at(where, (*path, key))}: {problem}")
    return obj if complete else None


SCHEMA_MARKER = re.compile(r"#\s*chatgen-schema:\s*(\S+)\s*(.*)")


def schema_marker(path) -> tuple | None:
    """(schema, reason) from a `# chatgen-schema: <schema> [reason]` line in a YAML's first 5 lines, else None.

    A per-model YAML that no main YAML reads names its schema this way (`vllm`, `megatron`, `python`,
    `package.module:DataclassName`, or `none <why>` for a YAML that is not a chatgen config), so that
    `chatgen config FILE` and the shipped-config test know how to validate it.
    """
    with open(path, encoding="utf-8") as f:
        for _, line in zip(range(5), f):
            if m := SCHEMA_MARKER.match(line.strip()):
                return m.group(1), m.group(2)
    return None


def resolve_schema(schema):
    """A schema class from a backend name ('vllm', 'megatron', 'python'), 'package.module:Class', or a class."""
    if not isinstance(schema, str):
        return schema
    if schema in SCHEMAS:
        return SCHEMAS[schema]
    module, _, name = schema.partition(":")
    if not name:
        raise ValueError(f"schema {schema!r}: use one of {', '.join(SCHEMAS)} or 'package.module:DataclassName'")
    return getattr(importlib.import_module(module), name)


# --- the chatlearn dialect ----------------------------------------------------------------------------------


@functools.cache
def megatron_lm_keys() -> frozenset:
    """Megatron-LM's argument names, from megatron_lm_keys.txt (its header says how the list was made)."""
    text = Path(__file__).with_name("megatron_lm_keys.txt").read_text(encoding="utf-8")
    return frozenset(line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#"))


# ChatLearn's spellings of chatgen keys: ChatLearn key -> (chatgen key, chatgen value of a ChatLearn value; None =
# sets nothing). Each applies where the schema has the chatgen key and not the ChatLearn one.
CHATLEARN_SPELLINGS = {
    "bf16": ("dtype", lambda on: "bfloat16" if on else None),
    "fp16": ("dtype", lambda on: "float16" if on else None),
    "tensor_model_parallel_size": ("tensor_parallel_size", lambda size: size),  # a vLLM model's TP in ChatLearn
}


def _read_chatlearn(data: dict, where: dict, schema, errors: list, label: str) -> dict:
    """The keys of a ChatLearn-style per-model YAML as chatgen reads them (the chatlearn dialect).

    A key of the schema is read as usual. A ChatLearn spelling of a chatgen key (CHATLEARN_SPELLINGS:
    `bf16: true` -> `dtype: bfloat16`, a vLLM model's `tensor_model_parallel_size` -> `tensor_parallel_size`)
    is read as that key unless the file set the chatgen key itself. Any other Megatron-LM argument
    (megatron_lm_keys.txt) is ignored. Every remaining key is the user's and goes to `args:`, where an explicit
    `args:` entry wins; a key one typo away from a chatgen key is an error instead. One log line each lists
    the ignored keys, the spellings read and the keys sent to `args:`.
    """
    if schema is dict:
        return data  # a python model: every key is the user's already
    fields = {f.name for f in dataclasses.fields(schema)}
    if "args" not in fields:
        errors.append(f"{label}: the chatlearn dialect sends unknown keys to `args:`, and {schema.__name__} has no "
                      "`args` field; read this file with the chatgen dialect")
        return data
    out, user, ignored, spelled, routed = {}, {}, [], [], []
    for key, value in data.items():
        spelling = CHATLEARN_SPELLINGS.get(key)
        if key in fields:
            out[key] = value
        elif spelling and spelling[0] in fields:
            target, convert = spelling
            chatgen_value = convert(_substitute(value, where, errors, (key,)))
            if chatgen_value is None or target in data:
                ignored.append(key)  # switched off, or the file sets the chatgen key itself
            elif target in out and out[target] != chatgen_value:
                errors.append(f"{_at(where, (key,))}: sets {target} to {chatgen_value!r}, and another ChatLearn key "
                              f"sets it to {out[target]!r}; keep one of them")
            else:
                out[target] = chatgen_value
                where[(target,)] = _source(where, (key,))
                spelled.append(f"{key} -> {target}: {chatgen_value}")
        elif key in megatron_lm_keys():
            ignored.append(key)
        elif match := _did_you_mean(key, fields - {"args"}, cutoff=0.85):
            errors.append(f"{_at(where, (key,))}: unknown key; did you mean {match!r}? (the chatlearn dialect sends "
                          "unknown keys to `args:`, but not one this close to a chatgen key: fix its spelling, or "
                          "move it under `args:` if it is yours)")
        else:
            user[key] = value
            where[("args", key)] = _source(where, (key,))
            routed.append(key)
    if routed:
        explicit = data.get("args") or {}
        out["args"] = {**user, **explicit} if isinstance(explicit, dict) else explicit  # not a mapping: _build says so
    if ignored:
        logger.warning("%s (chatlearn dialect): ignored %d Megatron-LM key(s) that %s does not have: %s", label,
                       len(ignored), schema.__name__, ", ".join(sorted(ignored)))
    if spelled:
        logger.info("%s (chatlearn dialect): read ChatLearn's spellings of chatgen keys: %s", label, ", ".join(spelled))
    if routed:
        logger.info("%s (chatlearn dialect): %d key(s) chatgen does not know went to `args:` (your keys, in "
                    "model_args): %s", label, len(routed), ", ".join(sorted(routed)))
    return out


def _read_dialect(dialect: str, data: dict, where: dict, schema, errors: list, label: str) -> dict:
    if dialect == "chatlearn":
        return _read_chatlearn(data, where, schema, errors, label)
    return data


def model_args(config) -> dict:
    """ChatLearn's `model_args` of a per-model config: its typed keys and its `args` keys in one flat dict.

    A new dict (deep copy): changing it leaves the config as it is. A user key that repeats a typed key is an
    error (the loader refuses it already; this catches a config built in code).
    """
    if problem := args_problem(config):
        raise ConfigError([f"args: {problem}"])
    typed = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name != "args"}
    return copy.deepcopy({**typed, **config.args})


# --- public entry points ------------------------------------------------------------------------------------


def load_model_config(path: str | os.PathLike | None, schema="vllm", overrides: list[str] | dict = (),
                      extra_check=None, dialect: str = "chatgen"):
    """One per-model YAML (flat keys; includes, ${VAR}) plus flat `key=value` overrides, as `schema`.

    `path=None` starts from the schema's defaults. `overrides` may also be a dict of typed values (keys set
    from code, e.g. `load_model_config(None, VLLMConfig, {"load": d, "n": 4})`), checked the same way.
    `extra_check(obj)` yields (key, problem) pairs for checks that need more than the config (e.g. the
    platform it runs on); they are reported with every other problem. `dialect="chatlearn"` reads a YAML
    written for ChatLearn (Megatron-LM keys ignored, unknown keys -> `args:`; docs/migrating_from_chatlearn.md).
    Raises ConfigError listing every problem.
    """
    if dialect not in DIALECTS:
        raise ValueError(f"dialect {dialect!r}: use one of {', '.join(DIALECTS)}")
    schema = resolve_schema(schema)
    errors, files = [], []
    source = "overrides" if isinstance(overrides, dict) else CLI
    data, where = _read(os.fspath(path), errors, files) if path is not None else ({}, {(): (source, "")})
    overrides_tree = dict(overrides) if isinstance(overrides, dict) else _parse_overrides(overrides, errors)
    _merge(data, where, overrides_tree, dict.fromkeys(_paths(overrides_tree), (source, "")))
    label = _show(os.path.abspath(os.fspath(path))) if path is not None else source
    data = _substitute(_read_dialect(dialect, data, where, schema, errors, label), where, errors)
    obj = _build(schema, data, where, errors, extra_check=extra_check)
    if errors:
        raise ConfigError(errors)
    return obj


def load_config(main_yaml: str | os.PathLike, overrides: list[str] = ()) -> ChatgenConfig:
    """The main YAML (`runtime:` + `models:`), each model's `model_config_file`, and `key=value` overrides.

    Override paths: `runtime.num_episode=3`, `models.policy.num_gpu=1` (entry keys), `models.policy.temperature=0.5`
    or its shortcut `policy.temperature=0.5` (per-model keys). Raises ConfigError listing every problem.
    """
    errors, files = [], []
    main_yaml = os.path.abspath(os.fspath(main_yaml))
    data, where = _read(main_yaml, errors, files)
    if errors and not data:
        raise ConfigError(errors)  # nothing to validate: the main YAML is missing, empty or unreadable
    overrides_tree = _route_overrides(_parse_overrides(overrides, errors), data, errors)
    _merge(data, where, overrides_tree, dict.fromkeys(_paths(overrides_tree), (CLI, "")))
    data = _substitute(data, where, errors)

    runtime_data = data.get("runtime") or {}
    algorithm, roles = _load_algorithm(runtime_data, where, errors)
    for key in data:
        if key not in ("runtime", "models"):
            from_cli = where.get((key,), ("",))[0] == CLI
            models = data.get("models") if from_cli and isinstance(data.get("models"), dict) else {}
            if key in roles and from_cli:
                errors.append(f"{CLI}: {key}: no model {key!r} under models; configured: {', '.join(models)}")
                continue
            choices = ("runtime", "models", *models)
            errors.append(f"{_at(where, (key,))}: unknown top-level key; {_closest(key, choices)}")
    runtime = _build(RuntimeConfig, runtime_data, where, errors, ("runtime",))
    if runtime is not None:
        runtime.algorithm = algorithm
        if runtime.train_global_batch_size is None:
            runtime.train_global_batch_size = runtime.sample_per_episode
    models_data = data.get("models")
    if not isinstance(models_data, dict) or not models_data:
        errors.append(f"{_at(where, ('models',))}: no models; add e.g. `models: {{policy: {{backend: vllm, "
                      "model_config_file: policy.yaml}}`")
        models_data = {}
    models = {}
    for name, entry_data in models_data.items():
        entry = _load_entry(name, entry_data, os.path.dirname(main_yaml), runtime, roles, where, errors, files)
        if entry is not None:
            models[name] = entry
    if runtime is not None:
        _check_colocation(runtime, models, where, errors)
    if errors:
        raise ConfigError(errors)
    return ChatgenConfig(runtime=runtime, models=models, path=main_yaml, overrides=list(overrides),
                         files=list(dict.fromkeys(files)))


def _route_overrides(tree: dict, data: dict, errors: list) -> dict:
    """`policy.x=` -> `models.policy.x`; `models.<name>.<per-model key>` -> `models.<name>.config.<key>`."""
    models = dict(data.get("models")) if isinstance(data.get("models"), dict) else {}
    if isinstance(tree.get("models"), dict):  # a model added on the command line takes shortcuts too
        for name, sub in tree["models"].items():
            models.setdefault(name, sub)
    shortcuts = {key: tree.pop(key) for key in list(tree) if key not in ("runtime", "models") and key in models}
    if shortcuts:
        tree.setdefault("models", {})
    if not isinstance(tree.get("models"), dict):
        return tree  # no model overrides, or `models=<not a mapping>` (reported by the validation)
    _merge(tree["models"], {}, shortcuts, {})
    entry_keys = [f.name for f in dataclasses.fields(ModelEntry)]
    for name, sub in tree["models"].items():
        if not isinstance(sub, dict) or not isinstance(sub.get("config", {}), dict):
            continue
        extra = {k: sub.pop(k) for k in list(sub) if k not in entry_keys}
        backend = models[name].get("backend") if isinstance(models.get(name), dict) else None
        for key in extra:
            # a python model's keys are free: a near-miss of an entry key would vanish into them unnoticed
            if backend == "python" and difflib.get_close_matches(key, entry_keys, n=1, cutoff=0.8):
                errors.append(f"{CLI}: models.{name}.{key}: unknown model entry key; {_closest(key, entry_keys)} "
                              f"(a python model's own keys go under models.{name}.config.{key})")
        _merge(sub.setdefault("config", {}), {}, extra, {})
    return tree


def _load_algorithm(runtime_data, where: dict, errors: list):
    """(the algorithm's typed section, its MODELS roles) from `runtime.algorithm` (popped from runtime_data)."""
    from chatgen.rlhf import algorithms

    section = runtime_data.pop("algorithm", None) if isinstance(runtime_data, dict) else None
    section = {} if section is None else section
    name = section.get("name", "grpo") if isinstance(section, dict) else "grpo"
    try:
        module = algorithms.load(name)
    except ValueError as e:
        errors.append(f"{_at(where, ('runtime', 'algorithm', 'name'))}: {e}")
        return None, {}
    return _build(module.Config, section, where, errors, ("runtime", "algorithm")), module.MODELS


def _load_entry(name, entry_data, main_dir: str, runtime, roles: dict, where: dict, errors: list, files: list):
    path = ("models", name)
    if roles and name not in roles:
        algorithm = runtime.algorithm.name if runtime is not None and runtime.algorithm is not None else "the algorithm"
        errors.append(f"{_at(where, path)}: not a model of {algorithm}; "
                      f"{_closest(name, roles, 'model names')}")
        return None
    if not isinstance(entry_data, dict):
        return _build(ModelEntry, entry_data, where, errors, path)  # reports the non-mapping
    entry_data = dict(entry_data)
    inline = entry_data.pop("config", None) or {}
    if not isinstance(inline, dict):
        errors.append(f"{_at(where, (*path, 'config'))}: expected a mapping of per-model keys, got "
                      f"{type(inline).__name__}; write the keys indented under `config:`")
        return None
    entry_keys = {f.name for f in dataclasses.fields(ModelEntry)}
    schema = SCHEMAS.get(entry_data.get("backend"), dict)
    for key in [k for k in entry_data if k not in entry_keys]:
        if schema is not dict and key in {f.name for f in dataclasses.fields(schema)}:
            del entry_data[key]
            errors.append(f"{_at(where, (*path, key))}: a per-model key, not a model entry key; move it into "
                          f"the model_config_file or under models.{name}.config")
    entry = _build(ModelEntry, entry_data, where, errors, path)
    if entry is None:
        return None

    data, model_where = {}, {(): where[()]}
    if entry.model_config_file:
        target = os.path.join(main_dir, os.path.expanduser(entry.model_config_file))
        data, model_where = _read(target, errors, files, _at(where, (*path, "model_config_file")))
    inline_where = {p[3:]: (file, f"{prefix}models.{name}.config.") for p, (file, prefix) in where.items()
                    if p[:3] == (*path, "config") and len(p) > 3}
    _merge(data, model_where, inline, inline_where)
    schema = SCHEMAS[entry.backend] if entry.backend != "python" else _class_schema(entry, where, path, errors)
    if schema is None:
        return None
    data = _read_dialect(entry.config_dialect, data, model_where, schema, errors, f"models.{name}")
    data = _substitute(data, model_where, errors)  # after the dialect: an ignored key needs no variable
    entry.config = _build(schema, data, model_where, errors)
    if runtime is not None and entry.config is not None:
        _derive(entry, runtime, model_where, errors)
    return entry


def _class_schema(entry: ModelEntry, where: dict, path: tuple, errors: list):
    """A python model's config schema: its class's `config_class` (chatgen.Module), imported here in the driver so
    that a bad key fails before anything starts."""
    from chatgen.core.imports import import_class

    try:
        cls = import_class(entry.model_class)
    except ValueError as e:
        errors.append(f"{_at(where, (*path, 'model_class'))}: {e}")
        return None
    return getattr(cls, "config_class", dict)


def _derive(entry: ModelEntry, runtime: RuntimeConfig, where: dict, errors: list) -> None:
    """Fill a model's batch dials left at None from the runtime; a trainer's explicit ones must agree."""
    cfg = entry.config
    if isinstance(cfg, VLLMConfig) and cfg.generation_batch_size is None:
        cfg.generation_batch_size = runtime.generation_batch_size
    if isinstance(cfg, MegatronConfig):
        for key, runtime_key in (("micro_batch_size", "train_micro_batch_size"),
                                 ("global_batch_size", "train_global_batch_size")):
            runtime_value = getattr(runtime, runtime_key)
            if getattr(cfg, key) is None:
                setattr(cfg, key, runtime_value)
            elif entry.trainable and getattr(cfg, key) != runtime_value:
                errors.append(f"{_at(where, (key,))}: {getattr(cfg, key)} disagrees with runtime.{runtime_key}="
                              f"{runtime_value}; remove it (a trainer takes the runtime's value)")


def _check_colocation(runtime: RuntimeConfig, models: dict, where: dict, errors: list) -> None:
    seen = set()
    for group in runtime.colocation:
        for name in group:
            if name not in models:
                errors.append(f"{_at(where, ('runtime', 'colocation'))}: {name!r} is not a configured model; "
                              f"{_closest(name, models, 'models')}")
            elif name in seen:
                errors.append(f"{_at(where, ('runtime', 'colocation'))}: {name!r} is in two groups; "
                              "put each model in one group")
            seen.add(name)


def to_dict(cfg) -> dict:
    """Plain dicts/lists/scalars of a ChatgenConfig (runtime + models) or of any schema dataclass."""
    if isinstance(cfg, ChatgenConfig):
        return {"runtime": dataclasses.asdict(cfg.runtime),
                "models": {name: dataclasses.asdict(entry) for name, entry in cfg.models.items()}}
    return dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else dict(cfg)


def format_config(cfg) -> str:
    """The resolved config as YAML text, for the log at start (`logger.info("%s", format_config(cfg))`)."""
    head = ""
    if isinstance(cfg, ChatgenConfig) and cfg.path:
        head = f"# resolved from {' '.join([_show(cfg.path), *cfg.overrides])}\n"
    return head + yaml.safe_dump(to_dict(cfg), sort_keys=False, allow_unicode=True)


def save_resolved(cfg: ChatgenConfig, out_dir: str | os.PathLike | None = None) -> str:
    """Write `<out_dir>/resolved_config.yaml` (default out_dir: runtime.output_dir); returns its path.

    Every include, ${VAR} and override is applied and each model's keys are inline under `config:`, so
    `load_config(<that file>)` gives back the same config without the original files.
    """
    out_dir = os.fspath(out_dir if out_dir is not None else cfg.runtime.output_dir)
    os.makedirs(out_dir, exist_ok=True)
    out = os.path.join(out_dir, RESOLVED_NAME)
    data = to_dict(cfg)
    for entry in data["models"].values():
        entry["model_config_file"] = None  # its keys are all inline now
    source = " ".join([_show(cfg.path), *cfg.overrides]) if cfg.path else "(built in code)"
    with open(out, "w", encoding="utf-8") as f:
        f.write(f"# chatgen config {_show(out)}\n# resolved from: {source}\n"
                f"# files read: {', '.join(_show(p) for p in cfg.files) or '-'}\n")
        yaml.safe_dump(data, f, sort_keys=False, allow_unicode=True)
    return out
