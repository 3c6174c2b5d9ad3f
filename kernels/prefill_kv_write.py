"""Prefill's KV-cache write: every prompt position's key, rotated (and q/k-normed), and its value, from the
q|k|v matmul output into the layer's cache, where the decode kernels and kernels/prefill_attention.py read
them.

For KV head g (lane l = g // (KV/L), heads are lane-major) and every position t < T:
    k_cache[g, t] = rope(qknorm(k[l, t, g % (KV/L)]), t)      v_cache[g, t] = v[l, t, g % (KV/L)]
rounded as model.py rounds them (the norm's output and the rotated key in the cache dtype). RoPE rotates dim d
with its partner: d ^ 1 (interleaved pairs, the runner's layout) or d +- hd/2 (rotate-half).

Why a separate launch rather than rotating keys inside the attention kernel: every key block is read by
every query block after it (T / BLOCK_M of them), so rotating on the fly repeats the cos/sin loads, the
partner gather and the norm ~T / BLOCK_M times per key, in the attention kernel's inner loop; rotated once
here, the attention kernel streams plain [BLOCK_N, hd] rows of the cache (contiguous per KV head), and the
cache has to be written anyway. Grid: (cdiv(T, BLOCK_T), KV).

Bytes (laneformer-2b, T = 4,094, bf16): k and v read from qkv and written to the cache once,
2 * 16 heads * 4,094 * 96 * 2 B = 25 MB each way, 50 MB (cos/sin come from L2).
"""

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kernels import pdl_kwargs
from kernels.rope import rope_pairing


@triton.jit
def head_rstd(ptr, rows, row_ok, eps, HD: tl.constexpr, HDP: tl.constexpr):
    """1 / rms of the head rows at ptr + rows[r] (rows [R] int offsets, row_ok [R] mask): [R] fp32."""
    d = tl.arange(0, HDP)
    x = tl.load(ptr + rows[:, None] + d[None, :], mask=row_ok[:, None] & (d < HD)[None, :], other=0.0)
    x = x.to(tl.float32)
    return 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / HD + eps)


@triton.jit
def rope_rows(
    ptr,
    rows,
    row_ok,
    pos,
    cos_ptr,
    sin_ptr,
    norm_ptr,
    rstd,
    HD: tl.constexpr,
    D0: tl.constexpr,
    WIDTH: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    QK_NORM: tl.constexpr,
):
    """Dims D0 .. D0 + WIDTH - 1 of the head rows at ptr + rows[r] (rows [R] int offsets, row_ok [R] mask,
    pos [R] positions), normed (QK_NORM: with rstd [R] from head_rstd and the weight at norm_ptr) and
    rotated: [R, WIDTH] fp32 holding values of ptr's dtype; dims >= HD and rows not ok are zero.

    Rounded as model.py does: rms_norm's normalised value, then its product with the weight, then the rotated
    value, each in ptr's dtype (the rotation itself in fp32)."""
    d = D0 + tl.arange(0, WIDTH)
    d_ok = d < HD
    partner, pair, first = rope_pairing(d, HD, INTERLEAVED)
    mask = row_ok[:, None] & d_ok[None, :]
    x_raw = tl.load(ptr + rows[:, None] + d[None, :], mask=mask, other=0.0)
    dtype = x_raw.dtype
    x = x_raw.to(tl.float32)
    x_partner = tl.load(ptr + rows[:, None] + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    if QK_NORM:
        w = tl.load(norm_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
        w_partner = tl.load(norm_ptr + partner, mask=d_ok, other=0.0).to(tl.float32)
        x = (w[None, :] * (x * rstd[:, None]).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        x_partner = (w_partner[None, :] * (x_partner * rstd[:, None]).to(dtype).to(tl.float32)).to(dtype)
        x_partner = x_partner.to(tl.float32)
    table = pos[:, None] * (HD // 2) + pair[None, :]
    cos = tl.load(cos_ptr + table, mask=mask, other=0.0)
    sin = tl.load(sin_ptr + table, mask=mask, other=0.0)
    sign = tl.where(first, -1.0, 1.0)
    return (x * cos + sign[None, :] * x_partner * sin).to(dtype).to(tl.float32)


@triton.jit(do_not_specialize=["start"])  # a reused prefix's length varies: no compile per its divisibility
def _prefill_kv_write_kernel(
    qkv_ptr,
    stride_qkv_lane,
    stride_qkv_t,
    k_cache_ptr,
    v_cache_ptr,
    cos_ptr,
    sin_ptr,
    k_norm_ptr,
    T,
    start,
    start_ptr,
    heads_per_lane,
    kv_per_lane,
    max_len,
    eps,
    HD: tl.constexpr,
    HDP: tl.constexpr,
    BLOCK_T: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    QK_NORM: tl.constexpr,
    START_PTR: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:  # every program waits: the chain of dependencies stays transitive
        gdc_wait()
        gdc_launch_dependents()
    if START_PTR:  # a graph's replays: the host writes start into a device scalar before each
        start = tl.load(start_ptr).to(tl.int32)
    kv = tl.program_id(1)
    lane = kv // kv_per_lane
    kv_in_lane = kv % kv_per_lane
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < T
    d = tl.arange(0, HDP)
    mask = t_ok[:, None] & (d < HD)[None, :]
    lane_qkv = qkv_ptr + lane.to(tl.int64) * stride_qkv_lane
    rows = t * stride_qkv_t  # [BLOCK_T]
    k_cols = lane_qkv + (heads_per_lane + kv_in_lane) * HD
    rstd = eps  # unused without the norm
    if QK_NORM:
        rstd = head_rstd(k_cols, rows, t_ok, eps, HD, HDP)
    p = start + t  # qkv row t is position start + t: its RoPE angle and its cache row
    k = rope_rows(k_cols, rows, t_ok, p, cos_ptr, sin_ptr, k_norm_ptr, rstd, HD, 0, HDP, INTERLEAVED, QK_NORM)
    v_cols = lane_qkv + (heads_per_lane + kv_per_lane + kv_in_lane) * HD + d[None, :]
    v = tl.load(v_cols + rows[:, None], mask=mask, other=0.0)
    cache = kv.to(tl.int64) * max_len * HD + p[:, None] * HD + d[None, :]  # [BLOCK_T, HDP]
    tl.store(k_cache_ptr + cache, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + cache, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def start_args(start: int | torch.Tensor, dummy: torch.Tensor) -> tuple[int, torch.Tensor]:
    """The kernels' (start, start_ptr): the int and an unread pointer, or 0 and the device scalar to load."""
    return (0, start) if isinstance(start, torch.Tensor) else (start, dummy)


def check_prefill_layout(
    qkv: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    start: int | torch.Tensor = 0,
) -> tuple[int, int, int, int]:
    """The argument checks prefill_kv_write and prefill_attention share: (lanes, T, H/L, KV/L), or a ValueError
    naming the argument. Positions start .. start + T - 1 (start > 0: a prompt's part after a reused prefix).
    start as a device tensor [1] (a graph's, read by the kernels at each replay): its bounds are the caller's."""
    if (
        k_cache.dim() != 3
        or k_cache.shape != v_cache.shape
        or k_cache.dtype != v_cache.dtype
        or not (k_cache.is_contiguous() and v_cache.is_contiguous())
    ):
        raise ValueError(
            f"k_cache: expected a contiguous [KV, max_len, hd] like v_cache, got {tuple(k_cache.shape)}"
        )
    num_kv, max_len, hd = k_cache.shape
    if hd % 2 or hd > 256:
        raise ValueError(f"k_cache: head_dim must be even and at most 256 (RoPE pairs), got {hd}")
    if qkv.dim() != 3 or qkv.stride(2) != 1:
        raise ValueError(f"qkv: expected [L, T, (H/L + 2 KV/L) * hd] with a contiguous last dim, got "
                         f"{tuple(qkv.shape)}")  # fmt: skip
    lanes, T = qkv.shape[0], qkv.shape[1]
    if num_heads <= 0 or num_heads % num_kv or num_heads % lanes or num_kv % lanes:
        raise ValueError(
            f"num_heads: {num_heads} must be a multiple of the KV heads ({num_kv}) and of the lanes ({lanes})"
        )
    heads_per_lane, kv_per_lane = num_heads // lanes, num_kv // lanes
    if qkv.shape[2] != (heads_per_lane + 2 * kv_per_lane) * hd:
        raise ValueError(
            f"qkv: expected [{lanes}, T, {(heads_per_lane + 2 * kv_per_lane) * hd}], got {tuple(qkv.shape)}"
        )
    if isinstance(start, torch.Tensor):
        if start.numel() != 1 or start.dtype not in (torch.int32, torch.int64) or start.device != qkv.device:
            raise ValueError(
                f"start: expected one int32/int64 on qkv's device, got {start.dtype} {tuple(start.shape)}"
            )
        start = 0  # unknown until the launch: the caller keeps start + T within the cache and the RoPE tables
    elif not isinstance(start, int) or start < 0:
        raise ValueError(f"start: expected an integer >= 0, got {start!r}")
    if not 0 < T <= max_len - start:
        raise ValueError(f"qkv: T = {T} positions from {start} must fit max_len = {max_len} of the cache")
    if qkv.dtype != k_cache.dtype:
        raise ValueError(f"k_cache: dtype {k_cache.dtype} must be qkv's ({qkv.dtype})")
    if (
        cos.shape != sin.shape
        or cos.dim() != 2
        or cos.shape[1] != hd // 2
        or cos.shape[0] < start + T
        or cos.dtype != torch.float32
        or sin.dtype != torch.float32
        or not (cos.is_contiguous() and sin.is_contiguous())
    ):
        raise ValueError(
            f"cos: expected contiguous fp32 [>= {start + T}, {hd // 2}] like sin, got {cos.dtype} {tuple(cos.shape)}"
        )
    for name, norm in (("q_norm", q_norm), ("k_norm", k_norm)):
        if norm is not None and (norm.shape != (hd,) or not norm.is_contiguous()):
            raise ValueError(f"{name}: expected a contiguous [{hd}], got {tuple(norm.shape)}")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm: q_norm and k_norm come together (Qwen3) or not at all")
    return lanes, T, heads_per_lane, kv_per_lane


def prefill_kv_write(
    qkv: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    num_heads: int,
    interleaved: bool = True,
    k_norm: torch.Tensor | None = None,
    eps: float = 1e-6,
    block_t: int | None = None,
    start: int | torch.Tensor = 0,
) -> None:
    """Write the rotated keys and the values of positions start .. start + T - 1 into the cache.

    qkv: [L, T, (H/L + 2 KV/L) * hd], per lane and position: q heads, then k heads, then v heads (before RoPE).
    k_cache, v_cache: [KV, max_len, hd] of this layer (max_len >= start + T). cos, sin: [>= start + T, hd/2] fp32.
    k_norm: [hd] (Qwen3's norm of each key head before RoPE) or None. start: an int, or a device int tensor [1]
    read at launch (a CUDA graph replays with whatever the host wrote there; start + T must fit the cache).
    """
    check_prefill_layout(qkv, k_cache, v_cache, cos, sin, num_heads, k_norm, k_norm, start)
    launch_prefill_kv_write(qkv, k_cache, v_cache, cos, sin, num_heads=num_heads, interleaved=interleaved,
                            k_norm=k_norm, eps=eps, block_t=block_t, start=start)  # fmt: skip


def launch_prefill_kv_write(
    qkv: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    num_heads: int,
    interleaved: bool,
    k_norm: torch.Tensor | None,
    eps: float,
    block_t: int | None = None,
    start: int | torch.Tensor = 0,
    use_pdl: bool = False,
) -> None:
    """prefill_kv_write on arguments check_prefill_layout has already accepted (prefill_attention's)."""
    lanes, T = qkv.shape[0], qkv.shape[1]
    num_kv, max_len, hd = k_cache.shape
    heads_per_lane, kv_per_lane = num_heads // lanes, num_kv // lanes
    hdp = max(16, triton.next_power_of_2(hd))
    # 16 positions a program: more, smaller programs keep more of them in flight (docs/fast-path.md)
    block_t = block_t or 16
    _prefill_kv_write_kernel[(triton.cdiv(T, block_t), num_kv)](
        qkv,
        qkv.stride(0),
        qkv.stride(1),
        k_cache,
        v_cache,
        cos,
        sin,
        k_norm if k_norm is not None else cos,
        T,
        *start_args(start, cos),
        heads_per_lane,
        kv_per_lane,
        max_len,
        eps,
        HD=hd,
        HDP=hdp,
        BLOCK_T=block_t,
        INTERLEAVED=interleaved,
        QK_NORM=k_norm is not None,
        START_PTR=isinstance(start, torch.Tensor),
        USE_PDL=use_pdl,
        num_warps=8,
        **pdl_kwargs(use_pdl),
    )
