# python scripts/hoist_comments.py FILE... && ruff format   (applied once to the tree, with the formatter)
"""Hoist a trailing comment off the closing line of a statement the formatter split only because of that
comment: `x = f(\n    a\n)  # why` becomes `# why\nx = f(a)` once `ruff format` runs again.

    python hoist_comments.py FILE...   (then: ruff format FILE...)
"""

import ast
import io
import textwrap
import sys
import tokenize


def statements(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.stmt):
            yield node


def header_end(node) -> int | None:
    """The last line of a compound statement's header (the line before its body), None for simple ones."""
    body = getattr(node, "body", None)
    if isinstance(body, list) and body and isinstance(body[0], ast.stmt):
        return body[0].lineno - 1
    return None


def hoist(path: str) -> int:
    src = open(path).read()
    lines = src.split("\n")
    tree = ast.parse(src)
    trailing = {}  # line -> (col, text) of a comment after code on that line
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            row, col = tok.start
            before = lines[row - 1][:col]
            pragma = any(word in tok.string for word in ("noqa", "type:", "fmt:", "pragma"))
            if before.strip() and before.lstrip()[0] in ")]}" and not pragma:
                trailing[row] = (col, tok.string)
    if not trailing:
        return 0
    owner = {}  # comment line -> the statement it closes (innermost: the latest start)
    for node in statements(tree):
        end = header_end(node) or node.end_lineno
        if end in trailing and node.lineno < end:
            if end not in owner or node.lineno > owner[end].lineno:
                owner[end] = node
    edits = sorted(owner.items(), reverse=True)
    for end, node in edits:
        col, text = trailing[end]
        lines[end - 1] = lines[end - 1][:col].rstrip()
        first = lines[node.lineno - 1]
        indent = first[: len(first) - len(first.lstrip())]
        body = text.lstrip("#").strip()
        wrapped = textwrap.wrap(body, 100 - len(indent) - 2, break_long_words=False) or [""]
        lines[node.lineno - 1 : node.lineno - 1] = [f"{indent}# {part}" for part in wrapped]
    open(path, "w").write("\n".join(lines))
    return len(edits)


if __name__ == "__main__":
    total = sum(hoist(p) for p in sys.argv[1:])
    print(f"hoisted {total} comments")
