"""Where a code completion's block ends: the indentation the page asks a fill-in-the-middle reply to keep
(llama.cpp's n_indent, inference/engine.py IndentStop)."""

from __future__ import annotations


def depth(line: str) -> int:
    """Columns of leading spaces and tabs (a tab counts one, as llama.cpp counts them)."""
    return len(line) - len(line.lstrip(" \t"))


def cursor_block_indent(prefix: str) -> int:
    """The indentation of the statement the cursor is in or after, for the code before the cursor: the cursor's
    own line where it holds anything, else the last line above with code. A reply that writes a line less
    indented than that has left the block the person is editing. 0 at the top level (no limit)."""
    lines = prefix.split("\n")
    if lines[-1]:
        return depth(lines[-1])
    for line in reversed(lines[:-1]):
        if line.strip():
            return depth(line)
    return 0
