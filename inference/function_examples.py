"""Short documented functions cut out of the training files, as training documents of their own.

What a newcomer types first is a `def` line with a one-line docstring, and asks for the body. Library
files hold many functions of that shape, but inside long modules, after imports and classes, with
docstrings of many paragraphs. Each function or method whose first statement is a docstring and whose
body after it is a few lines becomes a document that looks like such a prompt and its answer:

    def clamp(value, low, high):           <- the def line(s), dedented to column 0, decorators left out
        \"\"\"Limit value to [low, high].\"\"\"   <- the docstring's first paragraph, on one line
        return max(low, min(value, high))  <- the body as written

A body that only raises NotImplementedError, passes or is `...` (an abstract method) is left out: it
would teach the model to give up. Every document is parsed again before it is kept.
"""

from __future__ import annotations

import ast
import builtins
from collections.abc import Iterator

MAX_BODY_LINES = 12  # longer bodies are ordinary code, already in the files
MAX_SUMMARY_CHARS = 120
BUILTIN_NAMES = frozenset(dir(builtins))


def _is_placeholder(statement: ast.stmt) -> bool:
    if isinstance(statement, ast.Pass):
        return True
    if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant):
        return True  # `...` or a second string
    if isinstance(statement, ast.Raise) and statement.exc is not None:
        exc = statement.exc.func if isinstance(statement.exc, ast.Call) else statement.exc
        return isinstance(exc, ast.Name) and exc.id == "NotImplementedError"
    return False


def _summary(docstring: str) -> str | None:
    """The docstring's first paragraph on one line (its first sentence if that is too long), if it can
    stand alone between triple quotes."""
    paragraph = " ".join(docstring.strip().split("\n\n", 1)[0].split())
    if len(paragraph) > MAX_SUMMARY_CHARS and ". " in paragraph:
        paragraph = paragraph.split(". ", 1)[0] + "."
    if not paragraph or len(paragraph) > MAX_SUMMARY_CHARS or '"' in paragraph or "\\" in paragraph:
        return None
    return paragraph


def _dedent(line: str, columns: int) -> str:
    spaces = len(line) - len(line.lstrip(" "))
    return line[min(columns, spaces) :]


def _document(lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef) -> str | None:
    """The function as a document (see the module's docstring), or None when it does not fit the shape."""
    docstring = ast.get_docstring(node, clean=True)
    body = node.body[1:]
    if docstring is None or not body or all(_is_placeholder(s) for s in body):
        return None
    if body[-1].end_lineno - body[0].lineno + 1 > MAX_BODY_LINES:
        return None
    summary = _summary(docstring)
    if summary is None:
        return None
    column = node.col_offset
    header = lines[node.lineno - 1 : node.body[0].lineno - 1]  # the def line(s), up to the docstring
    statements = lines[body[0].lineno - 1 : body[-1].end_lineno]
    indent = " " * (body[0].col_offset - column)
    text = "".join(
        [*(_dedent(line, column) for line in header), f'{indent}"""{summary}"""\n',
         *(_dedent(line, column) for line in statements)]
    )  # fmt: skip
    if not text.endswith("\n"):
        text += "\n"
    try:
        ast.parse(text)
    except (SyntaxError, ValueError):  # a continuation line or a string's inner lines lost by the dedent
        return None
    return text


def documented_functions(source: str) -> Iterator[tuple[str, str]]:
    """(name:line, document) for each short documented function or method of a file, in file order;
    nothing for a file that does not parse."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return
    lines = source.splitlines(keepends=True)
    nodes = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    for node in sorted(nodes, key=lambda n: n.lineno):
        if node.body and node.body[0].lineno == node.lineno:
            continue  # `def f(): "doc"; ...` on one line
        document = _document(lines, node)
        if document is not None:
            yield f"{node.name}:{node.lineno}", document


def _bound_names(function: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    """Every name the function binds itself: parameters, assignments, loop and `as` targets, imports."""
    bound = set()
    for node in ast.walk(function):
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            bound.add(node.id)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            bound.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and node is not function:
            bound.add(node.name)
    return bound


def is_self_contained(document: str) -> bool:
    """Whether a document's function (not a method) reads only its own names and builtins: the kind a
    newcomer asks for, whose body a reader can check without the rest of its module."""
    function = ast.parse(document).body[0]
    if function.args.args and function.args.args[0].arg in ("self", "cls"):
        return False
    used = {n.id for n in ast.walk(function) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    return used <= _bound_names(function) | BUILTIN_NAMES
