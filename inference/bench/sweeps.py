"""The --sweep: block-size variants of the matrix-vector kernels, the head and attention, each timed as a CUDA
graph on the runner's own weights and buffers, against the read bandwidth."""

from __future__ import annotations

import torch

from inference.bench.ceiling import kernel_bytes
from inference.bench.timing import median_ms
from inference.model import Transformer


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
