"""python -m inference.bench.lanes_scaling: decode speed of one request with a Laneformer's lanes on 1, 2, 4, 8
GPUs (a Llama or Qwen split as tensor parallelism: lanes_parallel.parallel_config), one table from one command.

Row "1 (one-GPU runner)" is what the engine serves on one GPU (inference/fast/runner.py, lane groups on two
streams). Each row of P spawns P processes, rank r on GPU r (or sharing the GPUs where there are fewer: then the
figures check the command, not the scaling), builds the preset on each (the same random weights), prefills
`--prompt-len` ids (LaneShard, eager) and decodes `--new-tokens` greedily with the fast path's rank runners
(inference/fast/lane_rank.py, a CUDA graph a rank, partials exchanged through peer mailboxes).

Per row: tok/s as the serving loop sees it (host clock over the tokens read back, after warm-up); the step's
device time (graph replays back to back, median of repeats) and what it is made of:
    stream    the rank's bytes a step (its weight slices, its keys and values, the whole head's screen) at the
              copy bandwidth measured in the same run: the time the memory needs
    exchange  the step less the same step captured without its posts and waits (wrong tokens, same streaming)
    gaps      the step without exchange less `stream`: launches, dependent reads, kernels below the bandwidth
and how many of the greedy tokens equal the one-GPU runner's (bf16: a near-tie may flip with the order of sums).

    python -m inference.bench.lanes_scaling --model laneformer-2b --procs 1 2 4 8 --json scaling.json
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time

import torch

from common.events import SamplingParams
from inference.bench.ceiling import kernel_bytes, measure_bandwidth
from inference.bench.model_setup import INITS, build_model, cuda_missing
from inference.fast.lane_rank import LaneRankRunner
from inference.fast.runner import FastRunner
from inference.lanes_parallel import LaneShard, parallel_model, spawn_lanes
from inference.speculative import SpeculationSettings

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def replay_ms(graph: torch.cuda.CUDAGraph, pos: torch.Tensor, position: int, replays: int = 64,
              repeats: int = 5) -> float:  # fmt: skip
    """Median over `repeats` of one step's device time over `replays` back-to-back replays from `position` (every
    rank runs the same replays)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        pos.fill_(position)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / replays)
    return statistics.median(times)


def served_tok_s(tokens_after_first, steps: int) -> tuple[list[int], float]:
    """The tokens a decode loop yields and its tok/s by the host's clock (the serving loop's view)."""
    torch.cuda.synchronize()
    began = time.perf_counter()
    tokens = list(tokens_after_first)
    return tokens, steps / (time.perf_counter() - began)


@torch.no_grad()
def one_gpu_job(args: dict, prompt: list[int], rank: int, world: int) -> dict:
    """The engine's one-GPU runner (speculation off: the table compares plain steps)."""
    model = build_model(
        args["model"], torch.device("cuda", 0), DTYPES[args["dtype"]], args["seed"], args["init"]
    )
    runner = FastRunner(
        model, len(prompt) + args["new_tokens"] + 2, speculation=SpeculationSettings(enabled=False)
    )
    runner.place_residual()
    params = SamplingParams(max_new_tokens=args["new_tokens"], temperature=0)
    list(runner.generate_tokens(prompt, params))  # warm-up
    stream = runner.generate_tokens(prompt, params)
    first = next(stream)
    tokens, tok_s = served_tok_s(stream, args["new_tokens"] - 1)
    step = replay_ms(runner.capture(greedy=True), runner.pos, len(prompt))
    bytes_ = sum(b for _, b in kernel_bytes(model.cfg, model.tok_embeddings.element_size(), len(prompt) + 1,
                                            head_screen=runner.head_screen is not None))  # fmt: skip
    return {"tokens": [first, *tokens], "tok_s": tok_s, "step_ms": step, "bytes": bytes_}


@torch.no_grad()
def rank_job(args: dict, prompt: list[int], rank: int, world: int) -> dict | None:
    """Rank `rank` of `world`: prefill, warm-up, a served decode, then the step with and without the exchange."""
    device = torch.device("cuda", rank % torch.cuda.device_count())
    model = build_model(args["model"], device, DTYPES[args["dtype"]], args["seed"], args["init"])
    shard = LaneShard(parallel_model(model, world), rank, world, len(prompt) + args["new_tokens"] + 2, "peer")
    runner = LaneRankRunner(shard)
    first = shard.argmax(shard.forward(prompt, 0))
    runner.start(first, len(prompt), prompt)
    list(runner.decode(8))  # warm-up: the graph captured, the kernels compiled
    runner.start(first, len(prompt), prompt)
    tokens, tok_s = served_tok_s(runner.decode(args["new_tokens"] - 1), args["new_tokens"] - 1)
    step = replay_ms(runner.graph(True), runner.pos, len(prompt))
    alone = replay_ms(runner.graph(True, exchanging=False), runner.pos, len(prompt))
    bytes_ = sum(b for _, b in kernel_bytes(shard.shard_cfg, model.tok_embeddings.element_size(), len(prompt) + 1,
                                            head_screen=runner.head_screen is not None))  # fmt: skip
    if rank:
        return None
    return {
        "tokens": [first, *tokens],
        "tok_s": tok_s,
        "step_ms": step,
        "no_exchange_ms": alone,
        "bytes": bytes_,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m inference.bench.lanes_scaling", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--model", default="laneformer-2b", help="a preset or a checkpoint directory")
    parser.add_argument("--procs", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--init", choices=INITS, help="a preset's weights: random (default) or peaked")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    if cuda_missing("lanes_scaling"):
        return 2
    prompt = torch.randint(0, 1000, (args.prompt_len,), generator=torch.Generator().manual_seed(1)).tolist()
    copy_gbs = measure_bandwidth(torch.device("cuda", 0))["copy_gbs"]
    torch.cuda.empty_cache()
    baseline = spawn_lanes(1, functools.partial(one_gpu_job, vars(args), prompt), mode="peer")[0]
    rows = [{"procs": "1 (one-GPU runner)", **baseline}]
    for procs in args.procs:
        rows.append({"procs": procs, **spawn_lanes(procs, functools.partial(rank_job, vars(args), prompt),
                                                   mode="peer")[0]})  # fmt: skip
    head = f"{'GPUs':>20} {'tok/s':>8} {'step ms':>8} {'stream':>7} {'exchange':>8} {'gaps':>6} {'same tokens':>12}"
    print(
        f"{args.model}, {args.dtype}, {args.prompt_len} + {args.new_tokens}, copy bandwidth {copy_gbs:.0f} GB/s"
    )
    print(head)
    for row in rows:
        row["stream_ms"] = row["bytes"] / copy_gbs / 1e6
        row["same_tokens"] = next(
            (i for i, (a, b) in enumerate(zip(row["tokens"], baseline["tokens"], strict=True)) if a != b),
            len(row["tokens"]),
        )
        exchange = row["step_ms"] - row["no_exchange_ms"] if "no_exchange_ms" in row else None
        gaps = row.get("no_exchange_ms", row["step_ms"]) - row["stream_ms"]
        row.update(exchange_ms=exchange, gaps_ms=gaps)
        print(f"{row['procs']!s:>20} {row['tok_s']:>8.1f} {row['step_ms']:>8.3f} {row['stream_ms']:>7.3f} "
              f"{'-' if exchange is None else f'{exchange:.3f}':>8} {gaps:>6.3f} "
              f"{row['same_tokens']:>5}/{len(row['tokens'])}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "dtype": args.dtype, "copy_gbs": copy_gbs, "prompt_len": args.prompt_len,
                       "new_tokens": args.new_tokens, "rows": rows}, f, indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
