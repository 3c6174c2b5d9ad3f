"""Chrome traces of a few decode-step replays and of one prefill (GPU only), for reading offline: which
kernel of which stream runs when, and what the host does before the prefill's first kernel.

    python scripts/step_trace.py --model laneformer-2b --out /tmp/trace [--prompt-len 512] [--replays 6]
        [--prefill-len 4094] [--variant lanes.groups=1]

Writes MODEL.decode.json.gz, MODEL.prefill.json.gz (torch.profiler's Chrome trace: kernels carry their
stream in args.stream) and prints, per stream, the step's kernels with their start and end in microseconds
from the step's first kernel. Timings under the profiler (CUPTI) are a little slower than untraced; the
benchmark's figures come from inference.bench, not from here.
"""

import argparse
import gzip
import json
import shutil
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

import torch  # noqa: E402
from decode_variants import runner_kwargs  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from inference.bench.model_setup import build_model, cuda_missing  # noqa: E402
from inference.bench.profiling import profiled_prefill  # noqa: E402
from inference.fast.runner import FastRunner  # noqa: E402


def export(prof, path: Path) -> None:
    """The trace written gzipped to path."""
    raw = path.with_suffix("")
    prof.export_chrome_trace(str(raw))
    with raw.open("rb") as src, gzip.open(path, "wb") as dst:
        shutil.copyfileobj(src, dst)
    raw.unlink()


def kernel_events(path: Path) -> list[dict]:
    """The GPU kernel events of a trace written by export."""
    with gzip.open(path, "rt") as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("cat") == "kernel"]


def print_step(kernels: list[dict], replay: int, per_step: int) -> None:
    """One replay's kernels by stream: offset and end (us) from the replay's first kernel."""
    step = sorted(kernels, key=lambda e: e["ts"])[replay * per_step : (replay + 1) * per_step]
    t0 = step[0]["ts"]
    end = max(e["ts"] + e["dur"] for e in step)
    print(f"replay {replay}: {len(step)} kernels, {end - t0:.1f} us first start to last end")
    for e in step:
        name = e["name"].removeprefix("_").removesuffix("_kernel")[:28]
        start = e["ts"] - t0
        print(f"  s{e['args'].get('stream', '?'):<3} {name:<28} {start:9.1f} {start + e['dur']:9.1f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--replays", type=int, default=6)
    parser.add_argument("--prefill-len", type=int, default=0, help="also trace one prefill of this length")
    parser.add_argument("--variant", default="", help="runner settings, as scripts/decode_variants.py takes")
    args = parser.parse_args()
    if cuda_missing("step_trace"):
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    model = build_model(args.model, device, torch.bfloat16)
    context = max(args.prompt_len, args.prefill_len) + args.replays + 2
    runner = FastRunner(model, min(context, model.cfg.max_position_embeddings), **runner_kwargs(args.variant))
    prompt = torch.randint(
        0, model.cfg.vocab_size, (args.prompt_len,), generator=torch.Generator().manual_seed(0)
    )
    graph = runner.capture(greedy=True)
    runner.prefill(prompt.tolist())
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.replays):
            graph.replay()
        torch.cuda.synchronize()
    decode_trace = args.out / f"{args.model}.decode.json.gz"
    export(prof, decode_trace)
    kernels = kernel_events(decode_trace)
    per_step = len(kernels) // args.replays
    print_step(kernels, args.replays // 2, per_step)

    if args.prefill_len:
        long_prompt = torch.randint(0, model.cfg.vocab_size, (args.prefill_len,),
                                    generator=torch.Generator().manual_seed(1)).tolist()  # fmt: skip
        export(profiled_prefill(runner, long_prompt), args.out / f"{args.model}.prefill.json.gz")
    return 0


if __name__ == "__main__":
    sys.exit(main())
