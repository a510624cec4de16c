"""YAML as a config reads it: PyYAML's SafeLoader, bounded (size, aliases, nesting) and stricter (a
key given twice is refused; `1e-5` is a float; dates stay strings). chatgen.config.loader reads
every file and `${VAR:default}` and override value through parse_yaml.
"""

import re

import yaml

# A config is a few kB. The bounds stop what a hostile or broken file could do to a loader that
# trusts it: a "billion laughs" file (aliases of aliases: a few hundred bytes that expand to 10^9
# values) used to run the process out of memory (MemoryError) once anything walked the data, and a
# huge file takes PyYAML minutes.
MAX_YAML_CHARS = 1 << 20
MAX_YAML_VALUES = (
    100_000  # scalars, lists and mappings of one document, every alias counted as what it repeats
)


class YAMLTooLarge(yaml.YAMLError):
    """A YAML text over MAX_YAML_CHARS, or a document over MAX_YAML_VALUES values once its
    aliases are expanded."""


def _expanded_values(node, memo: dict) -> int:
    """Values in the document under `node` with every alias (a repeat of an anchored node)
    counted in full; a node that contains itself (`&a [*a]`) is refused."""
    key = id(node)
    if key in memo:
        if memo[key] is None:
            raise YAMLTooLarge(
                f"line {node.start_mark.line + 1}: an alias refers to a node that contains it "
                "(a recursive anchor); a config cannot hold one, write the values out"
            )
        return memo[key]
    memo[key] = None
    if isinstance(node, yaml.MappingNode):
        children = [n for pair in node.value for n in pair]
    else:
        children = node.value if isinstance(node, yaml.SequenceNode) else []
    total = 1
    for child in children:
        total += _expanded_values(child, memo)
        if total > MAX_YAML_VALUES:
            break
    memo[key] = total
    return total


class ConfigLoader(yaml.SafeLoader):
    """SafeLoader that reads `1e-5` as a float (YAML 1.1 wants `1.0e-5`) and dates as plain
    strings, refuses a key given twice in one mapping (PyYAML would keep the last value without a
    word; merge keys `<<` are YAML's own overrides and pass), and refuses a document whose
    aliases expand it past MAX_YAML_VALUES values (checked on the node graph, before any value is
    built)."""

    def compose_document(self):
        node = super().compose_document()
        if node is not None and _expanded_values(node, {}) > MAX_YAML_VALUES:
            raise YAMLTooLarge(
                f"the document holds more than {MAX_YAML_VALUES} values once its aliases (*name) are "
                "expanded (aliases of aliases multiply: a 'billion laughs' file); a config needs "
                "far fewer: write the values out, or use includes"
            )
        return node

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *defaults`: SafeLoader merges it
                continue  # (keys written beside it override the merged ones, as YAML means)
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, (str, int, float, bool)):
                continue  # an unhashable key: SafeLoader's own error follows
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"key {key!r} appears twice in one mapping (lines {seen[key] + 1} and "
                    f"{key_node.start_mark.line + 1}); keep one",
                    key_node.start_mark,
                )
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep)


ConfigLoader.yaml_implicit_resolvers = {
    first: [(tag, regex) for tag, regex in resolvers if tag != "tag:yaml.org,2002:timestamp"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
ConfigLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def parse_yaml(text):
    """The YAML value of a string or a text file, within the bounds above (YAMLTooLarge
    otherwise)."""
    if not isinstance(text, str):
        text = text.read(MAX_YAML_CHARS + 1)
    if len(text) > MAX_YAML_CHARS:
        raise YAMLTooLarge(
            f"over {MAX_YAML_CHARS} characters; a config file is a few kB: is it the right file?"
        )
    try:
        return yaml.load(text, Loader=ConfigLoader)
    except RecursionError:  # PyYAML composes nested lists and mappings recursively
        raise YAMLTooLarge(
            "nested deeper than the loader follows; a config nests a few levels"
        ) from None
