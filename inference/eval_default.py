"""Benchmark the default model on what it was trained for, with files it never saw.

    python -m inference.eval_default [--model models/default] [--device cpu]

Prints three figures, all on the held-out 5% of the standard library (train.py's split):
- bits per byte of the held-out files;
- the share of 50 functions the model completes into code that `ast.parse` accepts: each prompt is a
  held-out top-level `def` line plus its docstring, completed greedily for up to 200 new tokens and
  cut at the first line that returns to column 0. A prompt alone already parses, so the share of
  completions that parse *and* add at least one statement to the body is printed beside it;
- decode tokens/s at batch 1 through the engine (median of repeats after a warm-up).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import statistics
import sys
import time
from collections import Counter

import torch

from common.events import Done, SamplingParams
from inference.engine import DEFAULT_MODEL, Engine
from inference.train import bits_per_byte, read_source, split_of, stdlib_files, stdlib_root

SPEED_PROMPT = "import os\n\n\ndef walk_tree(top):\n"


def held_out_files(corpus: str = "") -> tuple:
    root = stdlib_root(corpus)
    return root, [f for f in stdlib_files(root) if split_of(f) == "test"]


def function_prompts(
    corpus: str = "", count: int = 50, per_file: int = 5, max_chars: int = 2000
) -> list[tuple[str, str]]:
    """(name, prompt) for `count` top-level functions of the held-out files that have a docstring and
    a body after it; the prompt is the def line(s) plus the docstring. Chosen in the order of a hash of
    file and name, at most `per_file` from one file (operator.py alone has 51 such one-liners), so the
    set is fixed for a given standard library. Prompts over `max_chars` (a few long docstrings) are
    skipped: with 200 new tokens they would not fit a small model's context."""
    root, files = held_out_files(corpus)
    found = []
    for rel in files:
        source = read_source(root, rel)
        try:
            tree = ast.parse(source)
        except (SyntaxError, ValueError):  # lib2to3 test data and the like
            continue
        lines = source.splitlines()
        for node in tree.body:
            if (
                isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
                and ast.get_docstring(node) is not None
                and len(node.body) > 1
            ):
                prompt = "\n".join(lines[node.lineno - 1 : node.body[0].end_lineno]) + "\n"
                if len(prompt) > max_chars:
                    continue
                key = hashlib.sha256(f"{rel}:{node.name}".encode()).hexdigest()
                found.append((key, rel, node.name, prompt))
    chosen, taken = [], Counter()
    for _, rel, name, prompt in sorted(found):
        if taken[rel] < per_file and len(chosen) < count:
            taken[rel] += 1
            chosen.append((f"{rel}:{name}", prompt))
    return chosen


def cut_at_column_zero(completion: str) -> str:
    """The completion up to the first line that starts at column 0 (the function has ended)."""
    lines = completion.split("\n")
    for i, line in enumerate(lines):
        if line and not line[0].isspace():
            return "\n".join(lines[:i])
    return completion


def check_completion(prompt: str, completion: str) -> tuple[bool, bool]:
    """(parses, parses and adds at least one statement after the docstring)."""
    try:
        tree = ast.parse(prompt + cut_at_column_zero(completion))
    except (SyntaxError, ValueError):
        return False, False
    return True, len(tree.body[0].body) > 1


def generate(engine: Engine, prompt: str, max_new_tokens: int) -> Done:
    ids = engine.encode_prompt(prompt)
    *_, done = engine.generate(ids, SamplingParams(max_new_tokens=max_new_tokens, temperature=0))
    return done


def held_out_bits_per_byte(engine: Engine, corpus: str = "") -> float:
    root, files = held_out_files(corpus)
    texts = [read_source(root, f) for f in files]
    eos = min(engine.tokenizer.eos_ids)
    ids: list[int] = []
    for text in texts:
        ids += engine.tokenizer.encode(text, add_special=False) + [eos]
    threads = torch.get_num_threads()
    # The engine decodes on one thread; a batched forward wants every core.
    torch.set_num_threads(os.cpu_count() or threads)
    try:
        return bits_per_byte(
            engine.model,
            torch.tensor(ids),
            sum(len(t.encode()) for t in texts),
            engine.config.max_position_embeddings,
            4,
        )
    finally:
        torch.set_num_threads(threads)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m inference.eval_default", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--corpus", default="", help="standard library directory (default: this interpreter's)"
    )
    parser.add_argument("--prompts", type=int, default=50)
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5, help="timed decode runs after one warm-up")
    parser.add_argument("--skip-bpb", action="store_true", help="skip the (slow on CPU) bits-per-byte pass")
    parser.add_argument("--show", type=int, default=0, help="print the first N completions")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    args = parser.parse_args(argv)

    engine = Engine.load(args.model, device=args.device)
    results: dict = {"model": str(args.model), "device": str(engine.device)}
    say = (lambda *a: None) if args.json else print

    generate(engine, SPEED_PROMPT, 20)  # warm-up
    speeds, lengths = [], []
    for _ in range(args.repeats):
        done = generate(engine, SPEED_PROMPT, args.max_new_tokens)
        speeds.append(done.stats.decode_tok_s)
        lengths.append(done.stats.completion_tokens)
    results["decode_tok_s"] = statistics.median(speeds)
    say(f"decode: {results['decode_tok_s']:.0f} tokens/s at batch 1 on {engine.device} (median of {args.repeats} "
        f"runs of {statistics.median(lengths):.0f} tokens; all: {', '.join(f'{s:.0f}' for s in speeds)})")  # fmt: skip

    prompts = function_prompts(args.corpus, args.prompts)
    parsed = with_body = 0
    start = time.perf_counter()
    for i, (name, prompt) in enumerate(prompts):
        done = generate(engine, prompt, args.max_new_tokens)
        ok, body = check_completion(prompt, done.text)
        parsed, with_body = parsed + ok, with_body + body
        if i < args.show:
            say(
                f"--- {name} ({'parses' if ok else 'does not parse'})\n{prompt}{cut_at_column_zero(done.text)}"
            )
    n = len(prompts)
    results |= {"prompts": n, "parse_share": parsed / n, "parse_with_body_share": with_body / n}
    say(f"ast.parse: {parsed}/{n} completions parse ({parsed / n:.0%}); {with_body}/{n} parse and add code "
        f"to the body ({with_body / n:.0%})  [{time.perf_counter() - start:.0f} s]")  # fmt: skip

    if not args.skip_bpb:
        start = time.perf_counter()
        results["bits_per_byte"] = held_out_bits_per_byte(engine, args.corpus)
        files = len(held_out_files(args.corpus)[1])
        say(f"held-out: {results['bits_per_byte']:.4f} bits per byte over {files} files  "
            f"[{time.perf_counter() - start:.0f} s]")  # fmt: skip
    if args.json:
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
