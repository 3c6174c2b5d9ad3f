"""What users will see: the prompts the speculative-decoding benchmark and its exactness tests run.

Code-editing prompts give the model a function and ask for it again with one change, so most of the answer
is a copy of the prompt (what prompt-lookup drafts are for); free-generation prompts have little to copy
(the drafts must then cost nothing). They are written as a base code model reads them: the code, then a
comment that starts the edited version. Each entry: (name, kind, prompt text).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Prompt:
    name: str
    kind: str  # "edit" (mostly a copy of the prompt) | "free" (little to copy)
    text: str


_MEAN = """def mean_of_positive(values):
    count = 0
    acc = 0.0
    for v in values:
        if v > 0:
            acc += v
            count += 1
    if count == 0:
        return 0.0
    return acc / count
"""

_LOAD = """def load_settings(path, defaults):
    settings = dict(defaults)
    with open(path) as handle:
        for line in handle:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, _, value = line.partition("=")
            settings[key.strip()] = value.strip()
    return settings
"""

_FETCH = """def fetch_all(session, urls):
    results = []
    for url in urls:
        response = session.get(url)
        response.raise_for_status()
        results.append(response.json())
    return results
"""

_PAIRS = """def window_pairs(items):
    pairs = []
    for i in range(len(items)):
        pairs.append((items[i], items[i + 1]))
    return pairs
"""

_SQUARES = """def even_squares(numbers):
    result = []
    for n in numbers:
        if n % 2 == 0:
            result.append(n * n)
    return result
"""

_STACK = """class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        return self.items.pop()

    def peek(self):
        return self.items[-1]

    def is_empty(self):
        return not self.items
"""

WORKLOAD: tuple[Prompt, ...] = (
    Prompt(
        "rename",
        "edit",
        _MEAN + "\n\n# The same function with `acc` renamed to `total`:\n\ndef mean_of_positive(values):\n",
    ),
    Prompt("type-hints", "edit", _LOAD + "\n\n# The same function with type hints:\n\ndef load_settings("),
    Prompt(
        "async",
        "edit",
        _FETCH + "\n\n# The same function, async, awaiting each request:\n\nasync def fetch_all(",
    ),
    Prompt(
        "docstrings",
        "edit",
        _STACK + "\n\n# The same class with a docstring on every method:\n\nclass Stack:\n",
    ),
    Prompt(
        "off-by-one",
        "edit",
        _PAIRS + "\n\n# Fixed: the loop stopped one item too late.\n\ndef window_pairs(items):\n",
    ),
    Prompt(
        "comprehension",
        "edit",
        _SQUARES + "\n\n# The same function as a list comprehension:\n\ndef even_squares(",
    ),
    Prompt("free-parser", "free", "import argparse\n\n\ndef main():\n    parser = argparse.ArgumentParser("),
    Prompt(
        "free-class",
        "free",
        'class LRUCache:\n    """A fixed-size cache that drops the least recently used entry."""\n\n',
    ),
    Prompt("free-fib", "free", "def fibonacci(n):\n"),
    Prompt("free-http", "free", "import json\nimport urllib.request\n\n\ndef get_json(url, timeout=10):\n"),
)
