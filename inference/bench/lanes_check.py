"""python -m inference.bench.lanes_check: a model's lanes divided among processes give the one-process model's
greedy tokens (inference/lanes_parallel.py; a Llama or Qwen divided as tensor parallelism).

The one-process model decodes greedily; then `--procs` processes, each holding its share of the lanes, are fed
the same tokens (teacher forcing: one divergence does not hide the steps after it) and their argmax is compared
step by step. In fp32 a step is decisive when the reference's top two logits are further apart than `--margin`;
in bf16 when the top two of an fp32 copy of the same weights are further apart than the bf16 reference's own
largest logit error at that step (the yardstick of inference/bench/correctness.py), and the lanes' argmax is
held to the fp32 copy's there. Every decisive step must agree (a near-tie may flip with the order of the sums).
With `--mode peer` and one GPU the processes share it, exchanging through CUDA IPC mailboxes; `--mode nccl`
wants a GPU a process. Prints one JSON line; exit 1 when a decisive step disagrees. Example (random peaked weights, fp32):

    python -m inference.bench.lanes_check --model laneformer-2b --procs 2 --mode peer

`--engine` checks the worker's path instead (inference/lanes_runner.py, what --gpus N serves): the engine whose
lanes run on `--procs` processes against the one-process engine, both with `--backend` (reference, or the fast
path's kernels), greedy tokens of a text prompt; the model must be one the engine loads (a checkpoint, or a
preset it synthesises: tiny-laneformer, tiny-llama, tiny-qwen3).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time

import torch

from inference.bench.correctness import check_prompt
from inference.bench.model_setup import INITS, build_model
from inference.lanes_parallel import MODES, LaneShard, parallel_model, rank_device, spawn_lanes, transport
from inference.model import KVCache

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@torch.no_grad()
def reference(model, prompt: list[int], new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """The one-process model's greedy tokens and the fp32 logits of each step, [new_tokens, V] on the CPU."""
    device = model.tok_embeddings.device
    cache = KVCache(model.cfg, len(prompt) + new_tokens, 1, device, model.tok_embeddings.dtype)
    logits = [model(torch.tensor([prompt], device=device), 0, cache, last_only=True)[0, -1]]
    tokens = [int(logits[-1].argmax())]
    while len(tokens) < new_tokens:
        step = torch.tensor([tokens[-1:]], device=device)
        logits.append(model(step, len(prompt) + len(tokens) - 1, cache)[0, -1])
        tokens.append(int(logits[-1].argmax()))
    return tokens, torch.stack(logits).float().cpu()


@torch.no_grad()
def forced(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """`model`'s fp32 logits of each step fed the prompt and then `tokens` ([len(tokens), V] on the CPU)."""
    device = model.tok_embeddings.device
    cache = KVCache(model.cfg, len(prompt) + len(tokens), 1, device, model.tok_embeddings.dtype)
    logits = [model(torch.tensor([prompt], device=device), 0, cache, last_only=True)[0, -1]]
    for i, token in enumerate(tokens[:-1]):
        logits.append(model(torch.tensor([[token]], device=device), len(prompt) + i, cache)[0, -1])
    return torch.stack(logits).float().cpu()


def fp32_copy(model):
    """An fp32 model holding the same (rounded) weights: the exact function a bf16 model approximates."""
    from inference.model import Transformer

    copy = Transformer(model.cfg, device=model.tok_embeddings.device, dtype=torch.float32)
    copy.load_state_dict({k: v.float() for k, v in model.state_dict().items()}, strict=False)
    return copy.eval()


@torch.no_grad()
def forced_job(args: dict, prompt: list[int], tokens: list[int], rank: int, world: int):
    """spawn_lanes' job: this rank's lanes fed the prompt and then `tokens`; rank 0 returns each step's logits
    ([len(tokens), V] as numpy) and the decode steps' seconds, the others None."""
    mode, device = args["mode"], rank_device(args["mode"], rank)
    model = build_model(args["model"], device, DTYPES[args["dtype"]], args["seed"], args["init"])
    shard = LaneShard(parallel_model(model, world), rank, world, len(prompt) + len(tokens), transport(mode))
    logits = [shard.logits(shard.forward(prompt, 0))]
    if device.type == "cuda":
        torch.cuda.synchronize()
    began = time.perf_counter()
    for i, token in enumerate(tokens[:-1]):
        logits.append(shard.logits(shard.forward([token], len(prompt) + i)))
    shard.exchange.check()
    seconds = time.perf_counter() - began
    return (torch.stack(logits).cpu().numpy(), seconds) if rank == 0 else None


def compare(expected: torch.Tensor, got: torch.Tensor, needed: torch.Tensor) -> dict:
    """expected, got: [steps, V] fp32 logits; needed: [steps], the top-two gap that makes a step decisive."""
    top2 = expected.topk(2, dim=-1).values
    decisive = (top2[:, 0] - top2[:, 1]) > needed
    same = expected.argmax(-1) == got.argmax(-1)
    return {
        "steps": len(same),
        "same": int(same.sum()),
        "decisive_steps": int(decisive.sum()),
        "decisive_same": int((same & decisive).sum()),
        "max_abs_logit_diff": float((expected - got).abs().max()),
    }


def engine_check(args: argparse.Namespace) -> dict:
    """The worker's engine on `args.procs` processes against the one-process engine: greedy token ids."""
    import os

    from common.events import SamplingParams, TextDelta
    from inference.engine import Engine
    from inference.lanes_runner import load_lanes_engine

    # both engines through the same step: the reference one, or the fast path's kernels without speculation (the
    # lanes do not speculate)
    os.environ.update(KOG_BACKEND=args.backend, KOG_SPECULATIVE="0")
    device = "cpu" if args.mode == "gloo" else "cuda"
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=0)

    def tokens(engine) -> list[int]:
        ids = engine.encode_prompt("def fibonacci(n):\n    ")
        return [
            t
            for event in engine.generate(ids, params)
            if isinstance(event, TextDelta)
            for t in event.token_ids
        ]

    expected = tokens(Engine.load(args.model, device=device, dtype=args.dtype))
    lanes = load_lanes_engine(args.model, device, args.dtype, args.procs)
    got = tokens(lanes)
    lanes.runner.close()
    same = sum(a == b for a, b in zip(expected, got, strict=False))
    return {"steps": len(expected), "same": same, "identical": expected == got}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m inference.bench.lanes_check", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--model", default="laneformer-2b", help="a preset or a checkpoint directory")
    parser.add_argument("--procs", type=int, default=2, help="processes the lanes are divided among")
    parser.add_argument("--mode", choices=tuple(MODES), default="peer")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    parser.add_argument("--init", choices=INITS, default="peaked", help="a preset's weights")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--prompt-len", type=int, default=160, help="longer than a mailbox: prefilled in pieces"
    )
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--margin", type=float, default=1e-2, help="fp32: the decisive top-two gap")
    parser.add_argument("--engine", action="store_true", help="the worker's engine (--gpus N) instead")
    parser.add_argument("--backend", choices=("reference", "fast"), default="reference", help="with --engine")
    args = parser.parse_args(argv)
    if args.engine:
        result = {**engine_check(args), "model": args.model, "procs": args.procs, "mode": args.mode,
                  "backend": args.backend}  # fmt: skip
        print(json.dumps(result))
        return 0 if result["identical"] else 1

    device = rank_device(args.mode, 0)
    model = build_model(args.model, device, DTYPES[args.dtype], args.seed, args.init)
    prompt = check_prompt(args.model, model.cfg.vocab_size, args.prompt_len)
    tokens, expected = reference(model, prompt, args.new_tokens)
    yardstick, needed = expected, torch.full((len(tokens),), args.margin)
    if args.dtype != "float32":
        yardstick = forced(fp32_copy(model), prompt, tokens)
        needed = (expected - yardstick).abs().amax(-1)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    job = functools.partial(forced_job, vars(args), prompt, tokens)
    got, seconds = spawn_lanes(args.procs, job, mode=args.mode)[0]
    got = torch.from_numpy(got)
    result = compare(yardstick, got, needed)
    result["same_as_reference"] = int((expected.argmax(-1) == got.argmax(-1)).sum())  # in its own dtype
    result.update(model=args.model, procs=args.procs, mode=args.mode, dtype=args.dtype,
                  device=str(device), decode_s=round(seconds, 3))  # fmt: skip
    print(json.dumps(result))
    return 0 if result["decisive_same"] == result["decisive_steps"] else 1


if __name__ == "__main__":
    sys.exit(main())
