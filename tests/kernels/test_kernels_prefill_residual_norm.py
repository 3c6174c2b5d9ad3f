import pytest
import torch

from kernels.prefill_residual_norm import prefill_residual_norm
from tests.support.kernels import DEVICE, assert_close, dtype_params, lane_reduction, randn


def reference(x, partial, mode, past, norm_weight, eps):
    """fp64: model.Transformer.reduce's lane reduction, the residual add, then RMSNorm * weight."""
    new = x.double().cpu() + lane_reduction(partial, mode, past)
    if norm_weight is None:
        return new, None
    rstd = (new.pow(2).mean(-1, keepdim=True) + eps).rsqrt()
    return new, norm_weight.double().cpu()[:, None] * new * rstd


# (lanes, T, D): one lane (Llama), a lane count that is not a power of two, D not a multiple of the block
SHAPES = [(1, 5, 40), (3, 4, 48), (8, 3, 200)]


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("mode", ["sum", "delayed", "scaled"])
@pytest.mark.parametrize("lanes,T,D", SHAPES)
@pytest.mark.parametrize("with_norm", [True, False])
@pytest.mark.parametrize("row_programs", [False, True])
def test_prefill_residual_norm_matches_reference(dtype, mode, lanes, T, D, with_norm, row_programs):
    x = randn(lanes, T, D, dtype=dtype)
    partial = randn(lanes, T, D, dtype=dtype, scale=0.5)
    past = randn(lanes, T, D, dtype=dtype, scale=0.5) if mode == "delayed" else None
    norm = (1 + randn(lanes, D, scale=0.2)).to(dtype) if with_norm else None
    want_x, want_h = reference(x, partial, mode, past, norm, 1e-5)
    x_out, h = prefill_residual_norm(x, partial, mode=mode, past=past, norm_weight=norm, eps=1e-5,
                                     row_programs=row_programs)  # fmt: skip
    assert_close(x_out, want_x, dtype, "x_out")
    if with_norm:
        assert_close(h, want_h, dtype, "h")
    else:
        assert h is None


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("row_programs", [False, True])
def test_prefill_residual_norm_reads_a_broadcast_residual(dtype, row_programs):
    """Layer 0's residual is the embedding expanded over the lanes (stride 0)."""
    lanes, T, D = 4, 3, 64
    x = randn(1, T, D, dtype=dtype).expand(lanes, T, D)
    partial = randn(lanes, T, D, dtype=dtype)
    norm = randn(lanes, D, dtype=dtype)
    want_x, want_h = reference(x, partial, "scaled", None, norm, 1e-6)
    x_out, h = prefill_residual_norm(x, partial, mode="scaled", norm_weight=norm, row_programs=row_programs)
    assert_close(x_out, want_x, dtype, "x_out")
    assert_close(h, want_h, dtype, "h")


@pytest.mark.parametrize("block_d,stages", [(16, 4), (32, 1), (64, 2)])
def test_prefill_residual_norm_chunks_agree(block_d, stages):
    """Rows walked in chunks of any size (the last one partial) and any pipeline depth give the same result."""
    lanes, T, D = 3, 4, 200
    x, partial, past = (randn(lanes, T, D, scale=s) for s in (1.0, 0.5, 0.5))
    norm = 1 + randn(lanes, D, scale=0.2)
    want_x, want_h = reference(x, partial, "delayed", past, norm, 1e-5)
    x_out, h = prefill_residual_norm(x, partial, mode="delayed", past=past, norm_weight=norm, eps=1e-5,
                                     block_d=block_d, stages=stages, row_programs=False)  # fmt: skip
    assert_close(x_out, want_x, torch.float32, "x_out")
    assert_close(h, want_h, torch.float32, "h")


@pytest.mark.parametrize("mode", ["sum", "delayed"])
def test_a_row_a_program_agrees_with_the_chunked_passes(mode):
    """The few-positions kernel and the chunked one give the same rows (fp32: the sums' order may differ in the
    last bits)."""
    lanes, T, D = 4, 9, 200
    x, partial, past = (randn(lanes, T, D, scale=s) for s in (1.0, 0.5, 0.5))
    norm = 1 + randn(lanes, D, scale=0.2)
    past = past if mode == "delayed" else None
    rows = prefill_residual_norm(x, partial, mode=mode, past=past, norm_weight=norm, row_programs=True)
    chunked = prefill_residual_norm(x, partial, mode=mode, past=past, norm_weight=norm, row_programs=False)
    for a, b in zip(rows, chunked, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_prefill_residual_norm_names_bad_arguments():
    x = torch.zeros(2, 3, 8, device=DEVICE)
    with pytest.raises(ValueError, match="mode"):
        prefill_residual_norm(x, x.clone(), mode="mean")
    with pytest.raises(ValueError, match="past"):
        prefill_residual_norm(x, x.clone(), mode="delayed")
    with pytest.raises(ValueError, match="partial"):
        prefill_residual_norm(x, torch.zeros(2, 3, 9, device=DEVICE), mode="sum")
    with pytest.raises(ValueError, match="norm_weight"):
        prefill_residual_norm(x, x.clone(), mode="sum", norm_weight=torch.ones(2, 9, device=DEVICE))
    with pytest.raises(ValueError, match="block_d"):
        prefill_residual_norm(x, x.clone(), mode="sum", block_d=24)
