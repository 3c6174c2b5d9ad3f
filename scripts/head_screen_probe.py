"""The greedy head alone, whole (lm_head) against its int8 screen (kernels/lm_head_screen.py) in a few block
shapes: us a call in a CUDA graph, GB/s of the bytes each reads, and how many candidate rows the screen left;
then the sampled head at the page's temperature (0.2), whole against screened, with and without the candidate
tally the runner reads (GPU only).

    python scripts/head_screen_probe.py --model llama-3.2-1b [--steps 64] [--json out.json]

The head's input is the residual the runner leaves after decoding `--steps` tokens of a random prompt, so the
candidates are those of real steps of the model (random or peaked weights, as bench builds them).
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from inference.bench.ceiling import measure_bandwidth  # noqa: E402
from inference.bench.model_setup import build_model, cuda_missing  # noqa: E402
from inference.bench.timing import median_ms  # noqa: E402
from inference.fast.runner import FastRunner  # noqa: E402
from kernels.lm_head import lm_head  # noqa: E402
from kernels.lm_head_screen import screened_argmax, screened_logits  # noqa: E402

SHAPES = ({}, {"block_n": 4}, {"block_n": 8}, {"block_n": 16}, {"row_blocks": 2}, {"row_blocks": 8},
          {"block_n": 16, "row_blocks": 2}, {"num_warps": 8}, {"block_n": 16, "num_warps": 8}, {"slice_rows": 256},
          {"slice_rows": 1024}, {"cap": 16})  # fmt: skip


def timed(fn) -> float:
    """us of one fn() replayed from a CUDA graph of 16 calls."""
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(16):
            fn()
    return median_ms(graph.replay, repeats=20) * 1e3 / 16


def sampled_rows(runner, head_x, head_norm, full_bytes: int, screen_bytes: int) -> list[dict]:
    """The head of a sampled step at temperature 0.2 (no penalty): lm_head's logits, and the screened logits
    without and with the candidate tally (screened_logits' candidate_ring, which FastRunner reads); neither
    moves the position."""
    cfg = runner.cfg
    runner.sampling.copy_(torch.tensor([0.2, 0.0, 0.95, 1.0]))
    common = {"norm_weight": head_norm, "eps": cfg.norm_eps, "vocab_limit": runner.vocab_limit,
              "use_pdl": runner.use_pdl}  # fmt: skip
    screened = {"seen": runner.seen, "params": runner.sampling, **common}
    rows = [{"head": "lm_head, sampled (logits)", "bytes": full_bytes,
             "us": timed(lambda: lm_head(head_x, runner.head_weight, runner.logits, runner.head_scratch,
                                         greedy=False, **common))}]  # fmt: skip
    for ring in (None, runner.host_candidates):

        def run(ring=ring) -> None:
            screened_logits(head_x, runner.head_weight, runner.head_screen, runner.screen_scratch, runner.logits,
                            candidate_ring=ring, pos=runner.pos, **screened)  # fmt: skip

        us = timed(run)
        kept = int((runner.logits > float("-inf")).sum())
        name = "screened_logits, T 0.2" + (", candidate tally" if ring is not None else "")
        rows.append({"head": f"{name} ({kept} rows read again)", "bytes": screen_bytes, "us": us})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--init", default=None)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if cuda_missing("head_screen_probe"):
        return 2
    device = torch.device("cuda")
    read_gbs = measure_bandwidth(device)["read_gbs"]
    model = build_model(args.model, device, torch.bfloat16, init=args.init)
    cfg = model.cfg
    runner = FastRunner(model, 64 + args.steps + 2, head_screen=True)
    prompt = torch.randint(0, cfg.vocab_size, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    runner.prefill(prompt)
    candidates = []
    for _ in range(args.steps):  # the candidates of every real step
        runner.step()
        candidates.append(runner.screen_scratch.candidates(runner.vocab_limit))
    if cfg.num_lanes > 1:
        head_x, head_norm = runner.head_in, None
    else:
        head_x, head_norm = runner.x[0], runner.final_norm_weight[0]
    pos = runner.pos.clone()
    common = {"token": runner.token, "pos": runner.pos, "out_tokens": runner.out_tokens, "norm_weight": head_norm,
              "eps": cfg.norm_eps, "vocab_limit": runner.vocab_limit, "use_pdl": runner.use_pdl}  # fmt: skip
    full_bytes = runner.head_weight.numel() * runner.head_weight.element_size()
    screen_bytes = runner.head_screen.nbytes + 8 * cfg.vocab_size

    def keep_pos(us: float) -> float:
        runner.pos.copy_(pos)  # every head launch advances the position
        return us

    rows = [{"head": "lm_head (whole bf16 head)", "bytes": full_bytes,
             "us": keep_pos(timed(lambda: lm_head(head_x, runner.head_weight, runner.logits, runner.head_scratch,
                                                  greedy=True, **common)))}]  # fmt: skip
    for shape in SHAPES:
        try:
            us = keep_pos(timed(lambda shape=shape: screened_argmax(head_x, runner.head_weight, runner.head_screen,
                                                                    runner.screen_scratch, **common, **shape)))  # fmt: skip
            rows.append({"head": f"screen {shape or 'default'}", "bytes": screen_bytes, "us": us})
        except Exception as e:  # one failing shape must not lose the others
            rows.append({"head": f"screen {shape}", "error": f"{type(e).__name__}: {e}".splitlines()[0]})
    rows += sampled_rows(runner, head_x, head_norm, full_bytes, screen_bytes)
    print(f"{args.model} ({args.init or 'random'}): read bandwidth {read_gbs:,.0f} GB/s; candidates a step over "
          f"{args.steps} steps: median {statistics.median(candidates)}, max {max(candidates)}")  # fmt: skip
    for r in rows:
        if "error" in r:
            print(f"  {r['head']:<48} failed: {r['error'][:100]}")
            continue
        gbs = r["bytes"] / r["us"] / 1e3
        print(f"  {r['head']:<48} {r['us']:7.1f} us  {gbs:6,.0f} GB/s ({100 * gbs / read_gbs:4.1f}%)")
    if args.json:
        args.json.write_text(json.dumps({"model": args.model, "init": args.init, "read_gbs": read_gbs,
                                         "candidates": candidates, "rows": rows}, indent=2) + "\n")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
