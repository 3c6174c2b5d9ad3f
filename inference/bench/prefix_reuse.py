"""Time to first token of a conversation's follow-up: from the KV cache the last turn left (prefix reuse), against a
cold prefill of the whole prompt.

    python -m inference.bench.prefix_reuse --model laneformer-2b [--context 3000] [--new 50] [--runs 5]

The conversation is `context` random token ids, prefilled as the last turn was; its follow-up appends `new`
ids. Timed, each the median of `runs` after a warm-up (wall clock from the call to the first token, the device
synchronised before; the prefix cache's lookup and copies included):
    cold   the follow-up prefilled from position 0
    live   the follow-up right after the conversation: the live cache holds it, `new` ids are prefilled
    slot   the follow-up after another request took the live cache: the conversation is copied back from its
           slot first
The goal the issue sets: live and slot at least 5x sooner than cold (PASS / FAIL printed per row).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

import torch

from common.events import SamplingParams
from inference.bench.model_setup import build_model
from inference.engine import _make_runner, parse_device, parse_dtype
from inference.prefix_cache import PrefixCache

FIRST_TOKEN = SamplingParams(max_new_tokens=1)
GOAL = 5.0


def first_token_ms(runner, prefix: PrefixCache, prompt: list[int], reuse: bool) -> tuple[float, int]:
    """(ms from the call to the first token, prompt tokens reused); the cache then holds the prompt."""
    if runner.device.type == "cuda":
        torch.cuda.synchronize()
    began = time.perf_counter()
    start = prefix.begin(prompt) if reuse else 0
    tokens = runner.generate_tokens(prompt, FIRST_TOKEN, start=start)
    next(tokens)
    elapsed = (time.perf_counter() - began) * 1e3
    tokens.close()
    prefix.written(prompt)
    return elapsed, start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m inference.bench.prefix_reuse", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--model", default="laneformer-2b", help="a preset (random weights) or a checkpoint folder"
    )
    parser.add_argument("--context", type=int, default=3000, help="the conversation's tokens so far")
    parser.add_argument("--new", type=int, default=50, help="the follow-up's new tokens")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--device")
    parser.add_argument("--dtype")
    parser.add_argument("--json", help="write the figures here too")
    args = parser.parse_args(argv)

    device = parse_device(args.device)
    model = build_model(args.model, device, parse_dtype(args.dtype, device))
    max_context = min(model.cfg.max_position_embeddings, args.context + args.new + 64)
    runner = _make_runner(model, max_context, model.cfg.vocab_size)
    prefix = PrefixCache.sized(runner.cache, requested=2)
    rng = random.Random(0)
    vocab = model.cfg.vocab_size

    def ids(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    conversation = ids(args.context)
    follow_up = conversation + ids(args.new)
    other = ids(args.context // 2)

    def cold() -> tuple[float, int]:
        return first_token_ms(runner, prefix, follow_up, reuse=False)

    def live() -> tuple[float, int]:
        first_token_ms(runner, prefix, conversation, reuse=False)  # the last turn
        return first_token_ms(runner, prefix, follow_up, reuse=True)

    def slot() -> tuple[float, int]:
        first_token_ms(runner, prefix, conversation, reuse=False)
        first_token_ms(
            runner, prefix, other, reuse=True
        )  # another visitor's request: the conversation is saved
        return first_token_ms(runner, prefix, follow_up, reuse=True)

    print(f"{args.model} on {device}: {runner.__class__.__name__}, a follow-up of {args.new} new tokens after "
          f"{args.context}; median of {args.runs} runs, ms to the first token")  # fmt: skip
    results: dict[str, dict] = {}
    for name, measure in (("cold", cold), ("live", live), ("slot", slot)):
        measure()  # warm-up: compiles, the prefill's first allocations
        timed = [measure() for _ in range(args.runs)]
        ms = statistics.median(t for t, _ in timed)
        results[name] = {"ttft_ms": ms, "cached_tokens": timed[-1][1]}
    base = results["cold"]["ttft_ms"]
    ok = True
    for name, row in results.items():
        speedup = base / row["ttft_ms"]
        row["speedup"] = speedup
        verdict = "" if name == "cold" else ("  PASS" if speedup >= GOAL else "  FAIL") + f" (goal {GOAL:g}x)"
        ok &= name == "cold" or speedup >= GOAL
        print(
            f"  {name:5s} {row['ttft_ms']:8.2f} ms  cached {row['cached_tokens']:5d}  {speedup:5.1f}x{verdict}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "context": args.context, "new": args.new, **results}, f, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
