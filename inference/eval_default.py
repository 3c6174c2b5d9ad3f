"""Benchmark the default model on what it is for, with prompts and files it never saw.

    python -m inference.eval_default [--model models/default] [--device cpu] [--json]

Figures (the prompts and tests of the first three are this project's own, inference/eval_prompts.py):
- loops and parses at the page's sampling (temperature, top-p and any repetition penalty the
  checkpoint's generation_config.json recommends, else the page's 0.2 / 0.95): 20 prompts, one seeded
  sample each of up to 256 new tokens; a completion loops when a line of 3+ words recurs 3+ times or
  fewer than half of its word 4-grams are distinct; it parses when the prompt plus the code it asks
  for is accepted by `ast.parse`: the completion cut where a code-completion evaluator's stop sequences
  would cut it (the end of the function or method the prompt opened, or of the first top-level
  statement after a prompt of comments), and, when the token limit cut it first, judged on the
  statements it finished (first_block);
- simple functions: 16 documented functions (clamp, gcd, factorial, is_prime, ...) whose greedy
  body passes a one-line unit test, run in a separate, resource-limited interpreter (this command
  executes model output; nothing in the product ever does);
- fill-in-the-middle (models whose tokenizer has the FIM tokens): 40 held-out functions with one
  statement of their body removed, filled greedily; the share whose filled source `ast.parse` accepts
  with the middle stopped as a completion client stops it (at the function's end, an unfinished last
  line of a middle the token limit cut dropped: stopped_middle), the same as generated, and the share
  filled exactly;
- greedy completions of 50 held-out functions (def line and docstring) that parse, as before;
- bits per byte of the held-out files: the old model's test split, the 88 standard-library files
  whose path hash falls in buckets 0-4 (train.split_of), measured on this interpreter's library;
- decode tokens/s at batch 1 through the engine (median of repeats after a warm-up).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter

import torch

from common.events import Done, SamplingParams
from inference.engine import DEFAULT_MODEL, Engine
from inference.eval_prompts import SAMPLED_PROMPTS, SIMPLE_FUNCTIONS
from inference.fim_training import FIM_MIDDLE, FIM_PREFIX, FIM_SUFFIX, psm_prompt
from inference.train import bits_per_byte, read_source, split_of, stdlib_files, stdlib_root

SPEED_PROMPT = "import os\n\n\ndef walk_tree(top):\n"
PAGE_SAMPLING = {"temperature": 0.2, "top_p": 0.95}  # the page's form (playground/views.py FORM_DEFAULTS)


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


# --- loops and parses at the page's sampling ----------------------------------------------------------------


def is_loop(text: str) -> bool:
    """A line of 3+ words that recurs 3+ times, or word 4-grams less than half distinct (over 8+ of them)."""
    lines = Counter(line.strip() for line in text.splitlines() if len(line.split()) >= 3)
    if any(n >= 3 for n in lines.values()):
        return True
    words = text.split()
    grams = [tuple(words[i : i + 4]) for i in range(len(words) - 3)]
    return len(grams) >= 8 and len(set(grams)) < 0.5 * len(grams)


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" \t"))


def _code_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def open_header_indent(prompt: str) -> int | None:
    """The indentation of the header of the innermost block the prompt leaves open (0 for a `def` whose
    docstring ends the prompt, 4 for a method just begun in a class), or None: the prompt ends at top level."""
    lines = _code_lines(prompt)
    if not lines:
        return None
    last = lines[-1]
    if last.rstrip().endswith(":"):
        return _indent(last)
    level = _indent(last)
    return next((_indent(line) for line in reversed(lines[:-1]) if _indent(line) < level), None)


def first_block(prompt: str, completion: str, truncated: bool) -> str:
    """The completion up to where the code the prompt asks for ends, as a completion evaluator's stop
    sequences cut it: the first line back at (or above) the indentation of the block the prompt leaves open
    (the end of its function or method), or, after a top-level prompt (comments, imports), the line that
    starts the completion's second top-level statement. Comments and closing brackets at that level do not
    end it; a decorator does, unless it begins the first statement (its def or class belongs to it).

    A completion cut by the token limit inside that block loses its unfinished last line; if what is left
    does not parse, its last statement at the body's indentation (the one the limit cut) goes too, as long
    as code of the completion remains: it is judged on the statements it finished."""
    header = open_header_indent(prompt)
    level = 0 if header is None else header
    lines = completion.split("\n")
    first = 0 if not prompt or prompt.endswith("\n") else 1  # lines[0] may finish the prompt's last line
    started, decorator_pending = header is not None, False
    for i in range(first, len(lines)):
        line = lines[i]
        if not line.strip() or _indent(line) > level or line.lstrip()[0] in "#)]}":
            continue
        decorator = line.lstrip().startswith("@")
        if not started or decorator_pending:  # the first statement, or the def/class its decorators wait for
            started, decorator_pending = True, decorator
            continue
        return "\n".join(lines[:i])
    if not truncated or "\n" not in completion:
        return completion
    block = completion[: completion.rindex("\n") + 1]
    if parses(prompt + block):
        return block
    kept = block.split("\n")
    code = [j for j, line in enumerate(kept) if line.strip() and not line.lstrip().startswith("#")]
    if not code:
        return block
    body = _indent(kept[code[0]])
    starts = [j for j in code if _indent(kept[j]) == body and kept[j].lstrip()[0] not in ")]}"]
    if not starts or starts[-1] == code[0]:  # the cut statement is the completion's only one
        return block
    return "\n".join(kept[: starts[-1]]) + "\n"


def parses(source: str) -> bool:
    try:
        ast.parse(source)
    except (SyntaxError, ValueError):
        return False
    return True


def sampling_params(engine: Engine, max_new_tokens: int, seed: int) -> SamplingParams:
    """The page's sampling: its form's temperature and top-p unless the checkpoint recommends others, and
    the checkpoint's repetition penalty (the worker applies a model's generation_config.json defaults)."""
    chosen = PAGE_SAMPLING | {k: v for k, v in engine.sampling_defaults.items() if k != "max_new_tokens"}
    return SamplingParams(max_new_tokens=max_new_tokens, seed=seed, **chosen)


def sampled_completions(engine: Engine, max_new_tokens: int = 256) -> list[dict]:
    """One seeded sample per SAMPLED_PROMPTS entry, sent as the page sends it (a chat message when the model
    has a chat template): whether it loops and whether it parses."""
    results = []
    for i, prompt in enumerate(SAMPLED_PROMPTS):
        chat = engine.tokenizer.has_chat_template
        ids = (
            engine.encode_prompt(messages=[{"role": "user", "content": prompt}], chat=True)
            if chat
            else engine.encode_prompt(prompt)
        )
        rendered = engine.tokenizer.decode(ids)
        *_, done = engine.generate(ids, sampling_params(engine, max_new_tokens, seed=i))
        block = first_block(rendered, done.text, done.finish_reason == "length")
        results.append({"prompt": prompt, "text": done.text, "loops": is_loop(done.text),
                        "parses": parses(rendered + block)})  # fmt: skip
    return results


# --- simple functions, unit-tested ------------------------------------------------------------------------------


def _limits() -> (
    None
):  # in the child, before it runs anything: 2 s of CPU, 512 MiB of memory, no files written
    resource.setrlimit(resource.RLIMIT_CPU, (2, 2))
    resource.setrlimit(resource.RLIMIT_AS, (512 * 1024**2, 512 * 1024**2))
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))


def passes_test(source: str, test: str, timeout_s: float = 5.0) -> bool:
    """Whether `source` followed by the one-line `test` runs to the end: in a fresh isolated interpreter
    (-I: no user site, no environment), in an empty folder, with CPU, memory and file-size limits."""
    with tempfile.TemporaryDirectory() as folder:
        try:
            run = subprocess.run([sys.executable, "-I", "-c", f"{source}\n{test}\n"], cwd=folder, env={},
                                 capture_output=True, timeout=timeout_s, preexec_fn=_limits)  # fmt: skip
        except subprocess.TimeoutExpired:
            return False
    return run.returncode == 0


def simple_functions(engine: Engine, max_new_tokens: int = 160) -> list[dict]:
    results = []
    for prompt, test in SIMPLE_FUNCTIONS:
        done = generate(engine, prompt, max_new_tokens)
        body = cut_at_column_zero(done.text)
        results.append({"prompt": prompt, "body": body, "passes": passes_test(prompt + body, test)})
    return results


# --- fill-in-the-middle ------------------------------------------------------------------------------------------


def has_fim(engine: Engine) -> bool:
    # a special token encodes to its one id; without it, its spelling is several ordinary tokens
    return all(
        len(engine.tokenizer.encode(t, add_special=False)) == 1 for t in (FIM_PREFIX, FIM_MIDDLE, FIM_SUFFIX)
    )


def fim_cases(corpus: str = "", count: int = 40, per_file: int = 3, max_chars: int = 2500) -> list[dict]:
    """Held-out top-level functions with one statement of the body removed: {name, prefix, middle, suffix}.
    The statement (not the docstring, at most 4 lines) and the functions are chosen in the order of a hash
    of file and name, at most `per_file` from one file."""
    root, files = held_out_files(corpus)
    found = []
    for rel in files:
        source = read_source(root, rel)
        try:
            tree = ast.parse(source)
        except (SyntaxError, ValueError):
            continue
        lines = source.splitlines(keepends=True)
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            body = node.body[1:] if ast.get_docstring(node) is not None else node.body
            spans = [(s.lineno, s.end_lineno) for s in body if s.end_lineno - s.lineno < 4]
            start = node.decorator_list[0].lineno if node.decorator_list else node.lineno
            text = "".join(lines[start - 1 : node.end_lineno])
            if len(body) < 2 or not spans or len(text) > max_chars:
                continue
            key = hashlib.sha256(f"{rel}:{node.name}".encode()).digest()
            first, last = spans[key[0] % len(spans)]
            found.append((key, rel, {
                "name": f"{rel}:{node.name}",
                "prefix": "".join(lines[start - 1 : first - 1]),
                "middle": "".join(lines[first - 1 : last]),
                "suffix": "".join(lines[last : node.end_lineno]),
            }))  # fmt: skip
    chosen, taken = [], Counter()
    for _, rel, case in sorted(found, key=lambda f: f[0]):
        if taken[rel] < per_file and len(chosen) < count:
            taken[rel] += 1
            chosen.append(case)
    return chosen


def stopped_middle(text: str, truncated: bool) -> str | None:
    """A generated middle as a code-completion client stops it: the removed span lies inside a top-level
    function, so a line at column 0 means the model went past the function's end (the stop sequence cuts
    there); one the token limit cut loses its unfinished last line. None when nothing of it would remain
    but blank lines and comments (it is not judged on nothing)."""
    cut = cut_at_column_zero(text)
    if cut != text:
        middle = cut + "\n"
    elif truncated and "\n" in text:
        middle = text[: text.rindex("\n") + 1]
    else:
        return text
    return middle if _code_lines(middle) else None


def fill_in_the_middle(engine: Engine, cases: list[dict], max_new_tokens: int = 96) -> list[dict]:
    """Greedy middles, judged as generated (up to <|endoftext|> or the token limit) and as a completion
    client stops them (stopped_middle)."""
    results = []
    for case in cases:
        ids = engine.tokenizer.encode(psm_prompt(case["prefix"], case["suffix"]), add_special=False)
        *_, done = engine.generate(ids, SamplingParams(max_new_tokens=max_new_tokens, temperature=0))
        stopped = stopped_middle(done.text, done.finish_reason == "length")
        results.append({"name": case["name"], "middle": done.text, "ended": done.finish_reason != "length",
                        "parses_raw": parses(case["prefix"] + done.text + case["suffix"]),
                        "parses": stopped is not None and parses(case["prefix"] + stopped + case["suffix"]),
                        "exact": (stopped or "").strip() == case["middle"].strip()})  # fmt: skip
    return results


def share(results: list[dict], key: str) -> float:
    return sum(r[key] for r in results) / max(1, len(results))


SECTIONS = ("speed", "sampled", "functions", "fim", "held-out", "bpb")


def parse_overrides(text: str) -> dict:
    """ "repetition_penalty=1.2,temperature=0.3" -> {"repetition_penalty": 1.2, "temperature": 0.3}."""
    pairs = [item.split("=", 1) for item in text.split(",") if item.strip()]
    if any(len(p) != 2 for p in pairs):
        raise argparse.ArgumentTypeError(f"expected name=value pairs separated by commas, got {text!r}")
    return {name.strip(): int(value) if name.strip() == "top_k" else float(value) for name, value in pairs}


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
    parser.add_argument(
        "--only", default=",".join(SECTIONS), help="sections to run, from: " + ", ".join(SECTIONS)
    )
    parser.add_argument("--skip-bpb", action="store_true", help="skip the (slow on CPU) bits-per-byte pass")
    parser.add_argument("--sampling", type=parse_overrides, default={},
                        help="override the page's sampling, e.g. repetition_penalty=1.2,temperature=0.3")  # fmt: skip
    parser.add_argument("--show", type=int, default=0, help="print the first N completions")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    args = parser.parse_args(argv)
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    if only - set(SECTIONS):
        parser.error(f"--only: unknown sections {sorted(only - set(SECTIONS))}; known: {', '.join(SECTIONS)}")
    if args.skip_bpb:
        only.discard("bpb")

    engine = Engine.load(args.model, device=args.device)
    engine.sampling_defaults = {**engine.sampling_defaults, **args.sampling}
    results: dict = {"model": str(args.model), "device": str(engine.device)}
    say = (lambda *a: None) if args.json else print

    if "speed" in only:
        generate(engine, SPEED_PROMPT, 20)  # warm-up
        speeds, lengths = [], []
        for _ in range(args.repeats):
            done = generate(engine, SPEED_PROMPT, args.max_new_tokens)
            speeds.append(done.stats.decode_tok_s)
            lengths.append(done.stats.completion_tokens)
        results["decode_tok_s"] = statistics.median(speeds)
        say(f"decode: {results['decode_tok_s']:.0f} tokens/s at batch 1 on {engine.device} (median of {args.repeats} "
            f"runs of {statistics.median(lengths):.0f} tokens; all: {', '.join(f'{s:.0f}' for s in speeds)})")  # fmt: skip

    if "sampled" in only:
        start = time.perf_counter()
        sampled = sampled_completions(engine)
        params = sampling_params(engine, 1, 0)
        sampling = {k: getattr(params, k) for k in ("temperature", "top_p", "top_k", "repetition_penalty")}
        results |= {"sampling": sampling, "loop_share": share(sampled, "loops"), "sampled_parse_share": share(sampled, "parses")}  # fmt: skip
        say(f"page sampling ({', '.join(f'{k} {v}' for k, v in sampling.items())}): "
            f"{sum(r['loops'] for r in sampled)}/{len(sampled)} completions loop ({results['loop_share']:.0%}), "
            f"{sum(r['parses'] for r in sampled)}/{len(sampled)} parse ({results['sampled_parse_share']:.0%})  "
            f"[{time.perf_counter() - start:.0f} s]")  # fmt: skip
        for r in sampled[: args.show]:
            say(f"--- sampled ({'LOOPS' if r['loops'] else 'no loop'}, {'parses' if r['parses'] else 'does not parse'})\n{r['prompt']}{r['text']}")  # fmt: skip

    if "functions" in only:
        start = time.perf_counter()
        functions = simple_functions(engine)
        results["unit_test_share"] = share(functions, "passes")
        passed = [r["prompt"][4:].split("(")[0] for r in functions if r["passes"]]
        say(f"simple functions: {len(passed)}/{len(functions)} greedy bodies pass their unit test "
            f"({results['unit_test_share']:.0%}): {', '.join(passed) or 'none'}  [{time.perf_counter() - start:.0f} s]")  # fmt: skip
        for r in functions[: args.show]:
            say(f"--- {'passes' if r['passes'] else 'fails'}\n{r['prompt']}{r['body']}")

    if "fim" in only:
        if has_fim(engine):
            start = time.perf_counter()
            fim = fill_in_the_middle(engine, fim_cases(args.corpus))
            results |= {"fim_cases": len(fim), "fim_parse_share": share(fim, "parses"), "fim_exact_share": share(fim, "exact"),
                        "fim_raw_parse_share": share(fim, "parses_raw"), "fim_ended_share": share(fim, "ended")}  # fmt: skip
            say(f"fill-in-the-middle: {sum(r['parses'] for r in fim)}/{len(fim)} filled functions parse "
                f"({results['fim_parse_share']:.0%}; as generated, without a client's stop: "
                f"{results['fim_raw_parse_share']:.0%}; ended by <|endoftext|>: {results['fim_ended_share']:.0%}), "
                f"{sum(r['exact'] for r in fim)} filled exactly  [{time.perf_counter() - start:.0f} s]")  # fmt: skip
        else:
            say("fill-in-the-middle: the tokenizer has no FIM tokens")

    if "held-out" in only:
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
        say(f"held-out functions, greedy: {parsed}/{n} completions parse ({parsed / n:.0%}); {with_body}/{n} parse "
            f"and add code to the body ({with_body / n:.0%})  [{time.perf_counter() - start:.0f} s]")  # fmt: skip

    if "bpb" in only:
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
