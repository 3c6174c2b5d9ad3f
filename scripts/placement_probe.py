"""Whether a runner's decode speed follows where one of its buffers lies (GPU only): runners of one setting,
built from the same weights, each timed as built and again after each of its buffers is moved
(inference/bench/placement.py) to each offset into a fresh allocation.

    python scripts/placement_probe.py --model qwen3-1.7b --runners 2 --move residual --move sums \
        --move words.gate_up [--offsets 0,4096,65536] [--timings 2] [--breakdown] [--json out.json]

A runner whose speed changes with a move, or two runners that trade places, name the buffer; kernels/NOTES.md
rounds 38-40 tell what was moved (the sums, the norm's scalar, the down-proj's and gate/up's words, the KV cache
and the merge scratch: none of them; the residual: it, which inference/fast/residual_placement.py now places).
The runners are built with KOG_RESIDUAL_CANDIDATES as set (unset: each places its residual as it is built).
Timing as scripts/decode_variants.py's (bench.timing.time_fast: the median of --runs after a warm-up);
--breakdown adds the us on the step's critical path of the kinds that share the residual.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from inference.bench.ceiling import measure_bandwidth  # noqa: E402
from inference.bench.model_setup import build_model, cuda_missing  # noqa: E402
from inference.bench.placement import MOVABLE, move  # noqa: E402
from inference.bench.profiling import breakdown  # noqa: E402
from inference.bench.timing import time_fast  # noqa: E402
from inference.fast.runner import FastRunner  # noqa: E402

BREAKDOWN_KINDS = ("o-proj", "gate/up", "down")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3-1.7b")
    parser.add_argument("--runners", type=int, default=2)
    parser.add_argument("--move", action="append", choices=MOVABLE, default=[])
    parser.add_argument(
        "--offsets", default="0,4096", help="bytes into each fresh allocation, comma-separated"
    )
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--timings", type=int, default=2, help="time_fast calls a state")
    parser.add_argument("--breakdown", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if cuda_missing("placement_probe"):
        return 2
    offsets = [int(part) for part in args.offsets.split(",") if part.strip()]
    device = torch.device("cuda")
    bandwidth = measure_bandwidth(device)
    model = build_model(args.model, device, torch.bfloat16)
    prompt = torch.randint(0, model.cfg.vocab_size, (args.prompt_len,),
                           generator=torch.Generator().manual_seed(0)).tolist()  # fmt: skip
    runners = [FastRunner(model, args.prompt_len + args.new_tokens + 1) for _ in range(args.runners)]
    rows = []

    def timed(r: int, state: str) -> None:
        runner = runners[r]
        row = {"runner": r, "state": state,
               "tok_s": [time_fast(runner, prompt, args.new_tokens, args.runs)["tok_s"] for _ in range(args.timings)]}  # fmt: skip
        if args.breakdown:
            kinds = breakdown(model, runner, prompt, 20, bandwidth["read_gbs"]).get("kinds", {})
            row["path_us"] = {kind: kinds[kind]["path_us"] for kind in BREAKDOWN_KINDS if kind in kinds}
        rows.append(row)
        path = ", ".join(f"{kind} {us:.1f}" for kind, us in row.get("path_us", {}).items())
        print(
            f"runner {r} {state:<28} " + " ".join(f"{t:,.1f}" for t in row["tok_s"]) + f"  {path}", flush=True
        )

    for r in range(args.runners):
        timed(r, "as built")
    for what in args.move:
        for offset in offsets:
            for r, runner in enumerate(runners):
                if move(runner, what, offset):
                    timed(r, f"{what} +{offset} B")
    print(f"{args.model}: {bandwidth['read_gbs']:,.0f} GB/s read")
    if args.json:
        args.json.write_text(
            json.dumps({"model": args.model, "bandwidth": bandwidth, "rows": rows}, indent=2) + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
