"""Batch-1 decode on one GPU against its memory-bandwidth limit, with the peers measured in the same run.

    python -m inference.bench --model laneformer-2b [--prompt-len 512] [--new-tokens 256] [--peers]
                              [--check] [--breakdown] [--sweep] [--prefill-profile] [--json out.json]

In one run: the device's read bandwidth (a large reduction; a copy too), the bytes one decode step reads,
the fast runner's decode tokens/s (median of >= 5 timed runs after a warm-up, device-synchronised) with and
without programmatic dependent launch and through the runner contract the engine uses, the time to first
token, and each as a % of the ceiling (bandwidth / bytes per token).
    --check      teacher-forced decode (tokens from an fp32 copy of the reference) against the bf16 reference
                 and the fp32 one, with the argmax agreement on the steps the bf16 reference can resolve
    --breakdown  time per kernel of the captured step against the bytes each kernel must read
    --sweep      block variants of the matrix-vector kernels, the head and attention
    --prefill-profile  GPU time of one prefill by kernel
    --peers      the reference model under torch.compile (reduce-overhead) and, for HF families,
                 transformers with a static cache + torch.compile
A preset gets random weights generated on the GPU (no checkpoint on disk); a directory is loaded.
    --init peaked  the preset's shapes with synth.make_peaked's weights: logits with a trained model's margins,
                 so that the 99%-argmax rule means something (random weights give near-ties bf16 cannot order)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from inference.checkpoint import load_weights
from inference.config import ModelConfig
from inference.events import SamplingParams, decode_tok_s
from inference.model import KVCache, Transformer
from inference.presets import PRESETS, preset_config
from inference.synth import make_peaked

KERNELS_PER_LAYER = ("qkv", "attention", "o-proj", "gate/up", "down")


INITS = ("random", "peaked")


def build_model(
    name: str, device: torch.device, dtype: torch.dtype, seed: int = 0, init: str | None = None
) -> Transformer:
    """A checkpoint directory, loaded; or a preset with `init` weights (default random): init_weights', or those
    turned into synth.make_peaked's model by the same generator."""
    path = Path(name)
    if path.is_dir():
        if init is not None:
            raise SystemExit(
                f"--init {init}: {name!r} is a checkpoint directory; --init applies to presets only"
            )
        cfg = ModelConfig.from_hf(path)
        return Transformer.from_weights(cfg, load_weights(path, cfg, device, dtype))
    if name not in PRESETS:
        raise SystemExit(
            f"--model: {name!r} is neither a checkpoint directory nor a preset ({', '.join(PRESETS)})"
        )
    if init not in (None, *INITS):
        raise SystemExit(f"--init: {init!r} is not one of {', '.join(INITS)}")
    cfg = ModelConfig.from_hf(preset_config(name))
    model = Transformer(cfg, device=device, dtype=dtype)
    generator = torch.Generator(device).manual_seed(seed)
    model.init_weights(generator=generator)
    if init == "peaked":
        make_peaked(model, generator)
    return model.eval()


def cuda_missing(tool: str) -> bool:
    """True, after saying so on stderr, when there is no CUDA GPU: the GPU tools' common refusal (exit 2)."""
    if torch.cuda.is_available():
        return False
    print(f"{tool}: needs a CUDA GPU", file=sys.stderr)
    return True


def median_ms(fn, repeats: int = 10, before=None) -> float:
    """Median milliseconds of fn() on the device, after one warm-up call. With `before`, each repeat first runs
    before() untimed (a cache flush, say), synchronizes, and keeps the GPU busy for ~1 ms while the launches are
    queued, so that the host's launch time of a single short kernel is not counted."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
            torch.cuda.synchronize()
            torch.cuda._sleep(2_000_000)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure_bandwidth(device: torch.device, gib: int = 4) -> dict:
    """Read bandwidth of a large reduction (bytes read) and of a copy (bytes read + written), GB/s."""
    src = torch.empty(gib * 2**30 // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    result = {
        "read_gbs": src.numel() * 4 / median_ms(src.sum) / 1e6,
        "copy_gbs": 2 * src.numel() * 4 / median_ms(lambda: dst.copy_(src)) / 1e6,
    }
    src = dst = None
    torch.cuda.empty_cache()
    return result


def kernel_bytes(
    cfg: ModelConfig, itemsize: int, context: int, head_screen: bool = False
) -> list[tuple[str, int]]:
    """(kind, bytes it must read) for every kernel of one decode step, in launch order; `context` cached keys.
    With head_screen the head is kernels/lm_head_screen.py's two launches: the int8 copy with a scale and two norms
    a row, then the rows' upper bounds (the candidates' bf16 rows, a few, are not counted)."""
    D, hd, L = cfg.hidden_size, cfg.head_dim, cfg.num_lanes
    qkv_rows = (cfg.num_heads + 2 * cfg.num_kv_heads) * hd
    out = []
    for i in range(cfg.num_layers):
        keys = min(context + 1, cfg.window(i) or context + 1)
        out += [
            ("qkv", (qkv_rows * D + L * D + (qkv_rows if cfg.qkv_bias else 0)) * itemsize),
            ("attention", 2 * cfg.num_kv_heads * hd * keys * itemsize),
            ("o-proj", D * cfg.num_heads * hd * itemsize),
            ("gate/up", (2 * cfg.intermediate_size * D + L * D) * itemsize),
            ("down", D * cfg.intermediate_size * itemsize),
        ]
    if L > 1:
        out.append(("final norm", L * D * itemsize))
    if head_screen:
        out += [("head screen", cfg.vocab_size * (D + 12)), ("head rescore", cfg.vocab_size * 4)]
    else:
        out.append(("head", cfg.vocab_size * D * itemsize))
    return out


def step_bytes(model: Transformer, context: int) -> int:
    """Bytes one decode step reads: every weight once (the embedding only one row unless it is the head), plus
    the keys and values in each layer's window."""
    cfg, item = model.cfg, model.tok_embeddings.element_size()
    weights = sum(p.numel() for n, p in model.named_parameters() if n != "tok_embeddings") * item
    embedding = (cfg.vocab_size if model.lm_head is None else 1) * cfg.hidden_size * item
    kv = sum(b for kind, b in kernel_bytes(cfg, item, context) if kind == "attention")
    return weights + embedding + kv


# --- the fast path ---------------------------------------------------------------------------------------


def time_fast(runner, prompt: list[int], new_tokens: int, runs: int) -> dict:
    """Prefill, then new_tokens - 1 back-to-back graph replays; medians over `runs` after one warm-up."""
    graph = runner.capture(greedy=True)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def one() -> tuple[float, float]:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        runner.prefill(prompt)
        int(runner.token.item())
        ttft = (time.perf_counter() - t0) * 1e3
        start.record()
        for _ in range(new_tokens - 1):
            graph.replay()
        end.record()
        end.synchronize()
        return ttft, (new_tokens - 1) / (start.elapsed_time(end) / 1e3)

    one()
    results = [one() for _ in range(runs)]
    return {"ttft_ms": statistics.median(r[0] for r in results), "tok_s": statistics.median(r[1] for r in results),
            "tok_s_runs": [r[1] for r in results]}  # fmt: skip


# The playground page's default sampling settings (playground/views.py FORM_DEFAULTS), and the row
# that times them (scripts/gpu_check.sh finds it by SAMPLED_ROW_PREFIX).
PAGE_SAMPLING = {"temperature": 0.2, "top_p": 0.95}
SAMPLED_ROW_PREFIX = "fast, runner contract, sampled"
SAMPLED_ROW = (f"{SAMPLED_ROW_PREFIX} (temperature {PAGE_SAMPLING['temperature']}, top-p {PAGE_SAMPLING['top_p']}: "
               "the page's defaults)")  # fmt: skip


# The page's settings with the whole bf16 head, beside SAMPLED_ROW when that one reads the head through its screen.
PAGE_WHOLE_HEAD_ROW = "fast, runner contract, page sampling, full bf16 head"


def same_draws(runner, full_head, prompt: list[int], new_tokens: int, seeds: int = 4) -> float:
    """The share of tokens the runner draws under the page's settings that the whole-head runner draws too, over
    `seeds` requests of new_tokens each: up to the first difference of each (a difference changes the rest)."""
    same = 0
    for seed in range(seeds):
        params = SamplingParams(max_new_tokens=new_tokens, seed=seed, **PAGE_SAMPLING)
        pairs = zip(
            runner.generate_tokens(prompt, params), full_head.generate_tokens(prompt, params), strict=True
        )
        same += next((i for i, (a, b) in enumerate(pairs) if a != b), new_tokens)
    return same / (seeds * new_tokens)


def time_contract(runner, prompt: list[int], new_tokens: int, runs: int, **sampling) -> dict:
    """The engine's view: generate_tokens with its pinned-memory hand-off, decode tok/s from token times;
    greedy unless `sampling` gives SamplingParams' knobs."""
    params = SamplingParams(max_new_tokens=new_tokens, **sampling)

    def one() -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        times = []
        for _ in runner.generate_tokens(prompt, params):
            times.append(time.perf_counter() - t0)
        return decode_tok_s(times)

    one()
    before = runner.sample_scratch.path_counts()
    result = {"tok_s": statistics.median(one() for _ in range(runs))}
    # which of kernels/sample.py's paths the timed steps took (none for greedy ones)
    after = runner.sample_scratch.path_counts()
    paths = {path: n - before[path] for path, n in after.items() if n > before[path]}
    if paths:
        result["sample_paths"] = paths
    if runner.screen_left_at is not None:  # the last request's flat logits sent it to the whole head
        result["left_screen_after"] = runner.screen_left_at - len(prompt)
    return result


def skip_path_logits(model: Transformer, token: torch.Tensor) -> torch.Tensor:
    """The head applied to the current token's embedding alone, as if no layer had added anything: what the
    residual stream's skip path votes for. [V] fp32."""
    cfg = model.cfg
    x = model.tok_embeddings[token.view(1)].view(1, 1, cfg.hidden_size).expand(cfg.num_lanes, 1, -1)
    return model._head(x).view(-1).float()


def logit_shape(margins: list[float], top_shares: list[float], skip_agree: int) -> dict:
    """How peaked the check's fp32 logits were: the top1 - top2 margin (median, 10th percentile), the top logit's
    share of the squared norm (median: a large share would let one logit hide the others' error in the relative
    error), and the share of steps at which the skip path alone already picks the argmax."""
    m = torch.tensor(margins, dtype=torch.float64)
    return {
        "fp32_margin_median": m.median().item(),
        "fp32_margin_p10": m.quantile(0.1).item(),
        "skip_path_argmax_agree": skip_agree / len(margins),
        "top_logit_norm_share_median": statistics.median(top_shares),
    }


@torch.no_grad()
def check(model: Transformer, runner, steps: int, prompt: list[int], init: str = "random",
          screened=None) -> dict:  # fmt: skip
    """Teacher-forced: the fast path and the bf16 reference take the same tokens (the fp32 reference's greedy
    choices) and their logits are compared at every step with two yardsticks:
      * bf16: the reference model in bf16 (the issue's criterion: rel err <= 2e-2, same argmax >= 99%);
      * fp32: an fp32 copy of the same (bf16-rounded) weights, the exact function both approximate.
    With random weights the logits are flat: the top two often differ by less than bf16 rounding, so even the
    bf16 reference disagrees with fp32 at a few % of steps. `decisive` counts only the steps whose fp32 top-two
    margin exceeds the bf16 reference's own largest logit error there (independent of the fast path).
    The fp32 logits' shape (margins, the top logit's share of their norm, how often the skip path alone picks the
    argmax) says whether the argmax rule could be met at all (`init`: how the weights were made)."""
    cfg, device = model.cfg, model.tok_embeddings.device
    model32 = Transformer(cfg, device=device, dtype=torch.float32)
    model32.load_state_dict({k: v.float() for k, v in model.state_dict().items()}, strict=False)
    model32.eval()
    prompt_len = len(prompt)
    prompt = torch.tensor([prompt], device=device)
    length = prompt_len + steps + 1
    cache, cache32 = (
        KVCache(cfg, length, 1, device, model.tok_embeddings.dtype),
        KVCache(cfg, length, 1, device),
    )
    model(prompt, 0, cache, last_only=True)
    ref32 = model32(prompt, 0, cache32, last_only=True).view(-1)
    runner.prefill(prompt[0].tolist())
    if screened is not None:
        screened.prefill(prompt[0].tolist())

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a - b).norm() / b.norm()).item()

    errs, errs32, ref_errs32, margins, top_shares = [], [], [], [], []
    same = same32 = ref_same32 = decisive = decisive_same32 = skip_same32 = screen_same = 0
    for pos in range(prompt_len, prompt_len + steps):
        token = ref32.argmax().view(1, 1)
        runner.token.copy_(token.view(1))
        runner.step()
        if screened is not None:  # the head screen's token against the full head's argmax, same input
            screened.token.copy_(token.view(1))
            screened.step()
            screen_same += int(int(screened.token) == int(runner.logits[: runner.vocab_limit].argmax()))
        ref = model(token, pos, cache).view(-1).float()
        ref32 = model32(token, pos, cache32).view(-1)
        fast = runner.logits.float()
        errs.append(rel(fast, ref))
        errs32.append(rel(fast, ref32))
        ref_errs32.append(rel(ref, ref32))
        best = ref32.argmax()
        same += int(fast.argmax() == ref.argmax())
        same32 += int(fast.argmax() == best)
        ref_same32 += int(ref.argmax() == best)
        top2 = ref32.topk(2).values
        margins.append((top2[0] - top2[1]).item())
        if margins[-1] > (ref - ref32).abs().max().item():
            decisive += 1
            decisive_same32 += int(fast.argmax() == best)
        top_shares.append((top2[0] ** 2 / ref32.pow(2).sum()).item())
        skip_same32 += int(skip_path_logits(model32, token).argmax() == best)
    del model32, cache32
    torch.cuda.empty_cache()
    return {
        "steps": steps,
        "max_rel_err": max(errs),
        "mean_rel_err": statistics.mean(errs),
        "argmax_agree": same / steps,
        "fp32_max_rel_err": max(errs32),
        "fp32_mean_rel_err": statistics.mean(errs32),
        "fp32_argmax_agree": same32 / steps,
        "reference_vs_fp32_max_rel_err": max(ref_errs32),
        "reference_vs_fp32_argmax_agree": ref_same32 / steps,
        "decisive_steps": decisive,
        "decisive_fp32_argmax_agree": decisive_same32 / decisive if decisive else None,
        "passed": max(errs) <= 2e-2 and same / steps >= 0.99,
        "passed_fp32": max(errs32) <= 2e-2 and same32 / steps >= 0.99,
        "init": init,
        "screen_same_token": screen_same / steps if screened is not None else None,
        **logit_shape(margins, top_shares, skip_same32),
    }


CHECK_TEXT = (
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n    a, b = 0, 1\n    for _ in range('
)


def check_prompt(name: str, vocab_size: int, length: int = 32) -> list[int]:
    """Code text through the checkpoint's tokenizer when it has one (a trained model then sees text it knows),
    else random ids."""
    path = Path(name)
    if (path / "tokenizer.json").is_file():
        from inference.tokenizer import Tokenizer

        return Tokenizer.from_dir(path).encode(CHECK_TEXT)[:length]
    return torch.randint(0, vocab_size, (length,), generator=torch.Generator().manual_seed(1)).tolist()


def breakdown(model: Transformer, runner, prompt: list[int], replays: int, read_gbs: float) -> dict:
    """Per kind of kernel: time on the step's critical path (end to end of consecutive kernels, so PDL
    overlap is not counted twice) and the bytes it must read."""
    from torch.profiler import ProfilerActivity, profile

    cfg = model.cfg
    graph = runner.capture(greedy=True)
    runner.prefill(prompt)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    kernels = sorted(
        (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and "_kernel" in e.name),
        key=lambda e: e.time_range.start,
    )
    expected = kernel_bytes(cfg, model.tok_embeddings.element_size(), len(prompt) + replays // 2,
                            runner.head_screen is not None)  # fmt: skip
    per_step = len(expected)
    if len(kernels) < per_step * replays:
        return {"error": f"profiler saw {len(kernels)} kernels, expected {per_step * replays}"}
    kinds: dict[str, dict] = {}
    step_spans = []
    for s in range(replays):
        step = kernels[s * per_step : (s + 1) * per_step]
        step_spans.append(step[-1].time_range.end - step[0].time_range.start)
        prev_end = step[0].time_range.start
        for e, (kind, nbytes) in zip(step, expected, strict=True):
            k = kinds.setdefault(kind, {"count": 0, "busy_us": 0.0, "path_us": 0.0, "bytes": 0})
            k["count"] += 1
            k["busy_us"] += e.time_range.end - e.time_range.start
            k["path_us"] += max(0.0, e.time_range.end - max(prev_end, e.time_range.start))
            k["bytes"] += nbytes
            prev_end = max(prev_end, e.time_range.end)
    for k in kinds.values():
        for field in ("busy_us", "path_us", "bytes"):
            k[field] /= replays
        k["count"] //= replays
        k["gbs"] = k["bytes"] / k["path_us"] / 1e3 if k["path_us"] else 0.0
        k["pct_of_read_bw"] = 100 * k["gbs"] / read_gbs
        k["ideal_us"] = k["bytes"] / read_gbs / 1e3
    return {"kinds": kinds, "kernels_per_step": per_step, "step_span_us": statistics.median(step_spans)}


def profiled_prefill(runner, prompt: list[int]):
    """torch.profiler's record (host and GPU) of one prefill up to its first token on the host, after a warm-up;
    the host range is named "prefill to first token"."""
    from torch.profiler import ProfilerActivity, profile, record_function

    runner.prefill(prompt)
    torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    with profile(activities=activities) as prof, record_function("prefill to first token"):
        runner.prefill(prompt)
        int(runner.token.item())
    return prof


def prefill_profile(runner, prompt: list[int], top: int = 14) -> dict:
    """GPU time of one prefill by kernel name (after a warm-up), largest first: where the TTFT goes. Also the
    timeline of that prefill (call to first token on the host): how long until the GPU's first kernel starts,
    the GPU idle between kernels, and the host's tail after the last one. The first of these holds ~2 ms that
    the profiler itself adds at the first CUDA call it sees (kernels/NOTES.md, round 9): untraced, the GPU's
    span is the TTFT."""
    prof = profiled_prefill(runner, prompt)
    per_name: dict[str, list] = {}
    spans, wall = [], None
    for e in prof.events():
        if e.name == "prefill to first token":  # the host range (its GPU-side annotation is no kernel)
            if e.device_type != torch.autograd.DeviceType.CUDA:
                wall = (e.time_range.start, e.time_range.end)
        elif e.device_type == torch.autograd.DeviceType.CUDA:
            entry = per_name.setdefault(e.name, [0, 0.0])
            entry[0] += 1
            entry[1] += e.time_range.end - e.time_range.start
            spans.append((e.time_range.start, e.time_range.end))
    ranked = sorted(per_name.items(), key=lambda item: -item[1][1])
    out = {"gpu_ms": sum(t for _, (_, t) in ranked) / 1e3,
           "kernels": [{"name": n, "calls": c, "ms": t / 1e3} for n, (c, t) in ranked[:top]]}  # fmt: skip
    if wall and spans:
        spans.sort()
        idle, reach = 0.0, spans[0][0]
        for start, end in spans:  # GPU idle between kernels (overlapping kernels count once)
            idle += max(0.0, start - reach)
            reach = max(reach, end)
        out["timeline_ms"] = {"wall": (wall[1] - wall[0]) / 1e3, "before_first_kernel": (spans[0][0] - wall[0]) / 1e3,
                              "gpu_idle_between": idle / 1e3, "after_last_kernel": (wall[1] - reach) / 1e3}  # fmt: skip
    return out


def sweep(model: Transformer, runner, read_gbs: float) -> dict:
    """Block-size variants of each matrix-vector kernel, each timed as a CUDA graph of one launch per layer
    (the real weights, so L2 serves nothing twice; PDL as in the step): us per launch and GB/s."""
    from kernels import lane_reduce_gemv as lrg
    from kernels import rmsnorm_gemv as rg

    cfg, eps, device, item = model.cfg, model.cfg.norm_eps, runner.device, model.tok_embeddings.element_size()
    layers, L = runner.layers, cfg.num_lanes
    runner.x.normal_()
    runner.attn.normal_()
    runner.h.normal_()

    def qkv(**blocks):
        for w in layers:
            rg.rmsnorm_gemv(runner.x, w.wqkv, runner.qkv, norm_weight=w.attention_norm, eps=eps, bias=w.bqkv,
                            use_pdl=True, **blocks)  # fmt: skip

    def gate_up(**blocks):
        for w in layers:
            rg.rmsnorm_gemv(runner.x, w.w1, runner.h, norm_weight=w.ffn_norm, eps=eps, weight_up=w.w3,
                            use_pdl=True, **blocks)  # fmt: skip

    def reduce(act, weight_of):
        def launch(**blocks):
            for w in layers:
                lrg.lane_reduce_gemv(act, weight_of(w), runner.x, mode=w.mode,
                                     history_in=runner.history[0, w.history_in] if w.history_in is not None else None,
                                     use_pdl=True, **blocks)  # fmt: skip

        return launch

    D, hd, F = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    qkv_rows = (cfg.num_heads + 2 * cfg.num_kv_heads) * hd // L
    kinds = {
        "qkv": (qkv, rg._pick_blocks(L, qkv_rows, D, False, device), qkv_rows * L * D, len(layers)),
        "gate/up": (gate_up, rg._pick_blocks(L, F // L, D, True, device), 2 * F * D, len(layers)),
        "o-proj": (
            reduce(runner.attn, lambda w: w.wo),
            lrg._pick_blocks(L, D, cfg.num_heads * hd // L, device),
            D * cfg.num_heads * hd,
            len(layers),
        ),  # fmt: skip
        "down": (
            reduce(runner.h, lambda w: w.w2),
            lrg._pick_blocks(L, D, F // L, device),
            D * F,
            len(layers),
        ),
    }
    out = {"attention": sweep_attention(model, runner, read_gbs), "head": sweep_head(model, runner, read_gbs)}
    for kind, (launch, (bn, bk, warps), elements, launches) in kinds.items():
        variants = [{}]
        for n, w in ((bn * 2, warps), (max(1, bn // 2), warps), (bn, 12 - warps), (bn * 2, 12 - warps)):
            variants.append({"block_n": n, "block_k": bk, "num_warps": w})
        rows = []
        for blocks in variants:
            try:
                launch(**blocks)  # compiles
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    launch(**blocks)
                us = median_ms(graph.replay, repeats=20) * 1e3 / launches
                gbs = elements * item / us / 1e3
                rows.append({"blocks": blocks or "auto", "us": us, "gbs": gbs, "pct": 100 * gbs / read_gbs})
            except Exception as e:
                rows.append({"blocks": blocks or "auto", "error": f"{type(e).__name__}: {e}".splitlines()[0]})
        out[kind] = rows
    return out


def sweep_head(model: Transformer, runner, read_gbs: float) -> list[dict]:
    """The head as the step launches it (final norm folded in for one lane), block variants, timed as a CUDA
    graph of one launch ("alone") and as the cost it adds after the last layer's down-projection ("after
    down": graph of down + head minus graph of down alone)."""
    from kernels import lm_head as lmh

    cfg = model.cfg
    if cfg.num_lanes > 1:
        head_x, head_norm = runner.head_in, None
    else:
        head_x, head_norm = runner.x[0], runner.final_norm_weight[0]
    last = len(runner.layers) - 1
    w_last = runner.layers[last]
    nbytes = runner.head_weight.numel() * runner.head_weight.element_size()

    def down():
        runner._add_partials(last, w_last, 1, runner.h, w_last.w2, False)

    pos = runner.pos.clone()

    def timed(fn) -> float:
        fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        us = median_ms(graph.replay, repeats=20) * 1e3
        runner.pos.copy_(pos)  # each head launch advances the position: keep it inside the cache
        return us

    rows = []
    down_us = timed(down)
    for blocks in ({}, {"block_n": 8, "num_warps": 4}, {"block_n": 16, "num_warps": 4}, {"block_n": 16, "num_warps": 8},
                   {"block_n": 4, "num_warps": 4}, {"block_n": 32, "num_warps": 8}):  # fmt: skip

        def head(blocks=blocks):
            lmh.lm_head(head_x, runner.head_weight, runner.logits, runner.head_scratch, norm_weight=head_norm,
                        eps=cfg.norm_eps, greedy=True, vocab_limit=runner.vocab_limit, token=runner.token,
                        pos=runner.pos, out_tokens=runner.out_tokens, use_pdl=runner.use_pdl, **blocks)  # fmt: skip

        def down_head(head=head):
            down()
            head()

        try:
            alone = timed(head)
            after = timed(down_head) - down_us
            rows.append({"blocks": blocks or "auto", "us": alone, "gbs": nbytes / alone / 1e3,
                         "pct": 100 * nbytes / alone / 1e3 / read_gbs, "after_down_us": after})  # fmt: skip
        except Exception as e:
            rows.append({"blocks": blocks or "auto", "error": f"{type(e).__name__}: {e}".splitlines()[0]})
    return rows


def sweep_attention(model: Transformer, runner, read_gbs: float) -> list[dict]:
    """Split counts and key blocks of the attention kernel at the runner's current position, each timed as a
    CUDA graph of one launch per layer: us per launch and GB/s of cache read."""
    from kernels.decode_attention import AttentionScratch, decode_attention, default_splits

    cfg, device, item = model.cfg, runner.device, model.tok_embeddings.element_size()
    context = int(runner.pos.item())
    cache_bytes = sum(b for kind, b in kernel_bytes(cfg, item, context) if kind == "attention")
    group, default = cfg.num_heads // cfg.num_kv_heads, default_splits(cfg.num_kv_heads, device)
    rows = []
    for splits, block_t, warps in [(default, 64, 4), (default, 32, 4), (default // 2, 64, 4), (default // 4, 64, 4),
                                   (default // 8, 64, 4), (default * 2, 32, 4), (default // 4, 64, 8),
                                   (default // 2, 32, 4)]:  # fmt: skip
        if splits < 1:
            continue
        scratch = AttentionScratch(cfg.num_kv_heads, group, cfg.head_dim, splits, device)
        blocks = {"splits": splits, "block_t": block_t, "num_warps": warps, "context": context}

        def launch(scratch=scratch, block_t=block_t, warps=warps):
            for i, w in enumerate(runner.layers):
                decode_attention(runner.qkv, runner.cache.k[i, 0], runner.cache.v[i, 0], runner.pos,
                                 model.rope_cos, model.rope_sin, runner.attn, scratch, num_heads=cfg.num_heads,
                                 window=w.window, q_norm=w.q_norm, k_norm=w.k_norm, eps=cfg.norm_eps,
                                 use_pdl=True, block_t=block_t, num_warps=warps)  # fmt: skip

        try:
            launch()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                launch()
            us = median_ms(graph.replay, repeats=20) * 1e3 / len(runner.layers)
            gbs = cache_bytes / len(runner.layers) / us / 1e3
            rows.append({"blocks": blocks, "us": us, "gbs": gbs, "pct": 100 * gbs / read_gbs})
        except Exception as e:
            rows.append({"blocks": blocks, "error": f"{type(e).__name__}: {e}".splitlines()[0]})
    return rows


# --- peers -----------------------------------------------------------------------------------------------


@torch.no_grad()
def peer_reference_compiled(model: Transformer, prompt: list[int], new_tokens: int, runs: int) -> dict:
    """model.forward for one token under torch.compile(mode="reduce-overhead"), greedy on the device."""
    cfg, device = model.cfg, model.tok_embeddings.device
    cache = KVCache(cfg, len(prompt) + new_tokens + 1, 1, device, model.tok_embeddings.dtype)
    # The cache is written in place every step: static addresses let the CUDA graphs keep it (as gpt-fast does).
    torch._dynamo.mark_static_address(cache.k)
    torch._dynamo.mark_static_address(cache.v)
    step = torch.compile(model, mode="reduce-overhead")
    ids = torch.tensor([prompt], device=device)

    def one() -> float:
        token = model(ids, 0, cache, last_only=True)[:, -1].argmax(-1, keepdim=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(new_tokens - 1):
            token = step(token, len(prompt) + i, cache)[:, -1].argmax(-1, keepdim=True).clone()
        torch.cuda.synchronize()
        return (new_tokens - 1) / (time.perf_counter() - t0)

    one()  # compiles, and records a graph per context length
    one()
    return {"tok_s": statistics.median(one() for _ in range(runs))}


@torch.no_grad()
def peer_hf_static_compiled(
    name: str, prompt: list[int], new_tokens: int, runs: int, mode: str = "reduce-overhead"
) -> dict:
    """transformers' generate with a static cache and torch.compile(reduce-overhead), greedy.

    transformers compiles its own decode step when given a CompileConfig (compiling `forward` by hand breaks
    on its cache's in-place counters under CUDA graphs: "accessing tensor output of CUDAGraphs that has been
    overwritten", seen with transformers 5.17)."""
    from transformers import AutoConfig, AutoModelForCausalLM, CompileConfig

    raw = preset_config(name)
    hf_cfg = AutoConfig.for_model(**raw)
    with torch.device("cuda"):
        hf = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.bfloat16).eval()
    hf.generation_config.cache_implementation = "static"
    hf.generation_config.compile_config = CompileConfig(fullgraph=True, mode=mode)
    ids = torch.tensor([prompt], device="cuda")

    def gen(n: int) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    gen(new_tokens)
    gen(new_tokens)
    full = statistics.median(gen(new_tokens) for _ in range(runs))
    first = statistics.median(gen(1) for _ in range(runs))
    return {"tok_s": (new_tokens - 1) / (full - first), "ttft_ms": first * 1e3}


# --- the table -------------------------------------------------------------------------------------------


def table(result: dict) -> str:
    bw, ceiling = result["bandwidth"]["read_gbs"], result["ceiling_tok_s"]
    lines = [
        f"{result['model']} on {result['device']} · bf16 · prompt {result['prompt_len']} · "
        f"{result['new_tokens']} new tokens · greedy, batch 1",
        f"read bandwidth (measured now): {bw:,.0f} GB/s (copy {result['bandwidth']['copy_gbs']:,.0f} GB/s) · "
        f"bytes/token {result['bytes_per_token'] / 1e9:.3f} GB · ceiling {ceiling:,.0f} tok/s "
        f"({1e6 / ceiling:.0f} us/token)",
    ]
    if "screened_bytes_per_token" in result:
        screened = result["screened_bytes_per_token"]
        lines.append(f"with the head screen a greedy step reads {screened / 1e9:.3f} GB (+ the candidates' rows): "
                     f"{bw * 1e9 / screened:,.0f} tok/s for those bytes; % of ceiling below is against the bf16 "
                     "bytes")  # fmt: skip
    lines += [
        "",
        "| path | decode tok/s | us/token | % of ceiling | TTFT ms |",
        "| --- | --- | --- | --- | --- |",
    ]
    for row in result["rows"]:
        if "error" in row:
            lines.append(f"| {row['path']} | failed: {row['error'][:80]} | | | |")
            continue
        ttft = f"{row['ttft_ms']:.1f}" if row.get("ttft_ms") is not None else ""
        paths = ", ".join(f"{path} {n}" for path, n in row.get("sample_paths", {}).items())
        name = row["path"] + (f" · sampler steps: {paths}" if paths else "")
        if "same_tokens_as_full_head" in row:
            name += f" · draws as the full head's: {100 * row['same_tokens_as_full_head']:.1f}%"
        if "left_screen_after" in row:
            name += f" · whole head from step {row['left_screen_after']} (flat logits)"
        lines.append(f"| {name} | {row['tok_s']:,.0f} | {1e6 / row['tok_s']:.0f} | "
                     f"{100 * row['tok_s'] / ceiling:.1f}% | {ttft} |")  # fmt: skip
    if "check" in result:
        c = result["check"]
        if "error" in c:
            lines.append(f"\ncheck failed to run: {c['error']}")
        else:
            decisive = c.get("decisive_fp32_argmax_agree")
            lines.append(
                f"\ncheck ({c['steps']} teacher-forced steps, tokens from the fp32 reference):\n"
                f"  vs the bf16 reference: max rel err {c['max_rel_err']:.2e}, mean {c['mean_rel_err']:.2e}, "
                f"same argmax {100 * c['argmax_agree']:.1f}% -> {'PASS' if c['passed'] else 'FAIL'}\n"
                f"  vs the fp32 reference: max rel err {c['fp32_max_rel_err']:.2e}, mean "
                f"{c['fp32_mean_rel_err']:.2e}, same argmax {100 * c['fp32_argmax_agree']:.1f}% -> "
                f"{'PASS' if c['passed_fp32'] else 'FAIL'}\n"
                f"  the bf16 reference itself vs fp32: max rel err {c['reference_vs_fp32_max_rel_err']:.2e}, same "
                f"argmax {100 * c['reference_vs_fp32_argmax_agree']:.1f}%\n"
                f"  decisive steps (fp32 top-2 margin > the bf16 reference's max logit error): "
                f"{c['decisive_steps']}/{c['steps']}, fast path same argmax as fp32 on them: "
                + (f"{100 * decisive:.1f}%" if decisive is not None else "-")
            )
            if c.get("screen_same_token") is not None:
                lines.append(
                    f"  head screen: the full head's argmax at {100 * c['screen_same_token']:.1f}% of steps"
                )
            if "fp32_margin_median" in c:
                lines.append(
                    f"  fp32 logits ({c['init']} weights): top1-top2 margin median {c['fp32_margin_median']:.3g}, "
                    f"10th pct {c['fp32_margin_p10']:.3g}; skip path (head on the current token's embedding) "
                    f"picks the argmax at {100 * c['skip_path_argmax_agree']:.1f}% of steps; top logit "
                    f"{100 * c['top_logit_norm_share_median']:.2f}% of the squared norm (median)"
                )
    if "breakdown" in result and "kinds" in result["breakdown"]:
        b = result["breakdown"]
        lines += [
            f"\nper kernel (fast path{', one stream' if b.get('one_stream') else ''}, {b['kernels_per_step']} "
            f"kernels/step, step span {b['step_span_us']:.0f} us):",
            "| kernel | per step | us on path | us busy | MB read | GB/s | % of read bw | ideal us |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for kind, k in b["kinds"].items():
            lines.append(
                f"| {kind} | {k['count']} | {k['path_us']:.1f} | {k['busy_us']:.1f} | {k['bytes'] / 1e6:.1f} | "
                f"{k['gbs']:,.0f} | {k['pct_of_read_bw']:.0f}% | {k['ideal_us']:.1f} |"
            )
    if "prefill_profile" in result:
        pp = result["prefill_profile"]
        if "error" in pp:
            lines.append(f"\nprefill profile failed: {pp['error']}")
        else:
            lines.append(f"\nprefill, GPU time by kernel (total {pp['gpu_ms']:.1f} ms):")
            lines += [f"  {k['ms']:7.2f} ms {k['calls']:4d}x {k['name'][:90]}" for k in pp["kernels"]]
            if "timeline_ms" in pp:
                tl = pp["timeline_ms"]
                lines.append(f"  timeline (profiled, host call to first token): {tl['wall']:.1f} ms = "
                             f"{tl['before_first_kernel']:.2f} before the first kernel + GPU busy + "
                             f"{tl['gpu_idle_between']:.2f} idle between kernels + {tl['after_last_kernel']:.2f} "
                             "after the last one")  # fmt: skip
    if "sweep" in result:
        lines.append("\nblock-size sweep (us per launch, GB/s, % of read bandwidth):")
        for kind, rows in result["sweep"].items():
            if kind == "error":
                lines.append(f"  failed: {rows}")
                continue
            cells = [f"{r['blocks']}: " + (f"{r['us']:.1f} us {r['gbs']:,.0f} GB/s {r['pct']:.0f}%" if "us" in r
                                           else r["error"][:60])
                     + (f" ({r['after_down_us']:.1f} us after down)" if "after_down_us" in r else "")
                     for r in rows]  # fmt: skip
            lines.append(f"  {kind}: " + " | ".join(cells))
    return "\n".join(lines)


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
    parser.add_argument(
        "--sweep", action="store_true", help="block-size variants of the matrix-vector kernels"
    )
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
    runner = FastRunner(model, max_context)
    pdl = "PDL" if runner.use_pdl else "no PDL"
    if runner.head_screen is not None:
        # the screen's copy and the bounds it writes and reads, instead of the bf16 head
        head_bytes = runner.head_weight.numel() * runner.head_weight.element_size()
        result["screened_bytes_per_token"] = (
            result["bytes_per_token"] - head_bytes + runner.head_screen.nbytes + 8 * cfg.vocab_size
        )
    default = f"fast, CUDA graph, {pdl}" + (
        ", head screen (int8 + bf16 candidates)" if runner.head_screen is not None else ""
    )
    row(default, lambda: time_fast(runner, prompt, args.new_tokens, args.runs))
    full_head = (
        FastRunner(model, max_context, head_screen=False) if runner.head_screen is not None else runner
    )
    if full_head is not runner:
        row(f"fast, CUDA graph, {pdl}, full bf16 head",
            lambda: time_fast(full_head, prompt, args.new_tokens, args.runs))  # fmt: skip
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
    if not args.no_pdl_row:
        other = "fast, CUDA graph, no PDL" if runner.use_pdl else "fast, CUDA graph, PDL"
        row(other, lambda: time_fast(FastRunner(model, max_context, use_pdl=not runner.use_pdl), prompt,
                                     args.new_tokens, args.runs))  # fmt: skip
    # With lane groups (two streams) kernels overlap, so the per-kernel breakdown is of the one-stream step.
    one_stream = FastRunner(model, max_context, lane_groups={"groups": 1}) if runner.groups else runner
    if runner.groups:
        row("fast, CUDA graph, one stream (no lane groups)",
            lambda: time_fast(one_stream, prompt, args.new_tokens, args.runs))  # fmt: skip
    if args.breakdown and runner is not None:
        try:
            result["breakdown"] = breakdown(model, one_stream, prompt, 20, result["bandwidth"]["read_gbs"])
            result["breakdown"]["one_stream"] = one_stream is not runner
        except Exception as e:
            result["breakdown"] = {"error": f"{type(e).__name__}: {e}"}
    if args.sweep and runner is not None:
        try:
            result["sweep"] = sweep(model, runner, result["bandwidth"]["read_gbs"])
        except Exception as e:
            result["sweep"] = {"error": f"{type(e).__name__}: {e}"}
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


if __name__ == "__main__":
    sys.exit(main())
