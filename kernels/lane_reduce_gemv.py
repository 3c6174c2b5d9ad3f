"""o-proj / down-proj of every lane, fused with Laneformer's cross-lane reduction and the residual add.

    p[l, n]  = sum_k W[l, n, k] * act[l, k]                       (lane l's partial output; L = 1 for Llama)
    x[l, n] += r[l, n], with r chosen per layer (docs/laneformer.md, "Reduction"):
        SUM      r[l] = sum_m p[m]                                (layers i < d with early comm; L = 1; d = 0)
        DELAYED  r[l] = p[l] + sum_{m != l} p_past[m]             (p_past: the raw partials of layer i - d)
        SCALED   r[l] = sqrt(L) * p[l]                            (no communication)

A program owns a block of output rows n for *all* lanes, so every lane's partial for those rows is in its
registers and the reduction, whatever the layer, needs no second kernel and no atomics. The raw partials are
stored for layer i + d when it needs them ([L, N] fp32, tiny next to the weights). For one lane, and for DELAYED
launches of up to 4 lanes, the residual (and the other lanes' past partials) enter the sum over K as its first
term, loaded with the activations; the raw partial to keep is then that sum less the same term.

A launch may also cover a group of lanes only (lanes lane_start ... of the model's total): DELAYED and SCALED
need no partial of the other lanes from this layer, so groups of lanes can run as independent launches (the
runner's lane groups); the past partials are then summed over all lanes of the history.

Bytes: the weight once (L * N * K elements), act once per program (L1/L2 hits), x read and written once.
Grid: row blocks only; rows are split finely enough that every multiprocessor holds several programs.
With layer 0 the residual before the block is the embedding row of a token id that lives on the device.
"""

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kernels import interpreted, pdl_kwargs, sm_count
from kernels.peer_wait import wait_for_flags

SUM, DELAYED, SCALED = 0, 1, 2
MODES = {"sum": SUM, "delayed": DELAYED, "scaled": SCALED}


def check_lanes(mode: str, lanes: int, n: int, lane_start: int, total: int, history_out: torch.Tensor | None,
                history_in: torch.Tensor | None) -> None:  # fmt: skip
    """What a launch over lanes lane_start .. lane_start + lanes - 1 of `total` needs: a 'sum' all of them, the
    histories [total, n] fp32, a 'delayed' one history_in."""
    if not 0 <= lane_start <= total - lanes:
        raise ValueError(
            f"lane_start: lanes {lane_start} .. {lane_start + lanes - 1} are not within {total} lanes"
        )
    if mode == "sum" and total != lanes:
        raise ValueError(f"mode: 'sum' needs all {total} lanes in one launch, got {lanes}")
    for name, t in (("history_out", history_out), ("history_in", history_in)):
        if t is not None and (t.shape != (total, n) or not t.is_contiguous() or t.dtype != torch.float32):
            raise ValueError(
                f"{name}: expected a contiguous fp32 ({total}, {n}), got {t.dtype} {tuple(t.shape)}"
            )
    if mode == "delayed" and history_in is None:
        raise ValueError("history_in: required with mode 'delayed'")


@triton.jit
def _lane_reduce_gemv_kernel(
    act_ptr,
    stride_act_lane,
    w_ptr,
    x_ptr,
    embed_ptr,
    token_ptr,
    hist_out_ptr,
    hist_in_ptr,
    flags_ptr,
    epoch_ptr,
    status_ptr,
    post_rows_ptr,
    post_flags_ptr,
    post_row_offset,
    post_flag_offset,
    post_count_ptr,
    N,
    lane_scale,
    lane_start,
    K: tl.constexpr,
    LANES: tl.constexpr,
    LANES_P: tl.constexpr,
    TOTAL_LANES: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    MODE: tl.constexpr,
    X_FROM_TOKEN: tl.constexpr,
    STORE_HISTORY: tl.constexpr,
    PREFETCH: tl.constexpr,
    WAIT_P: tl.constexpr,
    WAIT_P_POW2: tl.constexpr,
    POST_P: tl.constexpr,
    USE_PDL: tl.constexpr,
    TRIGGER_EARLY: tl.constexpr,
):
    # Modes whose addend to x needs no partial of this layer but the lane's own: the residual (and, DELAYED, the
    # other lanes' past partials) can enter the sum over K (below). Not for 8 lanes in one launch (Laneformer on
    # one stream): the past rows held beside the tiles took the o-proj from 128 to 190 registers and the down-proj
    # from 158 to 255 with spills (sm_90), and one stream ran slower.
    FOLD_RESIDUAL: tl.constexpr = (LANES == 1 and MODE == 0) or (MODE == 1 and LANES_P <= 4)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    lanes = tl.arange(0, LANES_P)
    cols = tl.arange(0, BLOCK_K)
    lane_ok = lanes < LANES
    tile_ok = lane_ok[:, None] & (rows < N)[None, :]  # [LANES_P, BLOCK_N]
    w_offs = ((lanes[:, None] * N + rows[None, :]).to(tl.int64) * K)[:, :, None] + cols[None, None, :]

    # The first PREFETCH weight tiles are in flight before we wait for the kernel that produces act (weights are
    # read once per token: evict them first).
    if USE_PDL and TRIGGER_EARLY:  # the next kernel may launch now, beside this one (its loads too)
        gdc_launch_dependents()
    w_early = ()
    for i in tl.static_range(PREFETCH):
        w_mask = tile_ok[:, :, None] & (i * BLOCK_K + cols < K)[None, None, :]
        w_early = w_early + (
            tl.load(w_ptr + w_offs + i * BLOCK_K, mask=w_mask, other=0.0, eviction_policy="evict_first"),
        )
    if USE_PDL:
        gdc_wait()
        if not TRIGGER_EARLY:
            gdc_launch_dependents()
    if WAIT_P > 0:  # the past partials come from other devices: every program waits for their flags
        wait_for_flags(flags_ptr, epoch_ptr, status_ptr, 1 << 24, WAIT_P, WAIT_P_POW2)

    act_rows = act_ptr + lanes[:, None] * stride_act_lane  # [LANES_P, 1]
    lane_rows = lanes[:, None] * N + rows[None, :]  # [LANES_P, BLOCK_N] offsets into x
    acc = tl.zeros([LANES_P, BLOCK_N, BLOCK_K], dtype=tl.float32)
    hist_rows = lane_start * N + lane_rows  # this launch's lanes in the [TOTAL_LANES, N] history
    if FOLD_RESIDUAL:
        # The residual (DELAYED: plus the other lanes' past partials) enters the sum over K as one more term
        # (column 0 of the accumulator; the same value, another fp32 rounding order), loaded now with the
        # activations. Loaded for a final add instead, it came back one more dependent round trip to L2 after the
        # reduction over K, before the store, at the end of every o-proj and down-proj: ptxas issued that load
        # late, or Triton loaded it again in the reduction's layout (sm_90 SASS). Folded in, every model's step is
        # faster (docs/fast-path.md).
        base = _residual(x_ptr, embed_ptr, token_ptr, lane_rows, rows, tile_ok, N, X_FROM_TOKEN)
        if MODE == 1:
            base += _others_past(hist_in_ptr, hist_rows, rows, tile_ok, N, TOTAL_LANES)
        acc = tl.where((cols == 0)[None, None, :], base[:, :, None], acc)
    for i in tl.static_range(0, (K + BLOCK_K - 1) // BLOCK_K):
        k_ok = i * BLOCK_K + cols < K  # K is a constexpr: a multiple of 8 keeps the loads 16 bytes wide
        if i < PREFETCH:
            w = w_early[i]
        else:
            w_mask = tile_ok[:, :, None] & k_ok[None, None, :]
            w = tl.load(w_ptr + w_offs + i * BLOCK_K, mask=w_mask, other=0.0, eviction_policy="evict_first")
        a_mask = lane_ok[:, None] & k_ok[None, :]
        a = tl.load(act_rows + i * BLOCK_K + cols[None, :], mask=a_mask, other=0.0).to(tl.float32)
        acc += w.to(tl.float32) * a[:, None, :]
    sums = tl.sum(acc, axis=2)  # [LANES_P, BLOCK_N]: p, or base + p when folded; padded lanes are 0
    if FOLD_RESIDUAL:
        tl.store(x_ptr + lane_rows, sums, mask=tile_ok)
        if STORE_HISTORY:
            # The raw partial back out of the sum: off by at most an ulp of the residual, the rounding that the
            # residual's own fp32 store carries anyway.
            p = sums - base
            tl.store(hist_out_ptr + hist_rows, p, mask=tile_ok)
            if POST_P > 0:
                _post(p, hist_rows, tile_ok, post_rows_ptr, post_flags_ptr, post_row_offset, post_flag_offset,
                      epoch_ptr, post_count_ptr, POST_P)  # fmt: skip
        return

    p = sums
    if STORE_HISTORY:
        tl.store(hist_out_ptr + hist_rows, p, mask=tile_ok)
        if POST_P > 0:
            _post(p, hist_rows, tile_ok, post_rows_ptr, post_flags_ptr, post_row_offset, post_flag_offset,
                  epoch_ptr, post_count_ptr, POST_P)  # fmt: skip
    if MODE == 0:
        r = tl.zeros_like(p) + tl.sum(p, axis=0)[None, :]
    elif MODE == 1:  # DELAYED, 8 lanes in one launch
        r = p + _others_past(hist_in_ptr, hist_rows, rows, tile_ok, N, TOTAL_LANES)
    else:
        r = p * lane_scale
    old = _residual(x_ptr, embed_ptr, token_ptr, lane_rows, rows, tile_ok, N, X_FROM_TOKEN)
    tl.store(x_ptr + lane_rows, old + r, mask=tile_ok)


@triton.jit
def _post(p, hist_rows, tile_ok, rows_ptr, flags_ptr, row_offset, flag_offset, epoch_ptr, count_ptr,
          P: tl.constexpr):  # fmt: skip
    """The lane exchange's post (kernels/peer_post.py) in this launch: the program's partials into the same rows
    of every peer's history, then the last program to finish raises the slot's flag in every mailbox. Each
    program's stores are ordered before its count by a barrier and a release at system scope, and the last one
    acquires every count before its flags' releases: a reader that sees a flag sees every program's rows."""
    for peer in tl.static_range(P):
        dest = tl.load(rows_ptr + peer).to(tl.pointer_type(tl.float32)) + row_offset
        tl.store(dest + hist_rows, p, mask=tile_ok)
    tl.debug_barrier()
    done = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="sys")
    if done == tl.num_programs(0) - 1:
        epoch = tl.load(epoch_ptr)
        for peer in tl.static_range(P):
            flag = tl.load(flags_ptr + peer).to(tl.pointer_type(tl.int32)) + flag_offset
            tl.atomic_xchg(flag, epoch, sem="release", scope="sys")
        tl.store(count_ptr, 0)  # for the next step's launch of this slot


@triton.jit
def _others_past(hist_in_ptr, hist_rows, rows, tile_ok, N, TOTAL_LANES: tl.constexpr):
    """DELAYED's addend but for the lane's own fresh partial, fp32 [LANES_P, BLOCK_N]: sum_{m != l} p_past[m].
    Summed lane by lane from one row each, not as a reduction over a [TOTAL_LANES, BLOCK_N] tile: that one
    crossed warps through shared memory, and its barrier held back the weight loads of the sum over K (sm_90
    SASS)."""
    past_sum = tl.zeros_like(rows).to(tl.float32)
    for m in tl.static_range(TOTAL_LANES):
        past_sum += tl.load(hist_in_ptr + m * N + rows, mask=rows < N, other=0.0)
    return past_sum[None, :] - tl.load(hist_in_ptr + hist_rows, mask=tile_ok, other=0.0)


@triton.jit
def _residual(x_ptr, embed_ptr, token_ptr, lane_rows, rows, tile_ok, N, X_FROM_TOKEN: tl.constexpr):
    """The residual before the block at this program's rows, fp32 [LANES_P, BLOCK_N] (or [1, BLOCK_N]: with
    X_FROM_TOKEN every lane starts from the embedding row of the token on the device)."""
    if X_FROM_TOKEN:
        token = tl.load(token_ptr).to(tl.int64)
        old = tl.load(embed_ptr + token * N + rows, mask=rows < N, other=0.0).to(tl.float32)[None, :]
    else:
        old = tl.load(x_ptr + lane_rows, mask=tile_ok, other=0.0)
    return old


def _pick_blocks(lanes: int, n: int, k: int, device: torch.device) -> tuple[int, int, int]:
    if interpreted():  # programs run one after another there: few, large ones
        return min(64, triton.next_power_of_2(n)), min(128, triton.next_power_of_2(k)), 4
    lanes_p = triton.next_power_of_2(lanes)
    if lanes_p == 1 and k >= 2048:
        # One lane (the o-proj and down-proj of Llama / Qwen3): tiles of 8 warps x 64 elements a thread, as wide
        # as K allows (the largest power of two up to 4096 dividing K): wider tiles put more of a program's bytes
        # in flight at once, and beat the narrower tiles used before (docs/fast-path.md). Narrower or taller
        # tiles, or 4 warps, were no better; 256 programs still fill the GPU twice.
        block_k = 4096
        while k % block_k:
            block_k //= 2
        return max(1, 16384 // block_k), block_k, 8
    block_k = min(512, triton.next_power_of_2(k))
    while k % block_k and block_k > 64:  # avoid a half-masked last tile (K = 384 -> 128)
        block_k //= 2
    # With lanes, tiles at most 256 columns wide: laneformer-2b's down-proj (K 1536) as 4 rows x 256 columns
    # streams faster end to end than 4 x 512, most with all 8 lanes in one launch (8 rows, 8 warps, 2 x 512 or
    # 4 x 128: slower).
    if lanes_p > 1:
        block_k = min(block_k, 256)
    # With lanes, 4 rows (8 for short K) and four warps; one lane with a short K, 4 rows and four warps: the
    # fastest of the sweep (docs/fast-path.md).
    if lanes_p > 1:
        block_n, num_warps = (4 if k >= 1024 else 8), 4
    else:
        block_n, num_warps = 4, 4
    while block_n > 1 and triton.cdiv(n, block_n) < 2 * sm_count(device):
        block_n //= 2
    return block_n, block_k, num_warps


def lane_reduce_gemv(
    act: torch.Tensor,
    weight: torch.Tensor,
    x: torch.Tensor,
    *,
    mode: str = "sum",
    history_out: torch.Tensor | None = None,
    history_in: torch.Tensor | None = None,
    embedding: torch.Tensor | None = None,
    token: torch.Tensor | None = None,
    use_pdl: bool = False,
    trigger_early: bool = False,
    prefetch: int = 1,
    lane_start: int = 0,
    total_lanes: int | None = None,
    wait: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    post: tuple[torch.Tensor, torch.Tensor, int, int, torch.Tensor, torch.Tensor] | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """x[l] += r[l] from the lane partials p[l] = weight[l] @ act[l] (see the module docstring for `mode`).

    act: [L, K]; weight: [L, N, K]; x: [L, N] fp32, updated in place (with `embedding` [V, N] and `token`
    (int tensor [1] on the device), x is overwritten with embedding[token] + r instead: layer 0).
    history_out: [T, N] fp32 to store p in; history_in: [T, N] fp32, the partials of layer i - d (DELAYED).
    lane_start, total_lanes: act, weight and x hold lanes lane_start .. lane_start + L - 1 of the model's
    T = total_lanes (None: L, all of them); the histories hold all T. A group of lanes cannot take mode 'sum',
    which needs every lane's partial of this layer.
    prefetch: weight tiles ([L, block_n, block_k]) a program loads before it waits for act (at least 1; more
    than the rows' tiles means all of them).
    wait: (flags [P] int32, epoch [1] int32, status [1] int32): history_in's rows come from other devices through
    the lane exchange, and every program waits for the slot's flags first (kernels/peer_wait.py's wait_for_flags,
    status set if it gives up), so that no wait kernel stands between this launch and the one before.
    post: (row_table [P] int64, flag_table [P] int64, row_offset, flag_offset, epoch [1] int32, count [1] int32,
    zero before the first launch): history_out is a slot of the lane exchange's mailbox (row_offset: that slot's
    first element in every mailbox, flag_offset its flag's), and this launch posts it itself, as peer_post would
    after it; count is the slot's own (the last program resets it).
    """
    if weight.dim() != 3 or not weight.is_contiguous():
        raise ValueError(f"weight: expected a contiguous [L, N, K] tensor, got {tuple(weight.shape)}")
    lanes, n, k = weight.shape
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {', '.join(MODES)}, got {mode!r}")
    if act.shape != (lanes, k) or act.stride(1) != 1:
        raise ValueError(f"act: expected ({lanes}, {k}) with unit inner stride, got {tuple(act.shape)}")
    if x.shape != (lanes, n) or not x.is_contiguous() or x.dtype != torch.float32:
        raise ValueError(f"x: expected a contiguous fp32 ({lanes}, {n}), got {x.dtype} {tuple(x.shape)}")
    total = total_lanes or lanes
    check_lanes(mode, lanes, n, lane_start, total, history_out, history_in)
    if post is not None and history_out is None:
        raise ValueError("post: posts history_out, which this launch does not store")
    if post is not None and wait is not None and post[4] is not wait[1]:
        raise ValueError("post: its epoch must be the wait's (one exchange)")
    epoch = wait[1] if wait else post[4] if post else x
    if wait is not None and mode != "delayed":
        raise ValueError(f"wait: only a 'delayed' launch reads partials from other devices, not {mode!r}")
    if (embedding is None) != (token is None):
        raise ValueError("embedding: give both embedding and token, or neither")
    if embedding is not None and (
        embedding.dim() != 2 or embedding.shape[1] != n or not embedding.is_contiguous()
    ):
        raise ValueError(f"embedding: expected a contiguous [V, {n}] table, got {tuple(embedding.shape)}")

    auto_n, auto_k, auto_warps = _pick_blocks(lanes, n, k, weight.device)
    block_n, block_k, num_warps = block_n or auto_n, block_k or auto_k, num_warps or auto_warps
    if prefetch < 1:
        raise ValueError(f"prefetch: expected at least 1 tile, got {prefetch}")
    _lane_reduce_gemv_kernel[(triton.cdiv(n, block_n),)](
        act,
        act.stride(0),
        weight,
        x,
        embedding if embedding is not None else x,
        token if token is not None else x,
        history_out if history_out is not None else x,
        history_in if history_in is not None else x,
        wait[0] if wait else x,
        epoch,
        wait[2] if wait else x,
        *(post[:4] if post else (x, x, 0, 0)),
        post[5] if post else x,
        n,
        float(total) ** 0.5,
        lane_start,
        K=k,
        LANES=lanes,
        LANES_P=triton.next_power_of_2(lanes),
        TOTAL_LANES=total,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        MODE=MODES[mode],
        X_FROM_TOKEN=embedding is not None,
        STORE_HISTORY=history_out is not None,
        PREFETCH=min(prefetch, triton.cdiv(k, block_k)),
        WAIT_P=0 if wait is None else wait[0].numel(),
        WAIT_P_POW2=1 if wait is None else triton.next_power_of_2(wait[0].numel()),
        POST_P=0 if post is None else post[0].numel(),
        USE_PDL=use_pdl,
        TRIGGER_EARLY=trigger_early,
        num_warps=num_warps,
        **pdl_kwargs(use_pdl),
    )
    return x
