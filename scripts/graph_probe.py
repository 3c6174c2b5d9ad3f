"""What the boundary between two CUDA graph replays costs a decode step: the same decode steps timed as one
graph per step and as graphs of several steps each (the kernels of consecutive steps then meet through
programmatic dependent launch, as within a step).

    python scripts/graph_probe.py --model llama-3.2-1b --steps-per-graph 1,2,4
"""

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from inference.bench.model_setup import build_model, cuda_missing  # noqa: E402
from inference.fast.runner import FastRunner  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-3.2-1b")
    parser.add_argument("--steps-per-graph", default="1,2,4")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    if cuda_missing("graph_probe"):
        return 2
    model = build_model(args.model, torch.device("cuda"), torch.bfloat16)
    runner = FastRunner(model, args.prompt_len + args.new_tokens + 8)
    prompt = torch.randint(0, model.cfg.vocab_size, (args.prompt_len,),
                           generator=torch.Generator().manual_seed(0)).tolist()  # fmt: skip
    graphs = {n: runner.capture(True, steps=n) for n in map(int, args.steps_per_graph.split(","))}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for n, graph in graphs.items():
        replays = args.new_tokens // n
        times = []
        for _ in range(args.runs + 1):
            runner.prefill(prompt)
            torch.cuda.synchronize()
            start.record()
            for _ in range(replays):
                graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / (replays * n))
        us = statistics.median(times[1:])
        print(f"{args.model}: {n} step(s) a graph: {us:.1f} us a step, {1e6 / us:,.0f} tok/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
