"""inference/function_examples.py: which functions of a file become training documents, and their shape."""

import ast

from inference.function_examples import MAX_BODY_LINES, documented_functions

SOURCE = '''\
import functools


class Box:
    """A box."""

    @functools.cache
    def area(self,
             scale=1):
        """Return the area of the box,
        scaled by `scale`.

        Longer notes that the document leaves out.
        """
        width = self.width * scale
        return width * self.height

    def abstract(self):
        """Subclasses say."""
        raise NotImplementedError("subclasses")

    def stub(self):
        """Nothing yet."""
        ...

    def undocumented(self):
        return 1


async def fetch(url):
    """Fetch url."""
    async with open(url) as f:
        return await f.read()


def quoted():
    """Say "hi"."""
    return "hi"
'''


def test_methods_are_dedented_with_a_one_line_docstring_and_placeholders_are_left_out():
    found = dict(documented_functions(SOURCE))
    assert list(found) == ["area:8", "fetch:30"]
    assert found["area:8"] == (
        "def area(self,\n"
        "         scale=1):\n"
        '    """Return the area of the box, scaled by `scale`."""\n'
        "    width = self.width * scale\n"
        "    return width * self.height\n"
    )
    assert found["fetch:30"] == (
        'async def fetch(url):\n    """Fetch url."""\n    async with open(url) as f:\n        return await f.read()\n'
    )
    for document in found.values():
        ast.parse(document)


def test_long_bodies_long_summaries_and_broken_files_give_nothing():
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_BODY_LINES + 1))
    assert not list(documented_functions(f'def long():\n    """Long."""\n{body}'))
    shorter = "".join(f"    x{i} = {i}\n" for i in range(MAX_BODY_LINES))
    assert [k for k, _ in documented_functions(f'def fits():\n    """Fits."""\n{shorter}')] == ["fits:1"]
    assert not list(documented_functions('def f(:\n    """Broken."""\n    return 1\n'))
    assert not list(documented_functions('def wordy():\n    """' + "word " * 40 + '"""\n    return 1\n'))


def test_a_long_first_paragraph_keeps_its_first_sentence():
    summary = "Add one to n. " + "Then explain at length why that matters " * 4
    [(_, document)] = documented_functions(f'def inc(n):\n    """{summary}"""\n    return n + 1\n')
    assert document == 'def inc(n):\n    """Add one to n."""\n    return n + 1\n'
