"""The machine's failures, told apart from the code's: an allocation the device refused, a CUDA error.

Torch-free (the names and messages are matched, not the classes), so the worker can classify what its engine
raised without importing torch itself. The engine's load says what did not fit (engine._MemoryStages); the
worker ends a request that ran out of memory with `out_of_memory` and keeps serving.
"""

from __future__ import annotations


def is_memory_error(exc: BaseException) -> bool:
    """An allocation the machine refused: torch.OutOfMemoryError (CUDA), the CPU allocator's RuntimeError
    ("can't allocate memory"), an allocator's message that says so (Triton, cuBLAS), Python's MemoryError."""
    text = str(exc).lower()
    return (
        isinstance(exc, MemoryError)
        or type(exc).__name__ == "OutOfMemoryError"
        or "out of memory" in text
        or "can't allocate memory" in text
    )


def is_device_error(exc: BaseException) -> bool:
    """A CUDA error (torch.AcceleratorError, or a RuntimeError whose message is the driver's): the GPU or its
    driver, not this code."""
    return type(exc).__name__ == "AcceleratorError" or "CUDA error" in str(exc) or "CUDA driver" in str(exc)
