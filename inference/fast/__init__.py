"""The fast decode path on CUDA: the Triton kernels of `kernels/`, one CUDA graph per decode step."""

from inference.fast.runner import FastRunner, supports

__all__ = ["FastRunner", "supports"]
