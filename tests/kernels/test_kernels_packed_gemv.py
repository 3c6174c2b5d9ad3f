import pytest
import torch

from kernels.packed_gemv import pack_weight, packed_gemv, pick_tile_k, unpack_weight
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


@pytest.mark.parametrize(
    "n,k,tile_k", [(8, 64, None), (37, 192, 64), (24, 512, 128), (16, 2048, None), (6, 6144, None)]
)
def test_pack_then_unpack_gives_back_every_bit(n, k, tile_k):
    w = with_infinities(awkward_matrix(n, k))
    packed = pack_weight(w, tile_k)
    assert torch.equal(unpack_weight(packed).view(torch.int16), w.view(torch.int16))
    assert packed.exceptions >= min(k, 40)  # row 0's at least


def test_a_random_matrix_takes_three_quarters_of_its_bf16_bytes():
    gen = torch.Generator().manual_seed(1)
    w = (torch.randn(512, 2048, generator=gen) * 2048**-0.5).to(torch.bfloat16)
    packed = pack_weight(w)
    assert (
        packed.exceptions < 1e-3 * w.numel()
    )  # ~1e-4 of the weights lie 16 binades under their row's largest
    assert packed.nbytes() < 0.76 * w.numel() * 2


def test_pick_tile_k_takes_the_largest_power_of_two_dividing_k():
    assert [pick_tile_k(k) for k in (2048, 6144, 3072, 8192, 192)] == [2048, 2048, 1024, 2048, 64]
    with pytest.raises(ValueError, match="multiple of 64"):
        pick_tile_k(200)


def test_pack_weight_refuses_what_it_cannot_hold():
    with pytest.raises(ValueError, match="bf16"):
        pack_weight(torch.zeros(4, 64))
    with pytest.raises(ValueError, match="tile_k"):
        pack_weight(torch.zeros(4, 192, dtype=torch.bfloat16), tile_k=128)


def reference(w, x, norm_weight=None, eps=1e-6, w_up=None):
    """fp64 on the CPU: W @ (rmsnorm(x) * g), or silu(W h) * (W_up h)."""
    x = x.double().cpu()
    if norm_weight is not None:
        x = x * torch.rsqrt(x.pow(2).mean() + eps) * norm_weight.double().cpu()
    y = w.double().cpu() @ x
    if w_up is not None:
        y = torch.nn.functional.silu(y) * (w_up.double().cpu() @ x)
    return y


# the interpreter runs fp32 and fp16 inputs (its bf16 arithmetic is wrong); the GPU bf16 as well
X_DTYPES = [torch.float32, torch.float16] + (
    [pytest.param(torch.bfloat16, marks=pytest.mark.gpu)] if ON_GPU else []
)
SHAPES = [(37, 192, 64), (24, 512, 128), (12, 2048, None)]  # (rows, K, tile_k): odd rows, several tiles, one


@pytest.mark.parametrize("x_dtype", X_DTYPES)
@pytest.mark.parametrize("n,k,tile_k", SHAPES)
# the launcher's rows and 1 tile before the wait; few rows, all tiles; blocks of rows in turn (a partial last one)
@pytest.mark.parametrize("block_n,prefetch,row_blocks", [(None, 1, 1), (4, 8, 1), (4, 1, 3)])
def test_packed_gemv_is_the_bf16_product(x_dtype, n, k, tile_k, block_n, prefetch, row_blocks):
    w = awkward_matrix(n, k)
    x = randn(k, dtype=x_dtype, scale=2.0)
    out = poisoned(n, dtype=torch.float32)
    packed_gemv(
        x, _on_device(pack_weight(w, tile_k)), out, block_n=block_n, prefetch=prefetch, row_blocks=row_blocks
    )
    assert_close(out, reference(w, x), torch.float32)


@pytest.mark.parametrize("n,k,tile_k", SHAPES)
def test_packed_gemv_with_the_norm_and_the_gate(n, k, tile_k):
    w, w_up = awkward_matrix(n, k, seed=1), awkward_matrix(n, k, seed=2)
    x = randn(k, scale=3.0)  # the fp32 residual
    g = randn(k).abs() + 0.5
    out = poisoned(n, dtype=torch.float32)
    packed_gemv(x, _on_device(pack_weight(w, tile_k)), out, norm_weight=g, eps=1e-5)
    assert_close(out, reference(w, x, g, 1e-5), torch.float32, "normed")
    packed_gemv(x, _on_device(pack_weight(w, tile_k)), out, norm_weight=g, eps=1e-5,
                weight_up=_on_device(pack_weight(w_up, tile_k)), block_n=4, row_blocks=2)  # fmt: skip
    assert_close(out, reference(w, x, g, 1e-5, w_up), torch.float32, "gated")


def test_packed_gemv_accumulates_into_the_residual():
    w = awkward_matrix(24, 512)
    act = randn(512, dtype=torch.float16)
    residual = randn(24, scale=4.0)
    x = residual.clone()
    packed_gemv(act, _on_device(pack_weight(w)), x, accumulate=True)
    assert_close(x, residual.double().cpu() + reference(w, act), torch.float32)


def test_packed_gemv_writes_bf16_and_fp16_outputs():
    w = awkward_matrix(24, 512)
    x = randn(512)
    for dtype in (torch.float16,) + ((torch.bfloat16,) if ON_GPU else ()):
        out = poisoned(24, dtype=dtype)
        packed_gemv(x, _on_device(pack_weight(w)), out)
        assert_close(out, reference(w, x), dtype)


def test_packed_gemv_refuses_mismatched_arguments():
    packed = _on_device(pack_weight(awkward_matrix(8, 64)))
    out = torch.zeros(8, device=DEVICE)
    with pytest.raises(ValueError, match="x: expected"):
        packed_gemv(torch.zeros(32, device=DEVICE), packed, out)
    with pytest.raises(ValueError, match="out: expected"):
        packed_gemv(torch.zeros(64, device=DEVICE), packed, torch.zeros(4, device=DEVICE))
    with pytest.raises(ValueError, match="accumulate"):
        packed_gemv(torch.zeros(64, device=DEVICE), packed, out.half(), accumulate=True)
    with pytest.raises(ValueError, match="weight_up"):
        packed_gemv(
            torch.zeros(64, device=DEVICE),
            packed,
            out,
            weight_up=_on_device(pack_weight(awkward_matrix(8, 128))),
        )
    with pytest.raises(ValueError, match="norm_weight"):
        packed_gemv(torch.zeros(64, device=DEVICE), packed, out, norm_weight=torch.ones(32, device=DEVICE))


def _on_device(packed):
    for name in ("lo", "codes", "base", "exc_col", "exc_value"):
        setattr(packed, name, getattr(packed, name).to(DEVICE))
    return packed
