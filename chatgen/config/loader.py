"""Load a config: YAML files + `includes:` + `${VAR:default}` + command-line `key=value` overrides,
merged into one tree (chatgen.config.typed then checks it against a dataclass and builds it).

Layers, lowest first: included files (in list order), the including file, command-line overrides.
Mappings merge key by key; anything else is replaced whole. `${VAR}` is substituted after merging,
so only the values that survive need their variables. Validation runs against a dataclass
(schema.py's `opt` fields) and collects every problem into one ConfigError, one line each: `<file>:
<dotted.key>: <problem>; <fix>`.

This module knows no schema: the main YAML (runtime + models + algorithm) is assembled with these
pieces by chatgen.rlhf.config.load_config, a per-model YAML by
chatgen.config.typed.load_model_config.
"""

import logging
import os
import re

import yaml

from chatgen.config.safe_yaml import YAMLTooLarge, parse_yaml

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
    """A path (str or os.PathLike) as the user would type it: relative to the current directory
    when below it."""
    path = os.fspath(path)
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


# --- provenance: `where` maps a key path (tuple) to (file, shown key prefix)
# -------------------------------


def source_of(where: dict, path: tuple) -> tuple[str, str]:
    """(file, shown key prefix) of the file that set the key at `path` (or its nearest parent)."""
    return next(where[path[:i]] for i in range(len(path), -1, -1) if path[:i] in where)


def at(where: dict, path: tuple) -> str:
    """'<file>: <dotted.key>' for error lines; the file is the one that set the key (or its
    nearest parent)."""
    file, prefix = source_of(where, path)
    return f"{file}: {prefix}{'.'.join(map(str, path))}" if path else file


def key_paths(data: dict, prefix: tuple = ()):
    for key, value in data.items():
        yield (*prefix, key)
        if isinstance(value, dict):
            yield from key_paths(value, (*prefix, key))


def merge(dst: dict, dst_where: dict, src: dict, src_where: dict, prefix: tuple = ()) -> None:
    """Deep-merge `src` into `dst` in place: `src` wins; mappings merge key by key, other values
    are replaced."""
    for key, value in src.items():
        path = (*prefix, key)
        if isinstance(value, dict) and isinstance(dst.get(key), dict):
            merge(dst[key], dst_where, value, src_where, path)
            continue
        dst[key] = value
        for old in [p for p in dst_where if p[: len(path)] == path]:
            del dst_where[old]
        dst_where.update((p, w) for p, w in src_where.items() if p[: len(path)] == path)


# --- reading files
# ------------------------------------------------------------------------------------------


def read_yaml(
    path: str, errors: list, files: list, ref: str | None = None, stack: tuple = ()
) -> tuple[dict, dict]:
    """(data, where) of one YAML file with its `includes:` merged under it (the including file
    wins)."""
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
    """`data` (plain dicts / lists / scalars) fit to show or write: the value of a key named like
    a secret (SECRET_KEY: api_key, hf_token, *secret*, *password*, ...) is MASK, and the text of
    an environment variable a config read through ${VAR} is written back as `${VAR}` (so a file
    written from it reads the same once loaded again, in the same environment)."""
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
    """Replace `${VAR}` / `${VAR:default}`, reading a whole value the way ChatLearn's YAML parser
    does.

    A value that is one whole `${...}` gets the YAML type of its text (from the environment, else
    the default), except that `None` is null as in ChatLearn (`${X:None}`); an unset variable with
    no default makes it null, with one warning naming the variable and the key. Inside a longer
    string the result stays a string, and there an unset variable with no default is an error (null
    cannot be part of a string).
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
            # `${N:4}` -> 4, `${FLAG:true}` -> True, `${L:[1,2]}` -> [1, 2], `${X:}` -> None
            return parse_yaml(text)
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
    """`["a.b=1", "x=[1,2]"]` -> `{"a": {"b": 1}, "x": [1, 2]}`; values are typed as YAML reads
    them."""
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
    """A command-line value typed as YAML reads it (3 -> int, true -> bool, [1, 2] -> list),
    except where YAML would silently change the text: `Question: ;</s>` (a mapping), `#dir` (a
    comment, i.e. null) or a YAML syntax error stay the string as typed. Write `{a: 1}` for a
    mapping and `null` for null."""
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
