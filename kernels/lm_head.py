"""Final RMSNorm + LM head + greedy argmax, and the step's bookkeeping, in one launch.

    logits[v] = sum_k W[v, k] * x[k] * g[k] * rstd,   token = argmax_{v < vocab_limit} logits[v]  (first on ties)
    then, once: token_out <- token, out_tokens[pos + 1] <- token, pos <- pos + 1

The head is the largest matrix of a small model (V x D), so it gets a persistent grid: a fixed number of
programs (a few per multiprocessor) walk the row blocks with a stride, keeping a running (max, index). Each
program publishes its best pair; the last one to finish (an atomic counter) reduces those few hundred pairs,
writes the token where the next step's first kernels read it and advances the position: no host round trip.
Without GREEDY only the logits are written (sampling happens after, on the device).

Bytes: the head once (V * K elements), the logits once (V fp32), x once per row block (L1 hits).
"""

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kernels import interpreted, pdl_kwargs, sm_count


@triton.jit
def _row_block_logits(
    w_rows,
    row_ok,
    w_first,
    x_ptr,
    norm_ptr,
    eps,
    cols,
    USE_FIRST: tl.constexpr,
    BLOCK_N: tl.constexpr,
    K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_NORM: tl.constexpr,
):
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    sumsq = tl.zeros([BLOCK_K], dtype=tl.float32)
    for i in tl.static_range(0, (K + BLOCK_K - 1) // BLOCK_K):
        k_ok = i * BLOCK_K + cols < K
        if USE_FIRST and i == 0:
            w = w_first
        else:
            w = tl.load(w_rows + i * BLOCK_K + cols[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0,
                        eviction_policy="evict_first")  # fmt: skip
        xk = tl.load(x_ptr + i * BLOCK_K + cols, mask=k_ok, other=0.0).to(tl.float32)
        if HAS_NORM:
            sumsq += xk * xk
            xk = xk * tl.load(norm_ptr + i * BLOCK_K + cols, mask=k_ok, other=0.0).to(tl.float32)
        acc += w.to(tl.float32) * xk[None, :]
    logits = tl.sum(acc, axis=1)
    if HAS_NORM:
        logits = logits / tl.sqrt(tl.sum(sumsq, axis=0) / K + eps)
    return logits


@triton.jit
def _lm_head_kernel(
    x_ptr,
    norm_ptr,
    w_ptr,
    logits_ptr,
    part_val_ptr,
    part_idx_ptr,
    counter_ptr,
    token_ptr,
    pos_ptr,
    out_tokens_ptr,
    V,
    vocab_limit,
    eps,
    K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_NORM: tl.constexpr,
    GREEDY: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK_N
    cols = tl.arange(0, BLOCK_K)
    row0 = pid * BLOCK_N
    rows = row0 + tl.arange(0, BLOCK_N)
    row_ok = rows < V
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * K
    # The first tile of the first row block is in flight before we wait for x.
    w_first = tl.load(w_rows + cols[None, :], mask=row_ok[:, None] & (cols < K)[None, :], other=0.0,
                      eviction_policy="evict_first")  # fmt: skip
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()

    logits = _row_block_logits(
        w_rows, row_ok, w_first, x_ptr, norm_ptr, eps, cols, True, BLOCK_N, K, BLOCK_K, HAS_NORM
    )
    tl.store(logits_ptr + rows, logits, mask=row_ok)
    logits = tl.where(rows < vocab_limit, logits, float("-inf"))
    best_val = tl.max(logits, axis=0)
    best_idx = row0 + tl.argmax(logits, axis=0)
    row0 += step
    while row0 < V:
        rows = row0 + tl.arange(0, BLOCK_N)
        row_ok = rows < V
        w_rows = w_ptr + rows.to(tl.int64)[:, None] * K
        logits = _row_block_logits(
            w_rows, row_ok, w_first, x_ptr, norm_ptr, eps, cols, False, BLOCK_N, K, BLOCK_K, HAS_NORM
        )
        tl.store(logits_ptr + rows, logits, mask=row_ok)
        logits = tl.where(rows < vocab_limit, logits, float("-inf"))
        block_max = tl.max(logits, axis=0)
        better = block_max > best_val  # strict: earlier rows win ties
        best_idx = tl.where(better, row0 + tl.argmax(logits, axis=0), best_idx)
        best_val = tl.where(better, block_max, best_val)
        row0 += step

    if GREEDY:
        tl.store(part_val_ptr + pid, best_val)
        tl.store(part_idx_ptr + pid, best_idx)
        tl.debug_barrier()
        done = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
        if done == tl.num_programs(0) - 1:
            vals = tl.load(part_val_ptr + tl.arange(0, 1024), mask=tl.arange(0, 1024) < tl.num_programs(0),
                           other=float("-inf"), cache_modifier=".cg")  # fmt: skip
            idxs = tl.load(part_idx_ptr + tl.arange(0, 1024), mask=tl.arange(0, 1024) < tl.num_programs(0),
                           other=2147483647, cache_modifier=".cg")  # fmt: skip
            top = tl.max(vals, axis=0)
            token = tl.min(tl.where(vals == top, idxs, 2147483647), axis=0)
            pos = tl.load(pos_ptr)
            tl.store(token_ptr, token.to(token_ptr.dtype.element_ty))
            tl.store(out_tokens_ptr + pos + 1, token.to(out_tokens_ptr.dtype.element_ty))
            tl.store(pos_ptr, pos + 1)
            tl.atomic_xchg(counter_ptr, 0)


class HeadScratch:
    """Per-program (max, index) pairs and the arrival counter of the argmax (zero between launches)."""

    MAX_PROGRAMS = 1024

    def __init__(self, device: torch.device, programs: int | None = None):
        self.programs = min(programs or 4 * sm_count(device), self.MAX_PROGRAMS)
        self.part_val = torch.empty(self.MAX_PROGRAMS, dtype=torch.float32, device=device)
        self.part_idx = torch.empty(self.MAX_PROGRAMS, dtype=torch.int32, device=device)
        self.counter = torch.zeros(1, dtype=torch.int32, device=device)


def lm_head(
    x: torch.Tensor,
    weight: torch.Tensor,
    logits: torch.Tensor,
    scratch: HeadScratch,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    greedy: bool = True,
    vocab_limit: int | None = None,
    token: torch.Tensor | None = None,
    pos: torch.Tensor | None = None,
    out_tokens: torch.Tensor | None = None,
    use_pdl: bool = False,
    block_n: int | None = None,
    num_warps: int = 4,
) -> torch.Tensor:
    """logits = weight @ (rmsnorm(x) * norm_weight) (no norm without norm_weight); with greedy, also
    token[0] = argmax over the first vocab_limit rows (padded embedding rows are never chosen),
    out_tokens[pos[0] + 1] = token[0], pos[0] += 1, all on the device.

    x: [K] (any float dtype); weight: [V, K]; logits: [V] fp32; token, pos: int tensors [1];
    out_tokens: int tensor longer than pos[0] + 1.
    """
    if weight.dim() != 2 or not weight.is_contiguous():
        raise ValueError(f"weight: expected a contiguous [V, K] tensor, got {tuple(weight.shape)}")
    vocab, k = weight.shape
    if x.shape != (k,) or not x.is_contiguous():
        raise ValueError(f"x: expected a contiguous [{k}], got {tuple(x.shape)}")
    if norm_weight is not None and norm_weight.shape != (k,):
        raise ValueError(f"norm_weight: expected [{k}], got {tuple(norm_weight.shape)}")
    if logits.shape != (vocab,) or logits.dtype != torch.float32 or not logits.is_contiguous():
        raise ValueError(
            f"logits: expected a contiguous fp32 [{vocab}], got {logits.dtype} {tuple(logits.shape)}"
        )
    if greedy:
        for name, t in (("token", token), ("pos", pos), ("out_tokens", out_tokens)):
            if t is None or t.dtype not in (torch.int32, torch.int64):
                raise ValueError(f"{name}: an int32/int64 tensor is required with greedy")
        if token.numel() != 1 or pos.numel() != 1:
            raise ValueError("token: token and pos must hold one element each")
    block_k = min(512, triton.next_power_of_2(k))
    if block_n is None and interpreted():  # programs run one after another there: one large row block each
        block_n = min(1024, triton.next_power_of_2(triton.cdiv(vocab, scratch.programs)))
    elif block_n is None:  # 8 elements a thread per K tile (16-byte loads)
        block_n = max(1, min(16, (8 * 32 * num_warps) // block_k))
    programs = min(scratch.programs, triton.cdiv(vocab, block_n))
    _lm_head_kernel[(programs,)](
        x,
        norm_weight if norm_weight is not None else x,
        weight,
        logits,
        scratch.part_val,
        scratch.part_idx,
        scratch.counter,
        token if token is not None else scratch.counter,
        pos if pos is not None else scratch.counter,
        out_tokens if out_tokens is not None else scratch.counter,
        vocab,
        min(vocab_limit or vocab, vocab),
        eps,
        K=k,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        HAS_NORM=norm_weight is not None,
        GREEDY=greedy,
        USE_PDL=use_pdl,
        num_warps=num_warps,
        **pdl_kwargs(use_pdl),
    )
    return logits
