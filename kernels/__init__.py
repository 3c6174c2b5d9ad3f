"""Triton kernels for batch-1 decode, one op per file.

Each file holds one `@triton.jit` kernel and its host launcher. The launchers take `use_pdl`: the kernel then
waits on the previous kernel with `griddepcontrol.wait` (issued after its first weight loads, which depend on
nothing) and lets the next one launch early, after its wait or, with the matrix-vector kernels' `trigger_early`,
before its first loads; every kernel waits unconditionally so that the chain of dependencies stays transitive.

Without a CUDA device the kernels run under Triton's interpreter (that is how CI tests them on the CPU). The
choice is made when a `@triton.jit` decorator runs, so it is made here, before any kernel module is imported.
"""

import os

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def sm_count(device: torch.device) -> int:
    """Multiprocessors the grids should fill. The interpreter runs programs one after another, so there a
    handful of large programs is fastest."""
    if device.type == "cuda" and not interpreted():
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def hopper_features(device: torch.device) -> bool:
    """Whether kernels may use sm_90 features (programmatic dependent launch, thread-block clusters) on
    `device`: a Hopper or later GPU, or meta tensors (a step compiled without weights)."""
    if device.type == "meta":
        return True
    return device.type == "cuda" and not interpreted() and torch.cuda.get_device_capability(device)[0] >= 9


def pdl_kwargs(use_pdl: bool) -> dict:
    """Launch options for programmatic dependent launch (the interpreter knows no such option)."""
    return {"launch_pdl": True} if use_pdl else {}
