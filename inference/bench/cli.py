"""Batch-1 decode on one GPU against its memory-bandwidth limit, with the peers measured in the same run.

    python -m inference.bench --model laneformer-2b [--prompt-len 512] [--new-tokens 256] [--peers]
                              [--check] [--breakdown] [--prefill-profile] [--json out.json]

In one run: the device's read bandwidth (a large reduction; a copy too), the bytes one decode step reads,
the fast runner's decode tokens/s (median of >= 5 timed runs after a warm-up, device-synchronised) with its
default settings (inference/fast/settings.py, the residual placed as the engine places it), each default turned
off in turn (the head screen, the packed weights, PDL, lane groups), and through the runner contract the engine
uses, the time to first token, and each as a % of the ceiling (bandwidth / bytes per token).
    --check      teacher-forced decode (tokens from an fp32 copy of the reference) against the bf16 reference
                 and the fp32 one, with the argmax agreement on the steps the bf16 reference can resolve
    --breakdown  time per kernel of the captured step against the bytes each kernel must read
    --prefill-profile  GPU time of one prefill by kernel
    --peers      the reference model under torch.compile (reduce-overhead) and, for HF families,
                 transformers with a static cache + torch.compile
A preset gets random weights generated on the GPU (no checkpoint on disk); a directory is loaded.
    --init peaked  the preset's shapes with synth.make_peaked's weights: logits with a trained model's margins,
                 so that the 99%-argmax rule means something (random weights give near-ties bf16 cannot order)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from unittest import mock

import torch

from common.events import SamplingParams
from inference.bench.ceiling import measure_bandwidth, step_bytes
from inference.bench.correctness import check, check_prompt
from inference.bench.model_setup import INITS, build_model, cuda_missing
from inference.bench.peers import peer_hf_static_compiled, peer_reference_compiled
from inference.bench.profiling import breakdown, prefill_profile
from inference.bench.table import table
from inference.bench.timing import (
    PAGE_SAMPLING,
    PAGE_WHOLE_HEAD_ROW,
    SAMPLED_ROW,
    same_draws,
    time_contract,
    time_fast,
)
from inference.speculative import SpeculationSettings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m inference.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a preset name or a checkpoint directory")
    parser.add_argument(
        "--init",
        choices=INITS,
        help="a preset's weights: random (init_weights, the default) or peaked (synth.make_peaked)",
    )
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument(
        "--runs", type=int, default=5, help="timed runs (after one warm-up); the median is kept"
    )
    parser.add_argument(
        "--peers",
        nargs="?",
        const="reference,hf",
        default="",
        help="peers to run: reference (torch.compile), hf (transformers); both when bare",
    )
    parser.add_argument("--check", action="store_true", help="teacher-forced check against the reference")
    parser.add_argument("--check-steps", type=int, default=512)
    parser.add_argument("--breakdown", action="store_true", help="per-kernel time against bytes")
    parser.add_argument("--no-pdl-row", action="store_true", help="skip the run without PDL")
    parser.add_argument("--prefill-profile", action="store_true", help="GPU time of one prefill by kernel")
    parser.add_argument("--json", type=Path, help="also write every number to this file")
    args = parser.parse_args(argv)
    if args.init is not None and Path(args.model).is_dir():
        parser.error(
            f"--init {args.init}: {args.model!r} is a checkpoint directory; --init applies to presets only"
        )
    if cuda_missing("bench"):
        return 2
    if args.new_tokens < 2 or args.prompt_len < 1:
        raise SystemExit("--new-tokens must be >= 2 and --prompt-len >= 1")
    from inference.fast import FastRunner
    from inference.fast.settings import RunnerSettings

    device = torch.device("cuda")
    torch.manual_seed(0)
    init = args.init or ("checkpoint" if Path(args.model).is_dir() else "random")
    result: dict = {"model": args.model, "init": init, "device": torch.cuda.get_device_name(device),
                    "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "rows": []}  # fmt: skip
    result["bandwidth"] = measure_bandwidth(device)
    model = build_model(args.model, device, torch.bfloat16, init=args.init)
    cfg = model.cfg
    max_context = min(cfg.max_position_embeddings, max(args.prompt_len + args.new_tokens + 1,
                                                       32 + args.check_steps + 2))  # fmt: skip
    if args.prompt_len + args.new_tokens > max_context:
        raise SystemExit(f"--prompt-len + --new-tokens must fit the model's {max_context} positions")
    result["bytes_per_token"] = step_bytes(model, args.prompt_len + args.new_tokens // 2)
    result["ceiling_tok_s"] = result["bandwidth"]["read_gbs"] * 1e9 / result["bytes_per_token"]
    prompt = torch.randint(
        0, cfg.vocab_size, (args.prompt_len,), generator=torch.Generator().manual_seed(0)
    ).tolist()

    def row(path: str, fn) -> dict | None:
        print(f"bench: {path} ...", file=sys.stderr, flush=True)
        try:
            out = {"path": path, **fn()}
        except Exception as e:  # one failing row must not lose the others
            out = {"path": path, "error": f"{type(e).__name__}: {e}".splitlines()[0]}
        result["rows"].append(out)
        return out

    # The engine's runner (its defaults), then the same without the head screen (every greedy step reads the whole
    # bf16 head: the like-for-like figure against the ceiling) and the other PDL setting, for comparison.
    defaults = RunnerSettings.resolve(cfg, device, torch.bfloat16)

    def switched_off(name: str) -> RunnerSettings:
        """The settings a host gets by setting the switch `name` to 0 (others follow it: the attention's splits)."""
        with mock.patch.dict(os.environ, {name: "0"}):
            return RunnerSettings.resolve(cfg, device, torch.bfloat16)

    def build(base: RunnerSettings = defaults, **changes) -> FastRunner:
        """A runner as the engine builds it (its residual placed), with `changes` to the `base` settings. Plain
        decoding: random weights fall into loops that drafts would copy (inference/bench/speculative.py measures
        speculation on a trained model)."""
        built = FastRunner(model, max_context, settings=dataclasses.replace(base, **changes),
                           speculation=SpeculationSettings(enabled=False))  # fmt: skip
        built.place_residual()
        return built

    runner = build()
    pdl = "PDL" if runner.settings.pdl else "no PDL"
    # What the runner's greedy step reads where it does not read the bf16 weights: the head's int8 screen and the
    # bounds it writes and reads (not the candidates' few bf16 rows), the packed kinds in 12 bits.
    runner_bytes = result["bytes_per_token"]
    if runner.head_screen is not None:
        head_bytes = runner.head_weight.numel() * runner.head_weight.element_size()
        runner_bytes += runner.head_screen.nbytes + 8 * cfg.vocab_size - head_bytes
    packed = runner.packed_bytes()
    if packed:
        first = model.layers[0]
        bf16_bytes = {kind: sum(w.numel() * w.element_size() for w in weights) for kind, weights in
                      (("qkv", [first.wq, first.wk, first.wv]), ("o-proj", [first.wo]),
                       ("gate/up", [first.w1, first.w3]), ("down", [first.w2]))}  # fmt: skip
        runner_bytes -= sum(bf16_bytes[kind] - n for (_, kind), n in packed.items())
    if runner.residual_seconds:  # the residual's addresses the runner timed as it was built, and its choice
        result["residual_placement"] = {"kept": runner.residual_choice,
                                        "step_us": [s * 1e6 for s in runner.residual_seconds]}  # fmt: skip
    if runner_bytes != result["bytes_per_token"]:
        result["runner_bytes_per_token"] = runner_bytes
    default = (
        f"fast, CUDA graph, {pdl}"
        + (", head screen (int8 + bf16 candidates)" if runner.head_screen is not None else "")
        + (f", {'/'.join(sorted({kind for _, kind in packed}))} in 12 bits" if packed else "")
    )
    row(default, lambda: time_fast(runner, prompt, args.new_tokens, args.runs))
    full_head = build(head_screen=False) if runner.head_screen is not None else runner
    if full_head is not runner:
        row(f"fast, CUDA graph, {pdl}, full bf16 head",
            lambda: time_fast(full_head, prompt, args.new_tokens, args.runs))  # fmt: skip
    if packed:  # the same step over the bf16 weights (lane_reduce_gemv, rmsnorm_gemv)

        def unpacked() -> dict:  # built inside the row: a failure is the row's
            return time_fast(build(switched_off("KOG_PACKED")), prompt, args.new_tokens, args.runs)

        row(f"fast, CUDA graph, {pdl}, bf16 weights (packed off)", unpacked)
    row(
        "fast, runner contract (engine path)",
        lambda: time_contract(runner, prompt, args.new_tokens, args.runs),
    )
    sampled = row(
        SAMPLED_ROW, lambda: time_contract(runner, prompt, args.new_tokens, args.runs, **PAGE_SAMPLING)
    )
    if full_head is not runner and runner.uses_screen(SamplingParams(**PAGE_SAMPLING)):
        row(PAGE_WHOLE_HEAD_ROW,
            lambda: time_contract(full_head, prompt, args.new_tokens, args.runs, **PAGE_SAMPLING))  # fmt: skip
        if "tok_s" in sampled:  # the screened draws against the whole head's, seed by seed
            sampled["same_tokens_as_full_head"] = same_draws(runner, full_head, prompt, args.new_tokens)
    if not args.no_pdl_row and runner.settings.pdl:  # PDL needs a Hopper GPU: the row without it
        row("fast, CUDA graph, no PDL",
            lambda: time_fast(build(pdl=False), prompt, args.new_tokens, args.runs))  # fmt: skip
    # With lane groups (two streams) kernels overlap, so the per-kernel breakdown is of the one-stream step.
    one_stream = build(switched_off("KOG_LANE_GROUPS")) if runner.groups else runner
    if runner.groups:
        row("fast, CUDA graph, one stream (no lane groups)",
            lambda: time_fast(one_stream, prompt, args.new_tokens, args.runs))  # fmt: skip
    if args.breakdown and runner is not None:
        try:
            result["breakdown"] = breakdown(model, one_stream, prompt, 20, result["bandwidth"]["read_gbs"])
            result["breakdown"]["one_stream"] = one_stream is not runner
        except Exception as e:
            result["breakdown"] = {"error": f"{type(e).__name__}: {e}"}
    if args.prefill_profile:
        try:
            result["prefill_profile"] = prefill_profile(runner, prompt)
        except Exception as e:
            result["prefill_profile"] = {"error": f"{type(e).__name__}: {e}"}
    if args.check and runner is not None:
        try:
            prompt_ids = check_prompt(args.model, cfg.vocab_size)
            screened = runner if runner is not full_head else None
            result["check"] = check(model, full_head, args.check_steps, prompt_ids, init, screened)
        except Exception as e:
            result["check"] = {"error": f"{type(e).__name__}: {e}"}
    peers = set(filter(None, args.peers.split(",")))
    if "reference" in peers:
        row("reference + torch.compile (reduce-overhead)",
            lambda: peer_reference_compiled(model, prompt, args.new_tokens, args.runs))  # fmt: skip
    if "hf" in peers and cfg.model_type in ("llama", "qwen2", "qwen3") and not Path(args.model).is_dir():
        hf = row("HF transformers, static cache + compile (reduce-overhead)",
                 lambda: peer_hf_static_compiled(args.model, prompt, args.new_tokens, args.runs))  # fmt: skip
        if "error" in hf:  # its CUDA graphs break on the cache's in-place counters: compile without them
            torch._dynamo.reset()
            row("HF transformers, static cache + compile (default mode)",
                lambda: peer_hf_static_compiled(args.model, prompt, args.new_tokens, args.runs, "default"))  # fmt: skip

    print(table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0
