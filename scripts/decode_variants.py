"""Decode tok/s of several FastRunner settings of one model, timed in turns within one process (GPU only).

    python scripts/decode_variants.py --model llama-3.2-1b --variant "" --variant o=16 --variant o=16,qkv=2 \
        [--prompt-len 512] [--new-tokens 256] [--rounds 3] [--json out.json]

A variant is a KOG_PREFETCH-style list (kind=tiles, kinds qkv, o, gate_up, down; "" is the default), where
rows.qkv=n / rows.gate_up=n set FastRunner's row_blocks, blocks.down=2/1024/8 (block_n/block_k/num_warps of a kind) its block sizes and head.row_blocks=4
(or head.block_n, head.num_warps) the head's, attn.splits=32 (or attn.block_t, attn.num_warps, attn.maxnreg, attn.prefetch_next=0|1, and
attn.cluster=0|1 for the merge, attn.push=0|1 for its partials through shared memory, attn.kv_evict_first=0|1 for its cache reads' hint) the attention's, lanes.groups=n its lane groups (1: none), early.o=0|1 (kinds qkv, o,
gate_up, down) whether a kind lets the next kernel launch before its wait, screen=0|1 the greedy head through its int8
screen (kernels/lm_head_screen.py) or the whole bf16 head, packed=0|1|o+down the one-lane kinds read from 12-bit
weights on the tensor cores (kernels/packed_mma_gemv.py; KOG_PACKED's form), packed.down=1/16/4/1 (block_m/split/ahead/items
of packed.qkv, packed.o, packed.gate_up, packed.glu or packed.down; 0 keeps the default; packed.glu takes a fifth, before:
the chunks of ahead it loads before its wait) their blocks;
"name:spec" labels one, so a setting can be built twice (two runner instances: what memory placement alone
does). Every round times each variant once (bench.timing.time_fast: median of --runs after a warm-up), so slow drifts of the clock or
the temperature hit all variants alike; the table keeps the median over rounds, beside the ceiling measured in
the same run. --breakdown then prints each variant's time per kind of kernel on the step's critical path against
the bytes it must read (inference.bench's --breakdown).
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from inference.bench.ceiling import measure_bandwidth, step_bytes  # noqa: E402
from inference.bench.model_setup import build_model, cuda_missing  # noqa: E402
from inference.bench.profiling import breakdown  # noqa: E402
from inference.bench.timing import time_fast  # noqa: E402
from inference.fast.runner import FastRunner  # noqa: E402
from inference.fast.settings import (  # noqa: E402
    ATTENTION_KEYS,
    ATTENTION_SWITCHES,
    EARLY_KINDS,
    HEAD_KEYS,
    LANE_GROUP_KEYS,
    PACKED_KEYS,
    PACKED_KINDS,
    PACKED_OPTIONAL_KEYS,
    ROW_BLOCK_KINDS,
    block_spec,
    kind_overrides,
    prefetch_overrides,
)


def runner_kwargs(spec: str) -> dict:
    """'o=16,rows.gate_up=8,blocks.down=4/4096/8,head.row_blocks=2' -> FastRunner(prefetch={'o': 16},
    row_blocks={'gate_up': 8}, blocks={'down': {...}}, head_blocks={'row_blocks': 2}); 'residual=1' ->
    residual_candidates=1 (the residual's addresses timed while building: inference/fast/residual_placement.py)."""
    items = [item.strip() for item in spec.split(",") if item.strip()]
    screen = [item.partition("=")[2] for item in items if item.startswith("screen=")]
    if any(value not in ("0", "1") for value in screen):
        raise ValueError(f"screen: expected screen=0 or screen=1, got {spec!r}")
    packed = [item.partition("=")[2] for item in items if item.startswith("packed=")]  # settings.packed_kinds
    residual = [item.partition("=")[2] for item in items if item.startswith("residual=")]
    if any(not value.isdigit() or int(value) < 1 for value in residual):
        raise ValueError(f"residual: expected residual=N, N >= 1 (addresses timed), got {spec!r}")
    items = [item for item in items if not item.startswith(("screen=", "packed=", "residual="))]
    prefixes = ("rows.", "blocks.", "head.", "attn.", "lanes.", "early.", "packed.")

    def group(prefix: str) -> str:
        return ",".join(item.removeprefix(prefix) for item in items if item.startswith(prefix))

    tiles = ",".join(item for item in items if not item.startswith(prefixes))
    return {"prefetch": prefetch_overrides(tiles),
            "row_blocks": kind_overrides(group("rows."), ROW_BLOCK_KINDS, "row_blocks"),
            "blocks": block_spec(group("blocks.")),
            "head_blocks": kind_overrides(group("head."), HEAD_KEYS, "head_blocks"),
            "attention": kind_overrides(group("attn."), ATTENTION_KEYS, "attention", ATTENTION_SWITCHES),
            "lane_groups": kind_overrides(group("lanes."), LANE_GROUP_KEYS, "lane_groups"),
            "early": kind_overrides(group("early."), EARLY_KINDS, "early", EARLY_KINDS),
            "head_screen": bool(int(screen[-1])) if screen else None, "packed": packed[-1] if packed else None,
            "packed_blocks": block_spec(group("packed."), PACKED_KEYS, PACKED_KINDS, "packed_blocks",
                                        PACKED_OPTIONAL_KEYS),
            "residual_candidates": int(residual[-1]) if residual else None}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--variant", action="append", default=[], help="kind=tiles,... ('' = defaults)")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--breakdown", action="store_true", help="us on the path by kind of kernel")
    parser.add_argument("--empty-cache", action="store_true",
                        help="return the bandwidth test's 4 GiB to the driver before building the runners")  # fmt: skip
    args = parser.parse_args()
    if cuda_missing("decode_variants"):
        return 2
    variants = args.variant or [""]
    device = torch.device("cuda")
    bandwidth = measure_bandwidth(device)
    model = build_model(args.model, device, torch.bfloat16)
    if args.empty_cache:
        torch.cuda.empty_cache()
    context = args.prompt_len + args.new_tokens + 1
    ceiling = bandwidth["read_gbs"] * 1e9 / step_bytes(model, args.prompt_len + args.new_tokens // 2)
    prompt = torch.randint(0, model.cfg.vocab_size, (args.prompt_len,),
                           generator=torch.Generator().manual_seed(0)).tolist()  # fmt: skip
    runners = {v: FastRunner(model, context, **runner_kwargs(v.rpartition(":")[2])) for v in variants}
    tok_s: dict[str, list[float]] = {v: [] for v in variants}
    # greedy output of each variant (block sizes change the summation order)
    tokens: dict[str, list[int]] = {}
    for _ in range(args.rounds):
        for v, runner in runners.items():
            tok_s[v].append(time_fast(runner, prompt, args.new_tokens, args.runs)["tok_s"])
            tokens[v] = runner.out_tokens[args.prompt_len : args.prompt_len + args.new_tokens].tolist()
    rows = [{"variant": v or "default", "prefetch": runners[v].prefetch, "row_blocks": runners[v].row_blocks,
             "blocks": runners[v].blocks,
             "head_blocks": runners[v].head_blocks,
             "attention": {"splits": runners[v].attn_scratch.splits, "block_t": runners[v].attn_block_t,
                           "num_warps": runners[v].attn_warps, "cluster": runners[v].attn_cluster, "maxnreg": runners[v].attn_maxnreg,
                           "prefetch_next": runners[v].attn_prefetch_next},
             "lane_groups": max(1, len(runners[v].groups)), "early": sorted(runners[v].early),
             "packed": sorted(runners[v].packed), "packed_blocks": runners[v].packed_blocks,
             "residual": {"kept": runners[v].residual_choice,
                          "step_us": [s * 1e6 for s in runners[v].residual_seconds]},
             "same_tokens_as_first": tokens[v] == tokens[variants[0]], "tok_s": statistics.median(t),
             "rounds": t, "pct_ceiling": 100 * statistics.median(t) / ceiling} for v, t in tok_s.items()]  # fmt: skip
    print(f"{args.model}: ceiling {ceiling:,.0f} tok/s at {bandwidth['read_gbs']:,.0f} GB/s")
    for r in rows:
        spread = ", ".join(f"{t:,.0f}" for t in r["rounds"])
        same = "same tokens" if r["same_tokens_as_first"] else "OTHER TOKENS"
        timed, kept = r["residual"]["step_us"], ""
        if timed:  # the residual's addresses timed while building, the kept one's index
            kept = (
                f"  residual {r['residual']['kept']} of {len(timed)} ({min(timed):,.1f}-{max(timed):,.1f} us)"
            )
        line = f"  {r['variant']:<40} {r['tok_s']:>8,.0f} tok/s  {r['pct_ceiling']:5.1f}%  ({spread})  {same}"
        print(line + kept)
    if args.breakdown:
        for v, r in zip(variants, rows, strict=True):
            b = r["breakdown"] = breakdown(model, runners[v], prompt, 20, bandwidth["read_gbs"])
            kinds = b.get("kinds", {})
            parts = ", ".join(f"{kind} {k['path_us']:.1f}/{k['ideal_us']:.1f}" for kind, k in kinds.items())
            print(f"  {r['variant']:<40} step {b.get('step_span_us', 0):.1f} us: {parts or b.get('error')}")
    if args.json:
        args.json.write_text(json.dumps({"model": args.model, "ceiling_tok_s": ceiling,
                                         "bandwidth": bandwidth, "rows": rows}, indent=2) + "\n")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
