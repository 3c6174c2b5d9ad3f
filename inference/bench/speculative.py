"""What speculative decoding gives a user: the workload's prompts decoded plain and with drafts, and the cost
of a verify step.

    python -m inference.bench.speculative [--model models/default] [--device cpu|cuda] [--max-tokens 128]
        [--curve laneformer-2b,qwen3-1.7b,qwen2.5-coder-1.5b] [--context 512] [--json out.json]
    python -m inference.bench.speculative --verify-curve [--json out.json]    (the GPU table, one command)

Part one, per workload prompt (inference/bench/workload.py), greedy: decode tok/s plain and with drafts (the
engine's figure, generated tokens over decode time), tokens per step, the drafts kept, then with the plain reply's
text as the request's prediction (OpenAI's Predicted Outputs: a perfect prediction, the most it can give), and
whether the outputs are the same tokens (they must be). The runner is the engine's: on a GPU the fast runner (--backend
reference times the reference runner instead).
--verify-curve (GPU only: it refuses without one) is part one on the fast runner, then per 2B-class preset
(VERIFY_PRESETS, random bf16 weights) the fast runner's verify step over k+1 positions (FastRunner.verify_greedy,
as generate_tokens runs it) against its one-position decode step (the greedy CUDA graph), k = 1..16, each the
median of device-timed repeats from a --context-token cache, with the decode tok/s implied at part one's
acceptance (the formula below).
Part two, per shape named in --curve (a preset or a checkpoint folder; random bf16 weights on the device; fp32 on the CPU): the time of one
model step over k+1 positions from a --context-token cache over the one-position step, k = 0..16 (each step a
CUDA graph on a GPU: launch overhead is not what is measured), and the decode tok/s this implies at the
acceptance part one measured: a draft of k tokens each kept with probability a yields (1 - a^(k+1)) / (1 - a)
tokens per step (drafts kept independently, an approximation), so tok/s = plain tok/s * tokens / cost.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch

from common.events import SamplingParams, TextDelta
from inference.bench.workload import WORKLOAD
from inference.config import ModelConfig
from inference.model import KVCache, Transformer
from inference.presets import preset_config
from inference.speculative import SpeculationSettings

CURVE_K = range(0, 17)
VERIFY_K = range(1, 17)
VERIFY_PRESETS = ("laneformer-2b", "llama-3.2-1b", "qwen3-1.7b")


def run_workload(model: str, device: str, max_tokens: int, repeats: int) -> list[dict]:
    from inference.engine import Engine

    engine = Engine.load(model, device=device)
    runner = engine.runner
    speculates = hasattr(runner, "speculation")
    params = SamplingParams(max_new_tokens=max_tokens, temperature=0)
    # warm-up: first-call allocations, kernels, graphs
    list(engine.generate(engine.encode_prompt(WORKLOAD[0].text), params))
    rows = []
    for prompt in WORKLOAD:
        ids = engine.encode_prompt(prompt.text)
        row = {
            "prompt": prompt.name,
            "kind": prompt.kind,
            "prompt_tokens": len(ids),
            "runner": type(runner).__name__,
        }
        modes = ("plain", "speculative", "predicted")
        outputs, best, reply = {}, dict.fromkeys(modes, 0.0), ""
        for _ in range(repeats):  # the modes alternate; each keeps its fastest run (a shared machine's noise)
            for mode in modes:
                if speculates:
                    runner.speculation = SpeculationSettings(enabled=mode != "plain")
                events = list(
                    engine.generate(ids, replace(params, prediction=reply if mode == "predicted" else ""))
                )
                stats = events[-1].stats
                outputs[mode] = [t for e in events if isinstance(e, TextDelta) for t in e.token_ids]
                best[mode] = max(best[mode], stats.decode_tok_s)
                reply = events[-1].text if mode == "plain" else reply
                if mode != "plain":
                    prefix = "" if mode == "speculative" else "predicted_"
                    row.update({f"{prefix}steps": stats.decode_steps, f"{prefix}draft_n": stats.draft_n,
                                f"{prefix}draft_n_accepted": stats.draft_n_accepted})  # fmt: skip
                    row["tokens"] = stats.completion_tokens
        row.update({f"{mode}_tok_s": round(best[mode], 1) for mode in modes})
        row["identical"] = outputs["plain"] == outputs["speculative"] == outputs["predicted"]
        for mode, key in (("speculative", "speedup"), ("predicted", "predicted_speedup")):
            row[key] = round(row[f"{mode}_tok_s"] / row["plain_tok_s"], 2) if row["plain_tok_s"] else 0.0
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def acceptance(rows: list[dict]) -> float:
    drafted = sum(r["draft_n"] for r in rows)
    return sum(r["draft_n_accepted"] for r in rows) / drafted if drafted else 0.0


class StepTimer:
    """One forward over T new positions after `context` cached ones, timed: a CUDA graph per T on a GPU (10
    replays between two events), the eager call on the CPU."""

    def __init__(self, model: Transformer, cache: KVCache, context: int, device: torch.device):
        self.model, self.cache, self.context, self.device = model, cache, context, device
        self.graphs: dict[int, torch.cuda.CUDAGraph | None] = {}
        self.inputs: dict[int, torch.Tensor] = {}

    def _step(self, positions: int) -> None:
        if positions not in self.inputs:
            self.inputs[positions] = torch.randint(
                0, self.model.cfg.vocab_size, (1, positions), device=self.device
            )
        self.model(self.inputs[positions], self.context, self.cache)

    def seconds(self, positions: int) -> float:
        if self.device.type != "cuda":
            start = time.perf_counter()
            self._step(positions)
            return time.perf_counter() - start
        if positions not in self.graphs:
            self._step(positions)  # warm-up outside the capture (cuBLAS handles, workspaces)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph):
                    self._step(positions)
            except RuntimeError as e:  # timed eagerly then (launches included), and said so
                print(json.dumps({"note": f"no CUDA graph for {positions} positions: {e}"[:300]}), flush=True)
                graph = None
            self.graphs[positions] = graph
        graph = self.graphs[positions]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            if graph is not None:
                graph.replay()
            else:
                self._step(positions)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 10 / 1e3

    def cost(self, positions: int, rounds: int = 15) -> tuple[float, float]:
        """(the one-position step's seconds, this step's time over it): the two alternate, each keeping its
        fastest round (a shared machine's other work only ever adds time)."""
        self.seconds(1), self.seconds(positions)  # warm-up, captures
        ones, these = [], []
        for _ in range(rounds):
            ones.append(self.seconds(1))
            these.append(self.seconds(positions))
        return min(ones), min(these) / min(ones)


@torch.inference_mode()
def verify_curve(shape: str, device: torch.device, context: int, accept: float) -> dict:
    folder = Path(shape) / "config.json"  # a checkpoint folder's shape, or a preset's
    cfg = ModelConfig.from_hf(json.loads(folder.read_text()) if folder.is_file() else preset_config(shape))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = Transformer(cfg, device=device, dtype=dtype)
    model.init_weights(generator=torch.Generator(device=device).manual_seed(0))
    model.eval().requires_grad_(False)
    if device.type == "cpu":  # the threads the engine would give this model (engine.SMALL_MODEL_BYTES)
        from inference.engine import SMALL_MODEL_BYTES

        size = sum(p.numel() * p.element_size() for p in model.parameters())
        torch.set_num_threads(1 if size < SMALL_MODEL_BYTES else os.cpu_count())
    cache = KVCache(cfg, context + max(CURVE_K) + 1, 1, device, dtype)
    model(torch.randint(0, cfg.vocab_size, (1, context), device=device), 0, cache, last_only=True)
    timer = StepTimer(model, cache, context, device)
    curve, ones = [], []
    for k in CURVE_K:
        one, cost = timer.cost(k + 1) if k else (timer.cost(1)[0], 1.0)
        ones.append(one)
        tokens = (1 - accept ** (k + 1)) / (1 - accept) if accept < 1 else k + 1.0
        curve.append(
            {"k": k, "cost": round(cost, 3), "tokens_per_step": round(tokens, 2), "tok_s": tokens / cost}
        )
    one = min(ones)
    for point in curve:  # plain tok/s * tokens per step / cost
        point["tok_s"] = round(point["tok_s"] / one, 1)
    best = max(curve, key=lambda c: c["tok_s"])
    del model, cache, timer
    return {"shape": shape, "device": device.type, "context": context, "one_step_ms": round(one * 1e3, 3),
            "acceptance": round(accept, 3), "best_k": best["k"], "curve": curve}  # fmt: skip


def tokens_per_step(accept: float, k: int) -> float:
    """Tokens a draft of k yields when each is kept with probability `accept` (independently, an approximation)."""
    return (1 - accept ** (k + 1)) / (1 - accept) if accept < 1 else k + 1.0


@torch.no_grad()
def fast_verify_curve(preset: str, context: int, accept: float, repeats: int) -> dict:
    """The fast runner's verify step over k+1 positions over its plain decode step, k in VERIFY_K, on `preset`
    with random bf16 weights, after a `context`-token prefill. Device-timed (CUDA events), medians of `repeats`;
    the verify step is the greedy one generate_tokens runs (its graph, the drafts kept on the device), also
    timed host to host (verify_wall_ms: the host's wait included; tok_s_wall the tok/s that implies)."""
    from inference.bench.model_setup import build_model
    from inference.bench.timing import median_ms
    from inference.fast.runner import FastRunner

    device = torch.device("cuda")
    model = build_model(preset, device, torch.bfloat16)
    runner = FastRunner(model, context + max(VERIFY_K) + 64)
    runner.place_residual()  # as the engine builds it
    prompt = torch.randint(3, model.cfg.vocab_size, (context,), generator=torch.Generator().manual_seed(0))
    runner.prefill(prompt.tolist())
    graph = runner.capture(greedy=True)
    steps = 10  # plain steps back to back, as decoding queues them

    def plain() -> None:
        for _ in range(steps):
            graph.replay()

    def verify(draft: list[int]) -> None:  # from the same position each time: its cost, not the text
        runner.verify_greedy(context, draft)

    def wall_ms(draft: list[int]) -> float:  # host to host, as generate_tokens waits for it
        verify(draft)
        times = []
        for _ in range(repeats):
            began = time.perf_counter()
            verify(draft)
            times.append((time.perf_counter() - began) * 1e3)
        return statistics.median(times)

    times = []
    # the replays move the position on: every repeat starts from the prompt's end
    with runner.step_state_kept():
        for _ in range(repeats):
            runner.pos.fill_(context)
            times.append(median_ms(plain, repeats=1) / steps)
    plain_ms = statistics.median(times)
    curve = []
    for k in VERIFY_K:
        draft = torch.randint(3, model.cfg.vocab_size, (k,)).tolist()
        ms, wall = median_ms(partial(verify, draft), repeats), wall_ms(draft)
        cost, tokens = ms / plain_ms, tokens_per_step(accept, k)
        curve.append({"k": k, "verify_ms": round(ms, 3), "verify_wall_ms": round(wall, 3), "cost": round(cost, 3),
                      "tokens_per_step": round(tokens, 2), "tok_s": round(tokens / cost * 1e3 / plain_ms, 1),
                      "tok_s_wall": round(tokens / wall * 1e3, 1)})  # fmt: skip
    best = max(curve, key=lambda c: c["tok_s"])
    return {"preset": preset, "runner": "fast", "context": context, "plain_step_ms": round(plain_ms, 4),
            "plain_tok_s": round(1e3 / plain_ms, 1), "acceptance": round(accept, 3), "best_k": best["k"],
            "best_tok_s": best["tok_s"], "curve": curve}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    from common.names import default_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=default_model())
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument(
        "--repeats", type=int, default=3, help="runs of each prompt in each mode; the fastest counts"
    )
    parser.add_argument(
        "--backend", choices=("", "reference", "fast"), default="", help="KOG_BACKEND for part one"
    )
    parser.add_argument("--curve", default="", help="comma-separated presets for part two (empty: skip it)")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--acceptance", type=float, default=None, help="for part two; default: part one's")
    parser.add_argument("--json", default="", help="write the results here too")
    parser.add_argument("--no-workload", action="store_true", help="part two alone (give --acceptance)")
    parser.add_argument(
        "--verify-curve",
        nargs="?",
        const=",".join(VERIFY_PRESETS),
        default="",
        help="GPU: part one on the fast runner, then the fast runner's verify-step curve on these presets "
        f"(default {','.join(VERIFY_PRESETS)})",
    )
    parser.add_argument("--verify-repeats", type=int, default=20, help="device-timed repeats per point")
    args = parser.parse_args(argv)
    if args.verify_curve:
        from inference.bench.model_setup import cuda_missing

        if cuda_missing("inference.bench.speculative --verify-curve"):
            raise SystemExit(2)
        args.device, args.backend = "cuda", args.backend or "fast"
    if args.backend:
        os.environ["KOG_BACKEND"] = args.backend
    if args.no_workload and args.acceptance is None:
        parser.error("--no-workload needs --acceptance")
    rows = [] if args.no_workload else run_workload(args.model, args.device, args.max_tokens, args.repeats)
    accept = acceptance(rows) if args.acceptance is None else args.acceptance
    summary = {}
    if rows:
        summary = {
            "acceptance": round(acceptance(rows), 3),
            "edit_acceptance": round(acceptance([r for r in rows if r["kind"] == "edit"]), 3),
            "all_identical": all(r["identical"] for r in rows),
            # the bars: edits >= 2x plain (median over the set), free generation within 3% of plain
            "edit_speedup_median": statistics.median(r["speedup"] for r in rows if r["kind"] == "edit"),
            "free_speedup_median": statistics.median(r["speedup"] for r in rows if r["kind"] == "free"),
            # the plain reply as the request's prediction
            "predicted_edit_speedup_median": statistics.median(
                r["predicted_speedup"] for r in rows if r["kind"] == "edit"
            ),
        }
        print(json.dumps(summary), flush=True)
    curves = []
    for shape in filter(None, args.curve.split(",")):
        curves.append(verify_curve(shape.strip(), torch.device(args.device), args.context, accept))
        print(json.dumps(curves[-1]), flush=True)
    verify = []
    for preset in filter(None, args.verify_curve.split(",")):
        verify.append(fast_verify_curve(preset.strip(), args.context, accept, args.verify_repeats))
        torch.cuda.empty_cache()  # the preset's runner is gone: its memory goes back before the next one's
        print(json.dumps(verify[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"workload": rows, "summary": summary, "curves": curves, "verify": verify}, f, indent=1)


if __name__ == "__main__":
    main()
