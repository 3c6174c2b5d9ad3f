"""The fast decode path on CUDA: the Triton kernels of `kernels/`, one CUDA graph per decode step, with the
settings of inference/fast/settings.py."""

from inference.fast.runner import FastRunner, supports
from inference.fast.settings import RunnerSettings

__all__ = ["FastRunner", "RunnerSettings", "supports"]
