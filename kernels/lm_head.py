"""Final RMSNorm + LM head + greedy argmax, and the step's bookkeeping, in one launch.

    logits[v] = sum_k W[v, k] * x[k] * g[k] * rstd,   token = argmax_{v < vocab_limit} logits[v]  (first on ties)
    then, once: token_out <- token, out_tokens[pos + 1] <- token, pos <- pos + 1

The head is the largest matrix of a small model (V x D); it streams like rmsnorm_gemv: every program takes a few
blocks of rows over all of K in turn, requesting all of a block's weight tiles before it sums them and the next
block's while it does, and there are many programs per multiprocessor. The argmax is reduced in two levels with
no second launch: each program publishes its best (value, first index) over its blocks; the last program of each
group of GROUP programs to finish (an atomic counter) reduces its group; the last group to finish reduces the
group bests, writes the token where the next step's first kernels read it and advances the position. Without
GREEDY only the logits are written (sampling happens after, on the device).

Bytes: the head once (V * K elements), the logits once (V fp32), x once per program (L1/L2 hits).
"""

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kernels import interpreted, pdl_kwargs
from kernels.rmsnorm_gemv import next_row_block, normed_x_tiles, row_dots, weight_tiles

MAX_GROUPS = 512
# No row: the index a program's best starts from and masked loads read, above every real one (ties go low).
NO_ROW = tl.constexpr(2147483647)


@triton.jit
def first_row_block(w_ptr, V, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    ROW_BLOCKS: tl.constexpr, USE_PDL: tl.constexpr):  # fmt: skip
    """A head program's first block of BLOCK_N rows: (rows, row mask, weight offsets, all its [BLOCK_N, BLOCK_K]
    tiles). As rmsnorm_gemv: the first tile is in flight before the wait for x (PDL), the rest right after it."""
    TILES: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
    rows = tl.program_id(0) * ROW_BLOCKS * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < V
    cols = tl.arange(0, BLOCK_K)
    w_offs = rows.to(tl.int64)[:, None] * K + cols[None, :]
    w = weight_tiles(w_ptr, w_offs, row_ok, cols, K, BLOCK_K, 0, 1)
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
    w = w + weight_tiles(w_ptr, w_offs, row_ok, cols, K, BLOCK_K, 1, TILES - 1)
    return rows, row_ok, w_offs, w


@triton.jit
def publish_best(best, best_at, best_val_ptr, best_idx_ptr, counter_ptr, token_ptr, pos_ptr, out_tokens_ptr,
                 ring_ptr, GROUP: tl.constexpr, MAX_GROUPS: tl.constexpr, RING: tl.constexpr):  # fmt: skip
    """The grid's argmax from every program's best (value, first index), with no second launch: the last program
    of each group of GROUP to arrive (an atomic counter) reduces its group, the last group to arrive reduces the
    group bests, writes the token where the next step's first kernels read it and advances the position."""
    pid = tl.program_id(0)
    tl.store(best_val_ptr + pid, best)
    tl.store(best_idx_ptr + pid, best_at)
    # Every thread's stores are issued before one thread publishes them.
    tl.debug_barrier()
    programs = tl.num_programs(0)
    group = pid // GROUP
    group_size = tl.minimum(programs - group * GROUP, GROUP)
    if tl.atomic_add(counter_ptr + 1 + group, 1, sem="acq_rel", scope="gpu") == group_size - 1:
        members = group * GROUP + tl.arange(0, GROUP)
        ok = members < programs
        vals = tl.load(best_val_ptr + members, mask=ok, other=float("-inf"), cache_modifier=".cg")
        idxs = tl.load(best_idx_ptr + members, mask=ok, other=NO_ROW, cache_modifier=".cg")
        top = tl.max(vals, axis=0)
        # group bests live after the per-program ones
        tl.store(best_val_ptr + programs + group, top)
        tl.store(best_idx_ptr + programs + group, tl.min(tl.where(vals == top, idxs, NO_ROW), axis=0))
        tl.atomic_xchg(counter_ptr + 1 + group, 0)
        tl.debug_barrier()
        groups = tl.cdiv(programs, GROUP)
        if tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu") == groups - 1:
            group_ids = tl.arange(0, MAX_GROUPS)
            group_ok = group_ids < groups
            group_vals = tl.load(best_val_ptr + programs + group_ids, mask=group_ok, other=float("-inf"),
                                 cache_modifier=".cg")  # fmt: skip
            group_idxs = tl.load(best_idx_ptr + programs + group_ids, mask=group_ok, other=NO_ROW,
                                 cache_modifier=".cg")  # fmt: skip
            best = tl.max(group_vals, axis=0)
            token = tl.min(tl.where(group_vals == best, group_idxs, NO_ROW), axis=0)
            pos = tl.load(pos_ptr)
            tl.store(token_ptr, token.to(token_ptr.dtype.element_ty))
            tl.store(out_tokens_ptr + pos + 1, token.to(out_tokens_ptr.dtype.element_ty))
            if RING > 0:  # straight into the host's pinned ring: no copy between this step and the next
                tl.store(ring_ptr + (pos + 1) % RING, token.to(ring_ptr.dtype.element_ty))
            tl.store(pos_ptr, pos + 1)
            tl.atomic_xchg(counter_ptr, 0)


@triton.jit
def _lm_head_kernel(
    x_ptr,
    norm_ptr,
    w_ptr,
    logits_ptr,
    best_val_ptr,
    best_idx_ptr,
    counter_ptr,
    token_ptr,
    pos_ptr,
    out_tokens_ptr,
    ring_ptr,
    V,
    vocab_limit,
    eps,
    K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ROW_BLOCKS: tl.constexpr,
    GROUP: tl.constexpr,
    MAX_GROUPS: tl.constexpr,
    HAS_NORM: tl.constexpr,
    GREEDY: tl.constexpr,
    RING: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    TILES: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
    # the first block's weights (its first tile before the wait for x), then x and its norm statistics, then the
    # products
    rows, row_ok, w_offs, w = first_row_block(w_ptr, V, K, BLOCK_N, BLOCK_K, ROW_BLOCKS, USE_PDL)
    cols = tl.arange(0, BLOCK_K)
    xs, rstd = normed_x_tiles(x_ptr, norm_ptr, cols, eps, K, BLOCK_K, HAS_NORM)

    # ROW_BLOCKS blocks of rows in turn, the next block's tiles in flight while this one is summed; the
    # program's best (value, first index) is kept across its blocks, which come in increasing row order.
    for j in tl.static_range(ROW_BLOCKS):
        if j + 1 < ROW_BLOCKS:
            next_rows, next_ok, next_offs = next_row_block(rows, w_offs, V, BLOCK_N, K)
            next_w = weight_tiles(w_ptr, next_offs, next_ok, cols, K, BLOCK_K, 0, TILES)
        logits = row_dots(w, xs, BLOCK_N, BLOCK_K) * rstd
        tl.store(logits_ptr + rows, logits, mask=row_ok)
        candidates = tl.where(rows < vocab_limit, logits, float("-inf"))
        block_best = tl.max(candidates, axis=0)
        block_at = tl.min(tl.where(candidates == block_best, rows, NO_ROW), axis=0)
        if j == 0:
            best, best_at = block_best, block_at
        else:
            take = block_best > best
            best, best_at = tl.where(take, block_best, best), tl.where(take, block_at, best_at)
        if j + 1 < ROW_BLOCKS:
            rows, row_ok, w_offs, w = next_rows, next_ok, next_offs, next_w

    if GREEDY:
        publish_best(best, best_at, best_val_ptr, best_idx_ptr, counter_ptr, token_ptr, pos_ptr, out_tokens_ptr,
                     ring_ptr, GROUP, MAX_GROUPS, RING)  # fmt: skip


class HeadScratch:
    """Best (value, index) per program and per group, and the arrival counters (zero between launches)."""

    def __init__(self, vocab_size: int, device: torch.device):
        self.best_val = torch.empty(vocab_size + MAX_GROUPS, dtype=torch.float32, device=device)
        self.best_idx = torch.empty(vocab_size + MAX_GROUPS, dtype=torch.int32, device=device)
        self.counter = torch.zeros(1 + MAX_GROUPS, dtype=torch.int32, device=device)


def _pick_blocks(vocab: int, k: int) -> tuple[int, int, int]:
    block_k = min(512, triton.next_power_of_2(k))
    if interpreted():  # programs run one after another there: few, large ones
        return min(256, triton.next_power_of_2(vocab)), min(128, block_k), 4
    # as rmsnorm_gemv: a program's weights in flight together, about 96 elements a thread
    block_n = 16
    while block_n > 1 and block_n * k > 96 * 256:
        block_n //= 2
    # 4 warps: the head streams closer to the read bandwidth with 4 than with 8 (docs/fast-path.md)
    return block_n, block_k, 4


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
    host_ring: torch.Tensor | None = None,
    use_pdl: bool = False,
    block_n: int | None = None,
    row_blocks: int | None = None,
    num_warps: int | None = None,
    group: int = 256,
) -> torch.Tensor:
    """logits = weight @ (rmsnorm(x) * norm_weight) (no norm without norm_weight); with greedy, also
    token[0] = argmax over the first vocab_limit rows (padded embedding rows are never chosen),
    out_tokens[pos[0] + 1] = token[0], pos[0] += 1, all on the device.

    x: [K] (any float dtype); weight: [V, K]; logits: [V] fp32; token, pos: int tensors [1];
    out_tokens: int tensor longer than pos[0] + 1; scratch: HeadScratch(V, device).
    host_ring: with greedy, an int tensor [R] in pinned host memory (on a GPU; any CPU tensor under the
    interpreter) that also receives the token, at host_ring[(pos[0] + 1) % R]: the host reads it once the step's
    event has fired, with no device-to-host copy queued between one step's graph and the next.
    row_blocks: blocks of block_n rows each program takes in turn, the next block's weights loaded while the
    current one is summed (with more than one, the automatic block_n is halved: two blocks are in flight).
    None: 4, the best of 1, 2, 4, 8 and 16 on every model (docs/fast-path.md); 1 under the interpreter.
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
    if scratch.best_val.numel() < vocab + MAX_GROUPS:
        raise ValueError(f"scratch: allocated for a vocabulary under {vocab}")
    if greedy:
        for name, t in (("token", token), ("pos", pos), ("out_tokens", out_tokens)):
            if t is None or t.dtype not in (torch.int32, torch.int64):
                raise ValueError(f"{name}: an int32/int64 tensor is required with greedy")
        if token.numel() != 1 or pos.numel() != 1:
            raise ValueError("token: token and pos must hold one element each")
    if host_ring is not None:
        if not greedy:
            raise ValueError("host_ring: only with greedy (the sampled token is chosen after the head)")
        on_host = host_ring.device.type == "cpu" and (host_ring.is_pinned() or weight.device.type == "cpu")
        if host_ring.dim() != 1 or host_ring.dtype not in (torch.int32, torch.int64) or not on_host:
            raise ValueError(f"host_ring: expected a 1-D int32/int64 tensor in pinned host memory, got "
                             f"{host_ring.dtype} {tuple(host_ring.shape)} on {host_ring.device}")  # fmt: skip
    if row_blocks is None:
        row_blocks = 1 if interpreted() else 4
    if row_blocks < 1:
        raise ValueError(f"row_blocks: expected at least 1, got {row_blocks}")
    auto_n, block_k, auto_warps = _pick_blocks(vocab, k)
    if row_blocks > 1:
        auto_n = max(1, auto_n // 2)
    block_n, num_warps = block_n or auto_n, num_warps or auto_warps
    programs = triton.cdiv(triton.cdiv(vocab, block_n), row_blocks)
    if triton.cdiv(programs, group) > MAX_GROUPS or group & (group - 1):
        raise ValueError(f"group: a power of two with at most {MAX_GROUPS} groups of {programs} programs")
    _lm_head_kernel[(programs,)](
        x,
        norm_weight if norm_weight is not None else x,
        weight,
        logits,
        scratch.best_val,
        scratch.best_idx,
        scratch.counter,
        token if token is not None else scratch.counter,
        pos if pos is not None else scratch.counter,
        out_tokens if out_tokens is not None else scratch.counter,
        host_ring if host_ring is not None else scratch.counter,
        vocab,
        min(vocab_limit or vocab, vocab),
        eps,
        K=k,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        ROW_BLOCKS=row_blocks,
        GROUP=group,
        MAX_GROUPS=MAX_GROUPS,
        HAS_NORM=norm_weight is not None,
        GREEDY=greedy,
        RING=host_ring.numel() if host_ring is not None else 0,
        USE_PDL=use_pdl,
        num_warps=num_warps,
        **pdl_kwargs(use_pdl),
    )
    return logits
