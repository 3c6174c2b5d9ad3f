"""The --peers, decoding the same prompt greedily at batch 1: the reference model under torch.compile
(reduce-overhead) and, for the HF families, transformers with a static cache and torch.compile."""

from __future__ import annotations

import statistics
import time

import torch

from inference.model import KVCache, Transformer
from inference.presets import preset_config


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
