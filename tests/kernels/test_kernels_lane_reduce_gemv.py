import pytest
import torch

import kernels.lane_reduce_gemv as lane_reduce_module
from kernels.lane_reduce_gemv import lane_reduce_gemv
from tests.support.kernels import DEVICE, ON_GPU, assert_close, dtype_params, lane_reduction, poisoned, randn


def reference(act, weight, x, mode, history_in=None, base=None):
    """fp64: the lane partials, then the reduction of docs/laneformer.md, then the residual add."""
    p = torch.einsum("lnk,lk->ln", weight.double().cpu(), act.double().cpu())
    old = x.double().cpu() if base is None else base.double().cpu().expand_as(p)
    return old + lane_reduction(p, mode, history_in), p


def inputs(lanes: int, n: int, k: int, dtype: torch.dtype, mode: str):
    """act [L, K], weight [L, N, K], x [L, N] fp32, the past partials (DELAYED only) and a poisoned history_out."""
    history_in = randn(lanes, n) if mode == "delayed" else None
    return (randn(lanes, k, dtype=dtype), randn(lanes, n, k, dtype=dtype, scale=k**-0.5), randn(lanes, n),
            history_in, poisoned(lanes, n, dtype=torch.float32))  # fmt: skip


# (lanes, rows, K): one lane (Llama), a lane count that is not a power of two, odd sizes and round ones
SHAPES = [(1, 37, 40), (2, 24, 64), (3, 21, 48), (8, 16, 96)]


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("mode", ["sum", "delayed", "scaled"])
@pytest.mark.parametrize("lanes,n,k", SHAPES)
# the launcher's choice, small tiles, and tall tiles wider than K (the down-proj's shape of tile on a GPU)
@pytest.mark.parametrize("block_n,block_k", [(None, None), (4, 32), (8, 128)])
@pytest.mark.parametrize("prefetch", [1, 2, 64])  # weight tiles before the wait: one, two, all of them
def test_lane_reduce_gemv_matches_reference(dtype, mode, lanes, n, k, block_n, block_k, prefetch):
    act, w, x, history_in, history_out = inputs(lanes, n, k, dtype, mode)
    want_x, want_p = reference(act, w, x, mode, history_in)
    lane_reduce_gemv(act, w, x, mode=mode, history_out=history_out, history_in=history_in, block_n=block_n,
                     block_k=block_k, prefetch=prefetch)  # fmt: skip
    assert_close(x, want_x, dtype, "x")
    assert_close(history_out, want_p, dtype, "history_out")


@pytest.mark.parametrize("dtype", dtype_params())
def test_triggering_the_next_kernel_early_changes_no_bit(dtype):
    # trigger_early moves griddepcontrol.launch_dependents before the first loads (PDL on a GPU)
    act, w, x, _, _ = inputs(1, 48, 256, dtype, "sum")
    outs = []
    for early in (False, True):
        out = x.clone()
        lane_reduce_gemv(act, w, out, mode="sum", use_pdl=ON_GPU, trigger_early=early, prefetch=64)
        outs.append(out)
    assert_close(outs[0], reference(act, w, x, "sum")[0], dtype, "x")
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("mode", ["delayed", "scaled"])
@pytest.mark.parametrize("total,start,lanes", [(8, 4, 4), (8, 0, 2), (6, 3, 3), (4, 1, 1)])
def test_a_group_of_lanes_equals_those_lanes_of_one_launch(dtype, mode, total, start, lanes):
    # the runner's lane groups: lanes start .. start + lanes - 1 launched alone, reading every lane's past
    act, w, x, history_in, history_out = inputs(total, 24, 64, dtype, mode)
    want_x, want_p = reference(act, w, x, mode, history_in)
    group = slice(start, start + lanes)
    untouched = x.clone()
    lane_reduce_gemv(act[group], w[group], x[group], mode=mode, history_out=history_out, history_in=history_in,
                     lane_start=start, total_lanes=total)  # fmt: skip
    assert_close(x[group], want_x[group], dtype, "x")
    assert_close(history_out[group], want_p[group], dtype, "history_out")
    outside = torch.ones(total, dtype=torch.bool)
    outside[group] = False
    assert torch.equal(x[outside], untouched[outside])  # other lanes' residuals are not touched
    assert torch.isnan(history_out[outside]).all()  # nor their history rows (still poisoned)


@pytest.mark.parametrize("status", [0, 1])  # the peers' flags all posted; an exchange already broken
def test_a_launch_that_waits_for_the_peers_flags_adds_the_same_values(status):
    # a rank of lanes on several devices: every program waits for the slot's flags before reading history_in
    total, start, lanes = 4, 2, 2
    act, w, x, history_in, _ = inputs(total, 24, 64, torch.float32, "delayed")
    group = slice(start, start + lanes)
    want = x.clone()
    lane_reduce_gemv(act[group], w[group], want[group], mode="delayed", history_in=history_in, lane_start=start,
                     total_lanes=total)  # fmt: skip
    epoch = torch.tensor([5], dtype=torch.int32, device=DEVICE)
    flags = torch.full((2,), 5, dtype=torch.int32, device=DEVICE)
    if status:
        flags[1] = 4  # a peer that never posted: a wait would spin its whole bound, but the status says stop
    state = torch.tensor([status], dtype=torch.int32, device=DEVICE)
    lane_reduce_gemv(act[group], w[group], x[group], mode="delayed", history_in=history_in, lane_start=start,
                     total_lanes=total, wait=(flags, epoch, state))  # fmt: skip
    assert torch.equal(x, want) and state.item() == status


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("mode", ["sum", "delayed"])
def test_partials_stay_exact_beside_a_large_residual(dtype, mode):
    # DELAYED (and one lane's SUM) fold the residual into the sum over K and take the raw partial back out for
    # the history: that must cost no more than the residual's own rounding, even with x 64 times the partials.
    lanes = 4 if mode == "delayed" else 1
    act, w, x, history_in, history_out = inputs(lanes, 40, 96, dtype, mode)
    x *= 64
    want_x, want_p = reference(act, w, x, mode, history_in)
    lane_reduce_gemv(act, w, x, mode=mode, history_out=history_out, history_in=history_in)
    assert_close(x, want_x, dtype, "x")
    assert_close(history_out, want_p, dtype, "history_out")


@pytest.mark.parametrize("dtype", dtype_params())
def test_layer_zero_starts_from_the_embedding_row(dtype):
    lanes, n, k, vocab = 4, 40, 32, 9
    table = randn(vocab, n, dtype=dtype)
    act = randn(lanes, k, dtype=dtype)
    w = randn(lanes, n, k, dtype=dtype, scale=k**-0.5)
    x = poisoned(lanes, n, dtype=torch.float32)
    token = torch.tensor([5], dtype=torch.int64, device=DEVICE)
    lane_reduce_gemv(act, w, x, mode="sum", embedding=table, token=token)
    want_x, _ = reference(act, w, None, "sum", base=table[5:6])
    assert_close(x, want_x, dtype, "x")


def test_launcher_picks_the_measured_blocks_on_a_gpu(monkeypatch):
    """The H200 sweep's choices (docs/fast-path.md), as the launcher would make them on 132 SMs."""
    monkeypatch.setattr(lane_reduce_module, "interpreted", lambda: False)
    monkeypatch.setattr(lane_reduce_module, "sm_count", lambda device: 132)
    pick = lane_reduce_module._pick_blocks
    cpu = torch.device("cpu")
    assert pick(1, 2048, 8192, cpu) == (4, 4096, 8)  # llama-3.2-1b down-proj
    assert pick(1, 2048, 6144, cpu) == (8, 2048, 8)  # qwen3-1.7b down-proj
    assert pick(8, 3072, 1536, cpu) == (4, 256, 4)  # laneformer-2b down-proj
    assert pick(4, 3072, 1536, cpu) == (4, 256, 4)  # the same in the runner's lane groups of 4 lanes
    assert pick(8, 3072, 384, cpu) == (8, 128, 4)  # laneformer-2b o-proj: K 384 in tiles of 128
    assert pick(1, 2048, 2048, cpu) == (8, 2048, 8)  # llama-3.2-1b and qwen3-1.7b o-proj
    assert pick(1, 1536, 1024, cpu) == (4, 512, 4)  # a short K: 4 rows of 512 on 4 warps


def test_strided_act_and_explicit_blocks():
    lanes, n, k = 2, 30, 100
    act = randn(lanes, 2 * k)[:, :k]  # a view into a wider buffer
    w = randn(lanes, n, k, scale=0.1)
    x = randn(lanes, n)
    want_x, _ = reference(act, w, x, "scaled")
    lane_reduce_gemv(act, w, x, mode="scaled", block_n=4, block_k=32, num_warps=2)
    assert_close(x, want_x, torch.float32, "x")


def test_rejects_bad_arguments():
    w = randn(2, 8, 16)
    x = randn(2, 8)
    with pytest.raises(ValueError, match="mode:"):
        lane_reduce_gemv(randn(2, 16), w, x, mode="mean")
    with pytest.raises(ValueError, match="history_in:"):
        lane_reduce_gemv(randn(2, 16), w, x, mode="delayed")
    with pytest.raises(ValueError, match="x:"):
        lane_reduce_gemv(randn(2, 16), w, x.half())
    with pytest.raises(ValueError, match="act:"):
        lane_reduce_gemv(randn(3, 16), w, x)
    with pytest.raises(ValueError, match="prefetch:"):
        lane_reduce_gemv(randn(2, 16), w, x, prefetch=0)
    with pytest.raises(ValueError, match="lane_start:"):
        lane_reduce_gemv(randn(2, 16), w, x, mode="scaled", lane_start=3, total_lanes=4)
    with pytest.raises(ValueError, match="'sum' needs all 4 lanes"):
        lane_reduce_gemv(randn(2, 16), w, x, mode="sum", lane_start=2, total_lanes=4)
    with pytest.raises(ValueError, match="history_in: expected a contiguous fp32 \\(4, 8\\)"):
        lane_reduce_gemv(randn(2, 16), w, x, mode="delayed", history_in=randn(2, 8), total_lanes=4)
    with pytest.raises(ValueError, match="wait: only a 'delayed' launch"):
        flags = torch.zeros(2, dtype=torch.int32, device=DEVICE)
        lane_reduce_gemv(randn(2, 16), w, x, mode="scaled", wait=(flags, flags[:1], flags[:1]))
