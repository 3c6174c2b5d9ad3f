"""Prompts and one-line unit tests written for this project's evaluation of the default model (not taken
from any corpus): what a visitor of the page might start with.

SAMPLED_PROMPTS: completed at the page's sampling, for the loop and parse rates. Most are code, as the
page's placeholder invites (a `def` line with its docstring, a class, a script's start); a few are
requests in words, which the chat template turns into `# ` comments.

SIMPLE_FUNCTIONS: (prompt, test): a documented function everyone knows and one line that checks the
body greedy decoding writes for it.
"""

from __future__ import annotations

SAMPLED_PROMPTS: list[str] = [
    'def merge_sorted(a, b):\n    """Merge two sorted lists into one sorted list."""\n',
    'def read_lines(path):\n    """Return the lines of a text file without their line endings."""\n',
    'def chunked(items, size):\n    """Yield successive lists of `size` items from `items`."""\n',
    'def parse_version(text):\n    """Turn "1.2.3" into the tuple (1, 2, 3)."""\n',
    'def word_frequencies(text):\n    """Count how often each word occurs in text, ignoring case."""\n',
    'def retry(func, attempts=3):\n    """Call func until it succeeds, at most `attempts` times."""\n',
    'class Stack:\n    """A last-in, first-out stack."""\n\n    def __init__(self):\n',
    'class Point:\n    """A point in the plane."""\n\n    def __init__(self, x, y):\n',
    'import argparse\n\n\ndef main():\n    parser = argparse.ArgumentParser(description="Copy a file.")\n',
    'import json\n\n\ndef load_config(path):\n    """Read a JSON configuration file and return it as a dict."""\n',
    'def binary_search(items, target):\n    """Return the index of target in the sorted list items, or -1."""\n',
    'def flatten(nested):\n    """Flatten a list of lists into one list."""\n',
    'def slugify(title):\n    """Lower-case a title and join its words with hyphens."""\n',
    'def moving_average(values, window):\n    """Return the averages of each run of `window` consecutive values."""\n',
    'import os\n\n\ndef find_files(root, suffix):\n    """List the paths under root whose names end with suffix."""\n',
    'def transpose(matrix):\n    """Swap the rows and columns of a list of lists."""\n',
    "# Write a function that checks whether a string is a palindrome.\n",
    "# Return the n-th Fibonacci number.\n",
    "# A function that removes duplicate items from a list, keeping their order.\n",
    "# Count the lines of a file.\n",
]

SIMPLE_FUNCTIONS: list[tuple[str, str]] = [
    ('def clamp(value, low, high):\n    """Return value limited to the range [low, high]."""\n',
     "assert clamp(5, 0, 3) == 3 and clamp(-1, 0, 3) == 0 and clamp(2, 0, 3) == 2"),
    ('def gcd(a, b):\n    """Return the greatest common divisor of a and b."""\n',
     "assert gcd(12, 18) == 6 and gcd(7, 5) == 1"),
    ('def factorial(n):\n    """Return n! for a non-negative integer n."""\n',
     "assert factorial(0) == 1 and factorial(5) == 120"),
    ('def is_prime(n):\n    """Return True if n is a prime number."""\n',
     "assert is_prime(7) and not is_prime(9) and not is_prime(1) and is_prime(2)"),
    ('def fibonacci(n):\n    """Return the n-th Fibonacci number, with fibonacci(0) == 0 and fibonacci(1) == 1."""\n',
     "assert fibonacci(10) == 55 and fibonacci(1) == 1"),
    ('def reverse_string(s):\n    """Return s reversed."""\n',
     'assert reverse_string("abc") == "cba"'),
    ('def is_palindrome(s):\n    """Return True if s reads the same backwards."""\n',
     'assert is_palindrome("level") and not is_palindrome("python")'),
    ('def count_vowels(text):\n    """Return the number of vowels (a, e, i, o, u) in text."""\n',
     'assert count_vowels("education") == 5'),
    ('def mean(values):\n    """Return the arithmetic mean of a list of numbers."""\n',
     "assert mean([1, 2, 3, 4]) == 2.5"),
    ('def is_even(n):\n    """Return True if n is even."""\n',
     "assert is_even(4) and not is_even(7)"),
    ('def sum_of_squares(numbers):\n    """Return the sum of the squares of numbers."""\n',
     "assert sum_of_squares([1, 2, 3]) == 14"),
    ('def celsius_to_fahrenheit(celsius):\n    """Convert a temperature from degrees Celsius to Fahrenheit."""\n',
     "assert celsius_to_fahrenheit(100) == 212 and celsius_to_fahrenheit(0) == 32"),
    ('def lcm(a, b):\n    """Return the least common multiple of two positive integers."""\n',
     "assert lcm(4, 6) == 12"),
    ('def unique(items):\n    """Return the items without duplicates, in the order they first appear."""\n',
     "assert unique([3, 1, 3, 2, 1]) == [3, 1, 2]"),
    ('def word_count(text):\n    """Return the number of words in text."""\n',
     'assert word_count("the quick brown fox") == 4'),
    ('def maximum(values):\n    """Return the largest item of a non-empty list."""\n',
     "assert maximum([3, 9, 2]) == 9"),
]  # fmt: skip
