"""A code completion on the page stays in the block the cursor is in (common/code_blocks.py): the job it sends
asks the worker to stop before a line indented less than the cursor's statement (llama.cpp's n_indent)."""

from __future__ import annotations

import pytest

from common.code_blocks import cursor_block_indent
from playground.jobs import spec_from_frame


@pytest.mark.parametrize(
    "prefix,columns",
    [
        ("", 0),
        ("x = ", 0),  # the top level: no limit
        ("def f(a):\n    return ", 4),  # the cursor's own line
        ("def f(a):\n    if a:\n", 4),  # an empty line: the last line above with code
        ("def f(a):\n    if a:\n        ", 8),  # whitespace typed on the cursor's line
        ("class C:\n    def m(self):\n\t\tx = 1\n\n\n", 2),  # blank lines skipped; a tab is a column
    ],
)
def test_the_cursors_block_indent(prefix, columns):
    assert cursor_block_indent(prefix) == columns


def test_a_page_code_completion_carries_the_cursors_block_indent_and_a_plain_prompt_none():
    models = {"coder": {"chat": False, "fim": True}}
    frame = {"prompt": "def f(a):\n    return ", "suffix": "\n\nprint(f(1))\n", "temperature": 0}
    assert spec_from_frame(frame, models).params == {"temperature": 0, "n_indent": 4}
    assert "n_indent" not in spec_from_frame({"prompt": "def f(a):\n    "}, models).params
