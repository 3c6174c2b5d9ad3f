"""python -m inference.bench.lanes_scaling: decode speed of one request with a model's lanes on 1, 2, 4, 8
processes (inference/lanes_parallel.py), one table from one command.

Each row spawns P ranks (`--mode peer`: GPU r for rank r, or sharing the GPUs where there are fewer; `nccl`: a
GPU a rank; `gloo`: the CPU), builds the preset on each (random weights), prefills `--prompt-len` ids and decodes
`--new-tokens` greedily; rank 0 times the decode steps. Alongside: the share of a step rank 0 spends in the
exchange, its posts, waits for the peers' partial sums and the head's gathers (host-timed, synchronising around
each, so only with `--breakdown`: it slows the step it measures). On one GPU shared by P processes the figures say nothing about scaling; they check that the
command runs.

    python -m inference.bench.lanes_scaling --model laneformer-2b --procs 1 2 4 8 --prompt-len 512 --new-tokens 256
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time

import torch

from inference.bench.model_setup import build_model
from inference.lanes_parallel import MODES, LaneShard, greedy, rank_device, spawn_lanes, transport

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TimedExchange:
    """Wraps an exchange so that its posts, waits and gathers are timed on the host (synchronising the device
    around each)."""

    def __init__(self, exchange, device: torch.device):
        self.exchange, self.device, self.seconds = exchange, device, 0.0

    def __getattr__(self, name):
        return getattr(self.exchange, name)

    def _timed(self, call, *args):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        began = time.perf_counter()
        result = call(*args)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.seconds += time.perf_counter() - began
        return result

    def reduce(self, box, slot, total, at_once):
        wait = self._timed(self.exchange.reduce, box, slot, total, at_once)
        return lambda: self._timed(wait)

    def gather(self, box, slot, tensor):
        return self._timed(self.exchange.gather, box, slot, tensor)


@torch.no_grad()
def decode_job(args: dict, prompt: list[int], rank: int, world: int):
    """spawn_lanes' job: rank 0 returns (decode tok/s, share of the decode spent exchanging, or None)."""
    device = rank_device(args["mode"], rank)
    model = build_model(args["model"], device, DTYPES[args["dtype"]], args["seed"])
    shard = LaneShard(model, rank, world, len(prompt) + args["new_tokens"] + 1, transport(args["mode"]))
    if args["breakdown"]:
        shard.exchange = TimedExchange(shard.exchange, device)
    greedy(shard, prompt, 4)  # warm-up: kernels compiled, caches touched
    shard.cache.k.zero_()
    shard.cache.v.zero_()
    y = shard.forward(prompt, 0)
    token = shard.argmax(y)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if args["breakdown"]:
        shard.exchange.seconds = 0.0
    began = time.perf_counter()
    for i in range(args["new_tokens"] - 1):
        token = shard.argmax(shard.forward([token], len(prompt) + i))  # the token read back: the step's end
    seconds = time.perf_counter() - began
    waits = shard.exchange.seconds / seconds if args["breakdown"] else None
    return ((args["new_tokens"] - 1) / seconds, waits) if rank == 0 else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m inference.bench.lanes_scaling", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--model", default="laneformer-2b", help="a preset or a checkpoint directory")
    parser.add_argument("--procs", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--mode", choices=tuple(MODES), default="peer")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--breakdown", action="store_true", help="also time the exchange (slows the step)")
    args = parser.parse_args(argv)
    prompt = torch.randint(0, 1000, (args.prompt_len,), generator=torch.Generator().manual_seed(1)).tolist()
    rows = []
    for procs in args.procs:
        tok_s, waits = spawn_lanes(procs, functools.partial(decode_job, vars(args), prompt), mode=args.mode)[
            0
        ]
        rows.append({"procs": procs, "tok_s": round(tok_s, 1), "exchange_share": waits and round(waits, 3)})
        print(
            json.dumps({**rows[-1], "model": args.model, "mode": args.mode, "dtype": args.dtype}), flush=True
        )
    print(f"{'procs':>5}  {'tok/s':>8}  {'exchange':>8}")
    for row in rows:
        waits = "-" if row["exchange_share"] is None else f"{row['exchange_share']:.0%}"
        print(f"{row['procs']:>5}  {row['tok_s']:>8.1f}  {waits:>8}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
