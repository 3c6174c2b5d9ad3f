"""Does the speed survive the product? The benchmark's decode tok/s against the real worker streaming into Redis.

    python scripts/bench_worker.py --model llama-3.2-1b [--prompt-len 512] [--new-tokens 256] [--jobs 5]
                                   [--json out.json]

In one run on one GPU:
  1. the engine in this process: the benchmark's figure (inference.bench.timing.time_fast: prefill, then
     back-to-back graph replays, device-timed) and the runner contract's figure, on the same prompt;
  2. a private redis-server and `python -m inference.worker` in its own process on the same model; jobs go in
     through common.protocol.JobClient and their streams are read to the end, as the web side does;
     the worker's figure is the median `decode_tok_s` of the `done` stats (token arrival times on the host,
     after detokenisation, stop-string filtering and publishing).
The product keeps the speed when worker / benchmark >= 97%.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PROMPT_SEED = '''def fibonacci(n):
    """Return the n-th Fibonacci number."""
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        return self.items.pop()
'''


def prompt_text(engine, length: int) -> tuple[str, int]:
    """Code text that the model's tokenizer turns into about `length` tokens."""
    ids = engine.tokenizer.encode(PROMPT_SEED * (1 + length // 16))[:length]
    text = engine.tokenizer.decode(ids)
    return text, len(engine.encode_prompt(prompt=text))


def bench_figures(engine, text: str, new_tokens: int, runs: int) -> dict:
    from inference.bench.timing import time_contract, time_fast

    prompt_ids = engine.encode_prompt(prompt=text)
    fast = time_fast(engine.runner, prompt_ids, new_tokens, runs)
    contract = time_contract(engine.runner, prompt_ids, new_tokens, runs)
    return {
        "bench_tok_s": fast["tok_s"],
        "bench_runs": fast["tok_s_runs"],
        "contract_tok_s": contract["tok_s"],
    }


async def run_jobs(url: str, model: str, text: str, new_tokens: int, jobs: int, wait_s: float) -> list[dict]:
    import redis.asyncio as aioredis

    from common.protocol import JobClient, JobSpec

    r = aioredis.from_url(url, decode_responses=True)
    client = JobClient(r)
    deadline = time.monotonic() + wait_s
    while not any(model in w.get("models", []) for w in await client.workers()):
        if time.monotonic() > deadline:
            raise RuntimeError(f"no worker for {model} within {wait_s:.0f} s")
        await asyncio.sleep(0.5)
    results = []
    for _ in range(jobs + 1):  # the first is a warm-up
        job_id = await client.submit(JobSpec(model=model, prompt=text, params={"max_new_tokens": new_tokens}))
        deltas, last = 0, None
        async for _, kind, data in client.events(job_id):
            if kind == "delta":
                deltas += 1
            last = (kind, data)
        kind, data = last
        if kind != "done":
            raise RuntimeError(f"job ended with {kind}: {data}")
        stats = data["stats"]
        results.append({"decode_tok_s": stats["decode_tok_s"], "tokens": stats["completion_tokens"],
                        "ttft_ms": stats["ttft_ms"], "frames": deltas, "finish": data["finish_reason"]})  # fmt: skip
    await r.aclose()
    return results[1:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a preset name or a checkpoint directory")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--jobs", type=int, default=5, help="timed jobs through the worker (after a warm-up)")
    parser.add_argument("--runs", type=int, default=5, help="timed benchmark runs (after a warm-up)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--log", type=Path, help="the worker's log (default: a temporary file)")
    args = parser.parse_args(argv)

    import torch

    from common.redis_server import start_redis
    from inference.bench.model_setup import cuda_missing
    from inference.engine import Engine

    if cuda_missing("bench_worker"):
        return 2
    scratch = Path(tempfile.mkdtemp(prefix="bench_worker."))
    os.environ.setdefault("KOG_CACHE_DIR", str(scratch / "cache"))  # the worker synthesises nothing again

    engine = Engine.load(args.model, device="cuda")
    text, prompt_tokens = prompt_text(engine, args.prompt_len)
    result = {"model": engine.name, "device": torch.cuda.get_device_name(), "prompt_tokens": prompt_tokens,
              "new_tokens": args.new_tokens, "runner": type(engine.runner).__name__}  # fmt: skip
    result.update(bench_figures(engine, text, args.new_tokens, args.runs))
    del engine
    gc.collect()
    torch.cuda.empty_cache()

    redis_proc, url = start_redis(scratch / "redis")
    log_path = args.log or scratch / "worker.log"
    with open(log_path, "w") as log:
        worker = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "inference.worker",
                "--model",
                args.model,
                "--redis-url",
                url,
                "--device",
                "cuda",
            ],  # fmt: skip
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=Path(__file__).resolve().parent.parent,
        )
    try:
        jobs = asyncio.run(run_jobs(url, result["model"], text, args.new_tokens, args.jobs, wait_s=600))
    finally:
        worker.terminate()
        try:
            worker.wait(timeout=30)
        except subprocess.TimeoutExpired:
            worker.kill()
        redis_proc.terminate()
        redis_proc.wait(timeout=10)
    result["jobs"] = jobs
    result["worker_tok_s"] = statistics.median(j["decode_tok_s"] for j in jobs)
    result["ratio"] = result["worker_tok_s"] / result["bench_tok_s"]
    result["passed"] = result["ratio"] >= 0.97

    print(
        f"{result['model']} on {result['device']} · prompt {prompt_tokens} tokens · {args.new_tokens} new · greedy"
    )
    print("| path | decode tok/s | % of benchmark |")
    print("| --- | --- | --- |")
    print(f"| benchmark (CUDA graph replays, device-timed) | {result['bench_tok_s']:,.0f} | 100% |")
    print(f"| runner contract (engine path, host-timed) | {result['contract_tok_s']:,.0f} | "
          f"{100 * result['contract_tok_s'] / result['bench_tok_s']:.1f}% |")  # fmt: skip
    print(f"| worker -> Redis stream (done stats, median of {len(jobs)}) | {result['worker_tok_s']:,.0f} | "
          f"{100 * result['ratio']:.1f}% |")  # fmt: skip
    print("jobs: " + ", ".join(f"{j['decode_tok_s']:,.0f} tok/s ({j['tokens']} tokens, {j['frames']} frames, "
                               f"{j['finish']})" for j in jobs))  # fmt: skip
    print(f"speed survives the product (>= 97%): {'PASS' if result['passed'] else 'FAIL'}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
