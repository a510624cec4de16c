"""Wrap the prose of Python files at 100 columns: docstrings and comment lines that `ruff format` leaves long.

    python scripts/wrap_prose.py chatgen/            # rewrites in place; prints the files it changed
    python scripts/wrap_prose.py --check chatgen/    # lists them, changes nothing (exit 1 if any)

Only paragraphs holding a line over the width are re-flowed, so a file's other text stays as written. A
paragraph is a run of lines at one indentation, ended by a blank line or a change of indentation; a bullet
("- ", "* ", "1. ") starts one of its own and its continuation lines hang under its text. Lines that are
not prose are never touched: indented further than their paragraph (examples, code), tables ("|"), lines
without a space to break at (a URL), doctest prompts and `noqa` / `type:` comments.
"""

import argparse
import ast
import io
import re
import sys
import textwrap
import tokenize
from pathlib import Path

WIDTH = 100
BULLET = re.compile(r"^(\s*)([-*]|\d+[.)])\s+")
KEEP = re.compile(r"^\s*(\||>>>|\.\.\.|```|\+-)")


def reflow(lines: list, width: int, base: int) -> list:
    """Re-wrap `lines` (no newlines) where a paragraph holds a line over `width`; `base`: the prose's
    indentation (a line indented further that no bullet starts is an example: kept)."""
    out, i = [], 0
    while i < len(lines):
        line = lines[i]
        bullet = BULLET.match(line)
        indent = len(line) - len(line.lstrip())
        if not line.strip() or KEEP.match(line) or (indent > base and not bullet):
            out.append(line)
            i += 1
            continue
        hang = indent + (len(bullet.group(0)) - len(bullet.group(1)) if bullet else 0)
        j = i + 1
        while j < len(lines):
            nxt = lines[j]
            if not nxt.strip() or KEEP.match(nxt) or BULLET.match(nxt):
                break
            if len(nxt) - len(nxt.lstrip()) != hang:
                break
            j += 1
        para = lines[i:j]
        if any(len(p) > width for p in para) and all(" " in p.strip() for p in para):
            text = " ".join(p.strip() for p in para)
            first = " " * indent
            wrapped = textwrap.wrap(
                text,
                width=width,
                initial_indent=first,
                subsequent_indent=" " * hang,
                break_long_words=False,
                break_on_hyphens=False,
            )
            out.extend(wrapped)
        else:
            out.extend(para)
        i = j
    return out


def docstring_spans(source: str) -> list:
    """(first line, last line) 1-based of every docstring that spans several lines."""
    spans = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                if isinstance(body[0].value.value, str):
                    spans.append((body[0].lineno, body[0].end_lineno))
    return spans


def wrap_docstring(lines: list, first: int, last: int, width: int) -> None:
    """Re-wrap the docstring on lines[first-1:last] in place (its opening and closing quote lines too:
    their text is prose as well, the quotes stay where they are)."""
    block = lines[first - 1 : last]
    opening = re.match(r'^(\s*)([rRbBuU]?("""|\'\'\'))', block[0])
    if opening is None:
        return
    quote = opening.group(3)
    head = opening.group(0)
    body = [block[0][len(head) :], *block[1:]]
    closing = ""
    if body[-1].rstrip().endswith(quote):
        stripped = body[-1].rstrip()
        body[-1], closing = stripped[: -len(quote)], quote
    indent = opening.group(1)
    # the first line's text sits after the quotes: wrap it as if indented by them
    marker = "\0" * len(head.lstrip())
    body[0] = indent + marker + body[0]
    flowed = reflow(
        body, width - (len(closing) if closing and body[-1].strip() else 0), len(indent)
    )
    flowed[0] = flowed[0].replace(marker, head.lstrip(), 1)
    if not flowed[0].startswith(head):
        return  # the opening line was merged away: leave this docstring as it was
    flowed[-1] = flowed[-1] + closing
    if any(line.count("\0") for line in flowed):
        return
    lines[first - 1 : last] = flowed


def comment_lines(source: str) -> set:
    """Line numbers (1-based) holding a comment and nothing else."""
    found = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT and tok.line.strip().startswith("#"):
            found.add(tok.start[0])
    return found


def wrap_comments(lines: list, numbers: set, width: int) -> list:
    """Re-wrap runs of whole-line comments that hold a line over `width`."""
    out, i = [], 0
    while i < len(lines):
        if i + 1 not in numbers:
            out.append(lines[i])
            i += 1
            continue
        j = i
        indent = lines[i][: len(lines[i]) - len(lines[i].lstrip())]
        while j < len(lines) and j + 1 in numbers and lines[j].startswith(indent + "#"):
            j += 1
        run = lines[i:j]
        texts = [line.strip()[1:] for line in run]
        if any(len(line) > width for line in run) and not any(
            re.search(r"noqa|type:|pragma|fmt:", t) for t in texts
        ):
            body = [(" " + t.strip()) if t.strip() else "" for t in texts]
            flowed = reflow(body, width - len(indent) - 1, 1)
            out.extend(indent + "#" + t if t.strip() else indent + "#" for t in flowed)
        else:
            out.extend(run)
        i = j
    return out


def wrap_file(path: Path, width: int = WIDTH) -> bool:
    source = path.read_text()
    lines = source.split("\n")
    for first, last in sorted(docstring_spans(source), reverse=True):
        wrap_docstring(lines, first, last, width)
    text = "\n".join(lines)
    lines = wrap_comments(text.split("\n"), comment_lines(text), width)
    new = "\n".join(lines)
    if new == source:
        return False
    ast.parse(new)  # never write a file that no longer parses
    path.write_text(new)
    return True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+")
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    files = [
        f for p in map(Path, args.paths) for f in (sorted(p.rglob("*.py")) if p.is_dir() else [p])
    ]
    changed = []
    for f in files:
        if args.check:
            original = f.read_text()
            if wrap_file(f):
                changed.append(f)
                f.write_text(original)
        elif wrap_file(f):
            changed.append(f)
    for f in changed:
        print(f)
    return 1 if args.check and changed else 0


if __name__ == "__main__":
    sys.exit(main())
