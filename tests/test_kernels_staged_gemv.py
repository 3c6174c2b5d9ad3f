"""kernels/staged_gemv.py: a Gluon kernel for Hopper (TMA, mbarriers), so its arithmetic is tested on the GPU only;
its argument checks, which run before any launch, are tested everywhere."""

import pytest
import torch
from kernel_testing import DEVICE, ON_GPU, assert_close, randn

from kernels.staged_gemv import pick_staging, staged_gemv

hopper = pytest.mark.skipif(
    not (ON_GPU and torch.cuda.get_device_capability()[0] >= 9), reason="TMA needs a Hopper GPU"
)


def reference(x, w, norm_weight=None, w_up=None, eps=1e-5):
    """fp64: the norm (when given), the product, the SiLU gate (with w_up)."""
    x, w = x.double().cpu(), w.double().cpu()
    if norm_weight is not None:
        x = x / torch.sqrt(x.pow(2).mean() + eps) * norm_weight.double().cpu()
    y = w @ x
    if w_up is not None:
        y = torch.nn.functional.silu(y) * (w_up.double().cpu() @ x)
    return y


# (N, K): llama-like rows, rows that are not a multiple of 16, a K with 128-wide boxes, rows for several groups
SHAPES = [(256, 512), (200, 384), (1000, 256), (96, 2048)]


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("kind", ["norm", "gated", "residual"])
# (box_r, stages): the automatic choice, and small rings that wrap around many times
@pytest.mark.parametrize("config", [(None, None), (8, 2), (16, 3)])
def test_staged_gemv_matches_reference(n, k, kind, config):
    box_r, stages = config
    if box_r and n % box_r:
        pytest.skip("rows not a multiple of the box")
    dtype = torch.bfloat16
    x = randn(k, scale=3.0)
    w = randn(n, k, dtype=dtype, scale=k**-0.5)
    g = (1 + 0.1 * randn(k)).to(dtype)
    w_up = randn(n, k, dtype=dtype, scale=k**-0.5) if kind == "gated" else None
    if kind == "residual":
        act = x.to(dtype)
        out = randn(n)
        want = out.double().cpu() + reference(act, w)
        staged_gemv(act, w, out, residual=True, box_r=box_r, stages=stages)
    else:
        out = torch.full((n,), float("nan"), dtype=dtype, device=DEVICE)
        want = reference(x, w, g, w_up)
        staged_gemv(x, w, out, norm_weight=g, eps=1e-5, weight_up=w_up, box_r=box_r, stages=stages)
    assert_close(out, want, dtype)


@hopper
@pytest.mark.gpu
def test_staged_gemv_equals_itself_with_reused_descriptors_and_pdl():
    # the runner keeps the TMA descriptors across launches and launches with PDL, early trigger or not
    n, k = 512, 1024
    x, w = randn(k), randn(n, k, dtype=torch.bfloat16, scale=k**-0.5)
    outs, descriptors = [], {}
    for use_pdl, early in [(False, False), (True, False), (True, True), (True, True)]:
        out = torch.zeros(n, dtype=torch.bfloat16, device=DEVICE)
        staged_gemv(
            x, w, out, norm_weight=None, use_pdl=use_pdl, trigger_early=early, descriptors=descriptors
        )
        outs.append(out)
    assert len(descriptors) == 1
    for out in outs[1:]:
        assert torch.equal(out, outs[0])


def test_pick_staging_fills_the_gpu_evenly(monkeypatch):
    import kernels.staged_gemv as module

    monkeypatch.setattr(module, "sm_count", lambda device: 132)
    for n, k, gated in [(3072, 2048, False), (2048, 8192, False), (8192, 2048, True), (6144, 2048, True)]:
        box_r, box_c, bk, row_groups, stages = pick_staging(n, k, gated, None)
        programs = -(-n // (box_r * row_groups))
        assert programs <= 132 and k % (box_c * bk) == 0 and n % box_r == 0 and stages >= 2
        assert (
            100_000 < stages * box_r * box_c * bk * 2 * (2 if gated else 1) <= 131072
        )  # one program a multiprocessor
        assert n / 132 / (box_r * row_groups) > 0.9  # no program holds much more than an even share


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda w, x, o: staged_gemv(x, w.float(), o), "bf16"),
        (lambda w, x, o: staged_gemv(x[:-8], w, o), "x: expected"),
        (lambda w, x, o: staged_gemv(x, w, o[:-8]), "out: expected"),
        (lambda w, x, o: staged_gemv(x, w, o, norm_weight=x[:8]), "norm_weight"),
        (lambda w, x, o: staged_gemv(x, w, o, weight_up=w[:8]), "weight_up"),
        # out is bf16, not the fp32 residual
        (lambda w, x, o: staged_gemv(x, w, o, residual=True), "residual"),
        (lambda w, x, o: staged_gemv(x, w[:12], o[:12], box_r=8), "multiple"),
        (lambda w, x, o: staged_gemv(x[:252], w[:, :252].contiguous(), o), "multiple of 8"),
    ],
)
def test_staged_gemv_refuses_bad_arguments_before_launching(call, message):
    w = torch.zeros(64, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=message):
        call(w, torch.zeros(256), torch.zeros(64, dtype=torch.bfloat16))
