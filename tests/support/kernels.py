"""What the kernel tests share: where they run, in which dtypes, and how closely they must match.

Without a GPU the kernels run under Triton's interpreter on the CPU (fp32 and fp16: the interpreter computes
bf16 wrongly); with one (scripts/gpu_check.sh on the device machine) the same tests run compiled, in bf16 and
fp16, marked `gpu`.
"""

import math
import os

import pytest
import torch

ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
os.environ.setdefault("TRITON_INTERPRET", "0" if ON_GPU else "1")

import kernels  # noqa: E402,F401 - decides the interpreter before any kernel module is imported

DEVICE = torch.device("cuda" if ON_GPU else "cpu")

# Relative error ||out - ref|| / ||ref|| allowed per dtype of the inputs (reference in fp64 on the same inputs).
REL_TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.2e-2}


def dtype_params() -> list:
    if ON_GPU:
        return [
            pytest.param(torch.bfloat16, marks=pytest.mark.gpu),
            pytest.param(torch.float16, marks=pytest.mark.gpu),
        ]
    return [torch.float32, torch.float16]


def randn(
    *shape: int, dtype: torch.dtype = torch.float32, scale: float = 1.0, gen: torch.Generator | None = None
):
    return (torch.randn(shape, generator=gen, dtype=torch.float32) * scale).to(dtype).to(DEVICE)


def poisoned(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    """An output buffer full of NaN: any element the kernel fails to write shows up in the comparison."""
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str = "out") -> None:
    out, ref = out.double().cpu(), ref.double().cpu()
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(out).all(), (
        f"{what}: {int((~torch.isfinite(out)).sum())} elements not written or not finite"
    )
    tol = REL_TOL[dtype]
    rel = ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    assert rel <= tol, f"{what}: relative error {rel:.2e} > {tol:.0e}"
    # and no single element far off (a relative norm can hide one bad row)
    worst = ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
    assert worst <= 20 * tol, f"{what}: worst element off by {worst:.2e} of the largest"


def lane_reduction(p: torch.Tensor, mode: str, past: torch.Tensor | None = None) -> torch.Tensor:
    """fp64 on the CPU: what each lane adds to its residual from the lane partials p [L, ...] (docs/laneformer.md,
    "Reduction"; model.Transformer.reduce): the sum over lanes, the lane's own partial plus the other lanes'
    partials d layers back (`past`), or the partial scaled by sqrt(L)."""
    p = p.double().cpu()
    if mode == "sum":
        return p.sum(0, keepdim=True).expand_as(p)
    if mode == "delayed":
        old = past.double().cpu()
        return p + (old.sum(0, keepdim=True) - old)
    return p * math.sqrt(p.shape[0])


def reference_logits(x, weight, norm_weight=None, eps=1e-6):
    """fp64 on the CPU: the head's logits, weight @ (rmsnorm(x) * norm_weight) (no norm without norm_weight)."""
    x = x.double().cpu()
    if norm_weight is not None:
        x = x * torch.rsqrt(x.pow(2).mean() + eps) * norm_weight.double().cpu()
    return weight.double().cpu() @ x


def device_ints(*values, dtype=torch.int32):
    return torch.tensor(values, dtype=dtype, device=DEVICE)
