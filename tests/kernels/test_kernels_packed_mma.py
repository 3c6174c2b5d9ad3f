"""kernels/packed_mma_gemv.py: the 12-bit tensor-core layout gives back every bit, and out += W @ act is the bf16
matrix's product, exceptions included (the interpreter's sums in the mma's place on the CPU; the mma on a GPU)."""

import pytest
import torch

from kernels.packed_mma_gemv import (
    fits,
    move,
    pack_glu,
    pack_mma,
    packed_glu_gemv,
    packed_lane_reduce_gemv,
    packed_mma_gemv,
    pick_split,
    placeholder,
    unpack_mma,
)
from tests.support.kernels import DEVICE, ON_GPU, assert_close, poisoned, randn


def awkward_matrix(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """A bf16 [n, k] matrix of random weights with the values the 12-bit layout must still hold exactly: zeros of
    both signs, weights far under the row's largest (exceptions; one row has 40 of them, the rest a few), a
    subnormal, an outlier, an all-zero row, infinities."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * k**-0.5
    w[0, : min(k, 40)] = 1e-9  # 40 exceptions in one row: the others' padding is masked
    w[1, 3], w[1, 5] = 0.0, -0.0
    w[2, 7] = -3e-39  # subnormal in bf16
    w[3] = 0.0
    w[4, 1] = 300.0  # an outlier: the rest of its row sits lower in the window, a few fall out of it
    w = w.to(torch.bfloat16)
    return w


def with_infinities(w: torch.Tensor) -> torch.Tensor:
    w = w.clone()
    w[5, 0], w[5, 1] = float("inf"), float("-inf")
    return w


# (rows, K): one tile and chunk; odd numbers of tiles and chunks; qwen3-1.7b's down-proj's K
SHAPES = [(16, 64), (48, 192), (64, 512), (32, 6144)]
# bf16 act runs on the GPU only (the interpreter reads it through its int32 view, but the reference's rounding of
# the inputs is the GPU's); fp32 act on both
ACT_DTYPES = [torch.float32] + ([pytest.param(torch.bfloat16, marks=pytest.mark.gpu)] if ON_GPU else [])


@pytest.mark.parametrize("n,k", SHAPES)
def test_pack_then_unpack_gives_back_every_bit(n, k):
    w = with_infinities(awkward_matrix(n, k))
    packed = pack_mma(w)
    assert torch.equal(unpack_mma(packed).view(torch.int16), w.view(torch.int16))
    assert packed.exceptions >= min(k, 40)  # row 0's at least
    assert sum(packed.tile_exceptions) == packed.exceptions


def test_a_random_matrix_takes_three_quarters_of_its_bf16_bytes():
    gen = torch.Generator().manual_seed(1)
    w = (torch.randn(512, 2048, generator=gen) * 2048**-0.5).to(torch.bfloat16)
    packed = pack_mma(w)
    assert packed.exceptions < 1e-3 * w.numel()
    assert packed.nbytes() < 0.76 * w.numel() * 2


def reference(w: torch.Tensor, act: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """fp64 on the CPU: x + W @ act."""
    return x.double().cpu() + w.double().cpu() @ act.double().cpu()


@pytest.mark.parametrize("act_dtype", ACT_DTYPES)
@pytest.mark.parametrize("n,k", SHAPES)
# the launcher's choices; all of K in one program (up to 8 chunks: the loop over them is unrolled), one M-tile;
# one chunk ahead
@pytest.mark.parametrize("split,block_m,ahead", [(None, None, 8), ("whole", 1, 8), (None, 1, 1)])
def test_the_product_adds_the_bf16_matrix_times_act(act_dtype, n, k, split, block_m, ahead):
    if split == "whole":
        split = max(1, k // 512)
    w = awkward_matrix(n, k)
    act = randn(k, dtype=act_dtype, scale=2.0)
    x = randn(n, scale=4.0)  # the residual it adds into
    out = x.clone()
    packed_mma_gemv(act, move(pack_mma(w), DEVICE), out, split=split, block_m=block_m, ahead=ahead)
    assert_close(out - x, reference(w, act, x) - x.double().cpu(), torch.float32)


@pytest.mark.parametrize("act_dtype", ACT_DTYPES)
@pytest.mark.parametrize("n,k,block_m", [(64, 512, 2), (64, 512, 4), (32, 6144, 2)])
def test_programs_of_several_m_tiles(act_dtype, n, k, block_m):
    w = awkward_matrix(n, k, seed=5)
    act = randn(k, dtype=act_dtype)
    out = torch.zeros(n, device=DEVICE)
    packed_mma_gemv(act, move(pack_mma(w), DEVICE), out, block_m=block_m, split=2)
    assert_close(out, reference(w, act, torch.zeros(n)), torch.float32)


@pytest.mark.parametrize("act_dtype", ACT_DTYPES)
@pytest.mark.parametrize(
    "n,k,block_m,items,ahead", [(64, 512, 1, 4, 2), (64, 512, 2, 2, 8), (96, 192, 1, 3, 1)]
)
def test_programs_that_take_several_items_in_turn(act_dtype, n, k, block_m, items, ahead):
    """A program's blocks of M-tiles in turn, its chunks one stream across them (ahead past an item's end)."""
    w = awkward_matrix(n, k, seed=11)
    act = randn(k, dtype=act_dtype)
    out = torch.zeros(n, device=DEVICE)
    packed_mma_gemv(act, move(pack_mma(w), DEVICE), out, block_m=block_m, items=items, split=2 if k == 512 else 3,
                    ahead=ahead)  # fmt: skip
    assert_close(out, reference(w, act, torch.zeros(n)), torch.float32)


@pytest.mark.parametrize("act_dtype", ACT_DTYPES)
def test_an_exception_adds_its_true_weight_not_the_floor_it_decodes_to(act_dtype):
    """act nonzero at the exceptions' columns only: without their correction each row would add its floor."""
    n, k = 32, 256
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(n, k, generator=gen) * k**-0.5
    w[5, 7], w[20, 7], w[20, 130], w[31, 255] = 3e-9, -2e-10, 0.0, 1e-8  # far under their rows' largest
    w = w.to(torch.bfloat16)
    packed = pack_mma(w)
    assert packed.exceptions >= 4
    act = torch.zeros(k)
    act[[7, 130, 255]] = torch.tensor([1e6, -3e6, 2e6])
    for split in (1, 4):  # the exceptions of a tile in one program, or shared over four
        out = torch.zeros(n, device=DEVICE)
        packed_mma_gemv(act.to(act_dtype).to(DEVICE), move(packed, DEVICE), out, split=split)
        want = w.double() @ act.to(act_dtype).double()
        assert_close(out, want, torch.float32)
        assert out[20].item() == pytest.approx(want[20].item(), rel=1e-5, abs=1e-9)


@pytest.mark.parametrize("n,k,split,items", [(48, 192, None, 1), (64, 2048, 8, 1), (64, 2048, 2, 2)])
def test_the_normed_input_is_the_residual_times_its_norm_weight(n, k, split, items):
    """The gate/up's launch: out += W @ (x * g), and the norm's scalar for its reader written once."""
    w = awkward_matrix(n, k, seed=6)
    x = randn(k, scale=3.0)
    g = (randn(k).abs() + 0.5).to(torch.bfloat16)
    out = torch.zeros(n, device=DEVICE)
    rstd = torch.full((1,), -1.0, device=DEVICE)
    packed_mma_gemv(x, move(pack_mma(w), DEVICE), out, norm_weight=g, eps=1e-5, rstd=rstd, split=split,
                    block_m=1, items=items)  # fmt: skip
    xd, gd = x.double().cpu(), g.double().cpu()
    assert_close(out, w.double() @ (xd * gd), torch.float32)
    assert rstd.item() == pytest.approx((1 / (xd.pow(2).mean() + 1e-5).sqrt()).item(), rel=1e-6)


@pytest.mark.parametrize("n,k", [(48, 192), (32, 6144)])
@pytest.mark.parametrize("glu", [torch.bfloat16, torch.float32])
def test_the_glu_input_is_silu_of_the_scaled_gate_times_up(n, k, glu):
    """The down-proj's launch after a packed gate/up: B = silu(rstd * gate) * (rstd * up), rounded to the model's
    activations' dtype as the reference model rounds them, from the fp32 sums [2K] (gate, then up)."""
    w = awkward_matrix(n, k, seed=7)
    sums = randn(2 * k, scale=2.0)
    rstd = torch.full((1,), 0.75, device=DEVICE)
    x = randn(n)
    out = x.clone()
    packed_mma_gemv(sums, move(pack_mma(w), DEVICE), out, glu=glu, rstd=rstd)
    gate, up = 0.75 * sums.double().cpu()[:k], 0.75 * sums.double().cpu()[k:]
    h = (torch.nn.functional.silu(gate) * up).to(glu)
    assert_close(out - x, w.double() @ h.double(), torch.float32)


def test_a_normed_then_glu_pair_is_the_mlp_of_the_reference():
    """gate/up then down-proj as the runner chains them (the o-proj's launch clearing the sums), against
    x + W2 @ (silu(W1 @ n) * (W3 @ n)), n = rmsnorm(x) * g."""
    d, f = 128, 192
    w13 = awkward_matrix(2 * f, d, seed=8)
    w2 = awkward_matrix(d, f, seed=9)
    x = randn(d, scale=2.0)
    g = (randn(d).abs() + 0.5).to(torch.bfloat16)
    sums = torch.full((2 * f,), 5.0, device=DEVICE)  # stale: a previous layer's
    rstd = torch.zeros(1, device=DEVICE)
    packed_mma_gemv(randn(d), move(pack_mma(awkward_matrix(d, d, seed=10)), DEVICE), torch.zeros(d, device=DEVICE),
                    zero=sums)  # fmt: skip
    out = x.clone()
    packed_mma_gemv(x, move(pack_mma(w13), DEVICE), sums, norm_weight=g, eps=1e-6, rstd=rstd)
    packed_mma_gemv(sums, move(pack_mma(w2), DEVICE), out, glu=torch.bfloat16, rstd=rstd)
    xd = x.double().cpu()
    normed = xd * torch.rsqrt(xd.pow(2).mean() + 1e-6) * g.double().cpu()
    both = w13.double() @ normed
    h = torch.nn.functional.silu(both[:f]) * both[f:]
    assert_close(out - x, w2.double() @ h, torch.bfloat16)


def lane_mlp_input(lanes: int, f: int, k: int, seed: int):
    """x [L, K] fp32, g [L, K] bf16 and every lane's gate and up [L, F, K] bf16 (awkward: exceptions included)."""
    w1 = torch.stack([awkward_matrix(f, k, seed=seed + 2 * lane) for lane in range(lanes)])
    w3 = torch.stack([awkward_matrix(f, k, seed=seed + 2 * lane + 1) for lane in range(lanes)])
    x = randn(lanes, k, scale=3.0)
    g = (randn(lanes, k).abs() + 0.5).to(torch.bfloat16)
    return x, g, w1, w3


def lane_glu_reference(x, g, w1, w3, eps):
    """fp64 on the CPU: silu(W1[l] @ n[l]) * (W3[l] @ n[l]), n[l] = rmsnorm(x[l]) * g[l]."""
    xd = x.double().cpu()
    n = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * g.double().cpu()
    gate = torch.einsum("lfk,lk->lf", w1.double(), n)
    up = torch.einsum("lfk,lk->lf", w3.double(), n)
    return torch.nn.functional.silu(gate) * up


# h in bf16 on the GPU only (the interpreter's bf16 rounding is not the GPU's)
H_DTYPES = [torch.float32] + ([pytest.param(torch.bfloat16, marks=pytest.mark.gpu)] if ON_GPU else [])
# one lane; three lanes of three M-tiles; a program of 2 M-tiles, one chunk ahead; K of 48 chunks
LANE_SHAPES = [(1, 8, 64, None, 8), (3, 24, 192, 1, 8), (2, 32, 128, 2, 1), (2, 8, 3072, 1, 4)]


@pytest.mark.parametrize("h_dtype", H_DTYPES)
@pytest.mark.parametrize("lanes,f,k,block_m,ahead", LANE_SHAPES)
def test_a_lanes_fused_gate_up_is_silu_of_its_normed_products(h_dtype, lanes, f, k, block_m, ahead):
    """Every lane's gate/up in one launch, each reading its own row of x, of the norm weight and its own rstd,
    the exceptions added before the SiLU, every element of h stored."""
    x, g, w1, w3 = lane_mlp_input(lanes, f, k, seed=20)
    h = poisoned(lanes, f, dtype=h_dtype)
    packed = pack_glu(w1, w3)
    assert packed.exceptions >= lanes * 2 * min(k, 40)  # every matrix's row 0
    packed_glu_gemv(x, move(packed, DEVICE), h, g, eps=1e-5, block_m=block_m, ahead=ahead)
    assert_close(h, lane_glu_reference(x, g, w1, w3, 1e-5), h_dtype)


def test_a_lanes_gate_up_packs_its_rows_by_eight():
    """pack_glu's matrix: each lane's 16-row tiles hold 8 gate rows, then the same 8 rows of the up."""
    x, g, w1, w3 = lane_mlp_input(2, 16, 64, seed=30)
    rows = unpack_mma(pack_glu(w1, w3)).view(2, 2, 2, 8, 64)  # [lane, tile, gate|up, row, K]
    assert torch.equal(rows[:, :, 0].reshape(2, 16, 64).view(torch.int16), w1.view(torch.int16))
    assert torch.equal(rows[:, :, 1].reshape(2, 16, 64).view(torch.int16), w3.view(torch.int16))


def test_the_fused_launcher_refuses_mismatched_arguments():
    x, g, w1, w3 = lane_mlp_input(2, 8, 64, seed=40)
    packed = move(pack_glu(w1, w3), DEVICE)
    h = torch.zeros(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="w1, w3: expected"):
        pack_glu(w1, w3[:, :4])
    with pytest.raises(ValueError, match="blocks of 8 rows"):
        pack_glu(w1[:, :4], w3[:, :4])
    with pytest.raises(ValueError, match="packed: "):  # 3 lanes cannot share 2 lanes' rows
        packed_glu_gemv(torch.zeros(3, 64, device=DEVICE), packed, torch.zeros(3, 8, device=DEVICE),
                        torch.ones(3, 64, dtype=torch.bfloat16, device=DEVICE))  # fmt: skip
    with pytest.raises(ValueError, match="x: expected"):
        packed_glu_gemv(x.half(), packed, h, g)
    with pytest.raises(ValueError, match="norm_weight"):
        packed_glu_gemv(x, packed, h, g.float())
    with pytest.raises(ValueError, match="h: expected"):
        packed_glu_gemv(x, packed, h[:, :4], g)
    with pytest.raises(ValueError, match="block_m"):  # a lane has one M-tile
        packed_glu_gemv(x, packed, h, g, block_m=2)


def lane_reduce_reference(w, act, x, mode, history_in, lane_start, total):
    """fp64 on the CPU: (x after lane_reduce_gemv's rule, the raw partials p[l] = W[l] @ act[l])."""
    p = torch.einsum("lnk,lk->ln", w.double(), act.double().cpu())
    x = x.double().cpu()
    if mode == "scaled":
        return x + total**0.5 * p, p
    past = history_in.double().cpu()
    lanes = torch.arange(lane_start, lane_start + w.shape[0])
    return x + p + past.sum(0) - past[lanes], p


# (lanes of the launch, total lanes, lane_start, N, K, block_m): every lane; a group of the last two of three
# lanes (histories over all three); one M-tile a lane, 48 chunks; a program of two M-tiles
REDUCE_SHAPES = [
    (2, 2, 0, 32, 128, None),
    (2, 3, 1, 48, 192, 1),
    (4, 4, 0, 16, 3072, 1),
    (1, 2, 1, 64, 64, 2),
]


@pytest.mark.parametrize("act_dtype", ACT_DTYPES)
@pytest.mark.parametrize("mode", ["delayed", "scaled"])
@pytest.mark.parametrize("lanes,total,lane_start,n,k,block_m", REDUCE_SHAPES)
def test_a_lane_reduced_product_adds_the_rule_of_its_mode(
    act_dtype, mode, lanes, total, lane_start, n, k, block_m
):
    """A Laneformer's o-proj or down-proj in 12 bits: each lane's product, its exceptions included, reduced
    into its own residual row by the delayed or scaled rule, the raw partials kept for the layer d on (a scaled
    layer's too: a delayed one may read them)."""
    w = torch.stack([awkward_matrix(n, k, seed=50 + lane) for lane in range(lanes)])
    act = randn(lanes, k, dtype=act_dtype, scale=2.0)
    x = randn(lanes, n, scale=4.0)
    history_in, history_out = randn(total, n, scale=3.0), poisoned(total, n, dtype=torch.float32)
    out = x.clone()
    packed = move(pack_mma(w.reshape(lanes * n, k)), DEVICE)
    packed_lane_reduce_gemv(act, packed, out, mode=mode, history_out=history_out, history_in=history_in,
                            lane_start=lane_start, total_lanes=total, block_m=block_m)  # fmt: skip
    want, partials = lane_reduce_reference(w, act, x, mode, history_in, lane_start, total)
    assert_close(out - x, want - x.double().cpu(), torch.float32)
    assert_close(history_out[lane_start : lane_start + lanes], partials, torch.float32, "history_out")
    others = [lane for lane in range(total) if not lane_start <= lane < lane_start + lanes]
    assert torch.isnan(history_out[others]).all()  # another group's rows are not this launch's


def test_the_lane_reduced_launcher_refuses_what_it_cannot_do():
    lanes, n, k = 2, 32, 64
    packed = move(pack_mma(awkward_matrix(lanes * n, k)), DEVICE)
    act, x = randn(lanes, k, dtype=torch.bfloat16), randn(lanes, n)
    history = torch.zeros(lanes, n, device=DEVICE)
    with pytest.raises(ValueError, match="'sum' needs every lane"):
        packed_lane_reduce_gemv(act, packed, x, mode="sum")
    with pytest.raises(ValueError, match="history_in: required"):
        packed_lane_reduce_gemv(act, packed, x, mode="delayed")
    with pytest.raises(ValueError, match="packed: "):
        packed_lane_reduce_gemv(act[:1], packed, x[:1], mode="scaled")
    with pytest.raises(ValueError, match="act: expected"):
        packed_lane_reduce_gemv(act.half(), packed, x, mode="scaled")
    with pytest.raises(ValueError, match="lane_start"):
        packed_lane_reduce_gemv(act, packed, x, mode="delayed", history_in=history, lane_start=1)
    with pytest.raises(ValueError, match="history_in: expected"):
        packed_lane_reduce_gemv(act, packed, x, mode="delayed", history_in=history[:, :16])
    with pytest.raises(ValueError, match="block_m"):
        packed_lane_reduce_gemv(act, packed, x, mode="scaled", block_m=4)


def test_a_launch_clears_the_buffer_it_is_given():
    packed = move(pack_mma(awkward_matrix(64, 256)), DEVICE)
    for size in (100, 4096, 12288):  # fewer floats than programs; several a program; not a multiple of them
        buffer = torch.full((size,), 7.0, device=DEVICE)
        packed_mma_gemv(randn(256), packed, torch.zeros(64, device=DEVICE), zero=buffer, split=2)
        assert int((buffer != 0).sum()) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="the mma runs on a GPU")
def test_a_layer_of_qwen3_shapes_on_the_tensor_cores():
    """The runner's shapes and settings (split by pick_split, PDL and the early trigger) in bf16."""
    gen = torch.Generator().manual_seed(4)
    for n, k in ((2048, 2048), (2048, 6144)):
        w = (torch.randn(n, k, generator=gen) * k**-0.5).to(torch.bfloat16)
        act = randn(k, dtype=torch.bfloat16, gen=gen)
        x = randn(n, scale=3.0, gen=gen)
        out = x.clone()
        packed_mma_gemv(act, move(pack_mma(w), DEVICE), out, use_pdl=True, trigger_early=True)
        assert_close(out - x, reference(w, act, x) - x.double().cpu(), torch.float32)


def test_pick_split_leaves_at_most_four_chunks_a_program():
    assert [pick_split(c) for c in (1, 4, 14, 32, 96, 128)] == [1, 1, 7, 8, 24, 32]


def test_shapes_that_do_not_fit_are_refused():
    assert fits(32, 128) and not fits(24, 128) and not fits(32, 96)
    with pytest.raises(ValueError, match="bf16"):
        pack_mma(torch.zeros(16, 64))
    with pytest.raises(ValueError, match="16-row tiles"):
        pack_mma(torch.zeros(24, 64, dtype=torch.bfloat16))


def test_the_launcher_refuses_mismatched_arguments():
    packed = move(pack_mma(awkward_matrix(32, 128)), DEVICE)
    out = torch.zeros(32, device=DEVICE)
    act = torch.zeros(128, device=DEVICE)
    with pytest.raises(ValueError, match="act: expected"):
        packed_mma_gemv(torch.zeros(64, device=DEVICE), packed, out)
    with pytest.raises(ValueError, match="act: expected"):
        packed_mma_gemv(act.half(), packed, out)
    with pytest.raises(ValueError, match="out: expected"):
        packed_mma_gemv(act, packed, out.half())
    with pytest.raises(ValueError, match="split"):
        packed_mma_gemv(act, packed, out, split=3)
    with pytest.raises(ValueError, match="block_m"):
        packed_mma_gemv(act, packed, out, block_m=4)
    with pytest.raises(ValueError, match="ahead"):
        packed_mma_gemv(act, packed, out, ahead=0)
    with pytest.raises(ValueError, match="items"):  # 2 M-tiles
        packed_mma_gemv(act, packed, out, items=4)
    g = torch.ones(128, dtype=torch.bfloat16, device=DEVICE)
    rstd = torch.zeros(1, device=DEVICE)
    with pytest.raises(ValueError, match="norm_weight"):  # the residual is fp32
        packed_mma_gemv(act.to(torch.bfloat16), packed, out, norm_weight=g, rstd=rstd)
    with pytest.raises(ValueError, match="norm_weight"):
        packed_mma_gemv(act, packed, out, norm_weight=g.float(), rstd=rstd)
    with pytest.raises(ValueError, match="rstd"):  # where the norm's scalar goes
        packed_mma_gemv(act, packed, out, norm_weight=g)
    with pytest.raises(ValueError, match="rstd"):
        packed_mma_gemv(act, packed, out, rstd=rstd)
    with pytest.raises(ValueError, match="rstd: expected"):
        packed_mma_gemv(act, packed, out, norm_weight=g, rstd=torch.zeros(2, device=DEVICE))
    with pytest.raises(ValueError, match="act: expected"):  # the gate and up sums: [2K]
        packed_mma_gemv(act, packed, out, glu=torch.bfloat16, rstd=rstd)
    sums = torch.zeros(256, device=DEVICE)
    with pytest.raises(ValueError, match="glu: act"):
        packed_mma_gemv(sums.to(torch.bfloat16), packed, out, glu=torch.bfloat16, rstd=rstd)
    with pytest.raises(ValueError, match="glu: expected"):  # the activations' dtype, not a flag
        packed_mma_gemv(sums, packed, out, glu=True, rstd=rstd)
    with pytest.raises(ValueError, match="zero"):
        packed_mma_gemv(act, packed, out, zero=torch.zeros(8, dtype=torch.int32, device=DEVICE))


def test_a_placeholder_has_the_packed_shapes():
    real, fake = pack_mma(awkward_matrix(32, 192)), placeholder(32, 192, "meta")
    for name in ("lo", "codes", "base", "exc_start"):
        assert getattr(fake, name).shape == getattr(real, name).shape
    assert fake.exception_rounds(1, 1) == 0
