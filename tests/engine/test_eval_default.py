"""inference/eval_default.py's measures: loops, first blocks, unit tests run apart, FIM cases."""

import ast

from inference.eval_default import fim_cases, first_block, is_loop, parses, passes_test, stopped_middle
from inference.eval_prompts import SAMPLED_PROMPTS, SIMPLE_FUNCTIONS


def test_loop_detection():
    assert is_loop("    x = foo(a, b)\n" * 3)
    assert is_loop("return the value of the value of the value of the value of the value of the value")
    assert not is_loop("    x = foo(a, b)\n    y = foo(a, b)\n    return x + y\n")
    assert not is_loop("    else:\n" * 5)  # a short line may recur
    assert not is_loop("a b c d")


def test_first_block_inside_a_def_and_after_comments():
    prompt = 'def f(x):\n    """Double."""\n'
    assert first_block(prompt, "    return 2 * x\n\n\ndef g(:\n", False) == "    return 2 * x\n\n"
    comment = "# Return the n-th Fibonacci number.\n"
    body = "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n"
    assert first_block(comment, "\n" + body + "\n\nprint(fib(10)\n", False) == "\n" + body + "\n"
    assert parses(comment + first_block(comment, body + "\nprint(fib(", False))
    # cut by the token limit: the unfinished last line goes
    assert first_block(prompt, "    y = 2 * x\n    return (y", True) == "    y = 2 * x\n"


def test_first_block_ends_where_a_stop_sequence_would():
    prompt = 'def f(x):\n    """Double."""\n'
    # a decorator at the top level begins the next function
    after = "    return 2 * x\n\n\n@cache\ndef g(:\n"
    assert first_block(prompt, after, False) == "    return 2 * x\n\n"
    # ... but a completion after comments may begin with a decorated function: its def belongs to it
    comment = "# Cached squares.\n"
    decorated = "@cache\ndef square(x):\n    return x * x\n\n\nsquare(:\n"
    assert first_block(comment, decorated, False) == "@cache\ndef square(x):\n    return x * x\n\n"
    # a method begun in a class ends where the next method starts
    method = 'class Point:\n    """A point."""\n\n    def __init__(self, x, y):\n'
    body = "        self.x = x\n        self.y = y\n\n"
    block = first_block(method, body + '    @property\n    def norm(self):\n        """The length.\n', True)
    assert block == body[:-1] and parses(method + block)
    # comments and closing brackets at the function's level do not end it
    bracket = "    return max(\n        x,\n)\n# done\n"
    assert first_block(prompt, bracket, False) == bracket


def test_a_cut_completion_is_judged_on_the_statements_it_finished():
    prompt = 'def f(x):\n    """Double."""\n'
    cut = "    y = 2 * x\n    if y > 3:\n        return y\n    for i in range(y):\n        if i:\n"
    block = first_block(prompt, cut + "            return (i", True)
    assert block == "    y = 2 * x\n    if y > 3:\n        return y\n" and parses(prompt + block)
    # an error before the cut statement still fails
    broken = "    y = = 2\n    for i in range(y):\n        if i:\n"
    assert not parses(prompt + first_block(prompt, broken + "            return (i", True))
    # a completion whose only statement was cut is not judged on nothing
    only = "    for i in range(x):\n        if i:\n"
    assert not parses(prompt + first_block(prompt, only + "            return (i", True))


def test_unit_tests_run_apart_and_bounded():
    assert passes_test("def add(a, b):\n    return a + b\n", "assert add(2, 3) == 5")
    assert not passes_test("def add(a, b):\n    return a - b\n", "assert add(2, 3) == 5")
    assert not passes_test("def add(a, b):\n    return a +\n", "assert add(2, 3) == 5")  # does not parse
    assert not passes_test(
        "def spin():\n    while True:\n        pass\n", "spin()", timeout_s=10
    )  # CPU limit
    assert not passes_test("f = open('x.txt', 'w')\nf.write('data')\nf.close()", "")  # no byte may be written


def test_project_prompts_are_well_formed():
    assert len(SAMPLED_PROMPTS) == 20 and len(set(SAMPLED_PROMPTS)) == 20
    assert all(p.endswith("\n") for p in SAMPLED_PROMPTS)
    for prompt, test in SIMPLE_FUNCTIONS:
        name = prompt[4:].split("(")[0]
        assert ast.parse(prompt + "    pass\n") and name in test and ast.parse(test)


def test_fim_cases_remove_one_statement_of_a_held_out_function():
    cases = fim_cases(count=12)
    assert len(cases) == 12
    for case in cases:
        whole = case["prefix"] + case["middle"] + case["suffix"]
        assert (
            parses(whole)
            and case["middle"].strip()
            and case["prefix"].lstrip().startswith(("def", "async", "@"))
        )
        assert 1 <= case["middle"].count("\n") <= 4
    assert fim_cases(count=12) == cases  # the same functions every time


def test_a_middle_stops_where_a_completion_client_stops_it():
    prefix, suffix = "def f(x):\n    y = x\n", "    return y\n"
    # ended by <|endoftext|>: as generated
    assert stopped_middle("    y += 1\n", False) == "    y += 1\n"
    # past the function's end: the stop sequence cuts it there, the kept line keeps its newline
    went_on = stopped_middle("    y += 1\n\n\ndef g(:\n", False)
    assert went_on == "    y += 1\n\n\n" and parses(prefix + went_on + suffix)
    # cut by the token limit: its unfinished last line goes, never all of it
    assert stopped_middle("    y += 1\n    y = (y", True) == "    y += 1\n"
    assert (
        stopped_middle("    y = (y", True) == "    y = (y"
        and stopped_middle("# x\ndef g():\n", False) is None
    )
