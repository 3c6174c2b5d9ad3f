"""GPU memory of one process mapped into another's device, through the CUDA driver's IPC calls (ctypes).

torch.multiprocessing opens a CUDA IPC handle on the device that owns the memory, which maps it into that device's
context in the receiving process: a kernel running on another device then faults on the address. Opened here on
the receiving process's own device, with peer access enabled lazily by the driver, the address is one that the
receiver's kernels can write across NVLink (the lane exchange's mailboxes; the same device works too).
"""

from __future__ import annotations

import ctypes
import functools

import torch

LAZY_ENABLE_PEER_ACCESS = 0x1  # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS


class _IpcHandle(ctypes.Structure):  # CUipcMemHandle: 64 opaque bytes (NULs among them), passed by value
    _fields_ = [("reserved", ctypes.c_ubyte * 64)]


@functools.cache
def _driver() -> ctypes.CDLL:
    """libcuda with the signatures used here declared (a handle travels by value)."""
    driver = ctypes.CDLL("libcuda.so.1")
    u64, size = ctypes.c_uint64, ctypes.c_size_t
    signatures = {
        "cuMemGetAddressRange_v2": [ctypes.POINTER(u64), ctypes.POINTER(size), u64],
        "cuIpcGetMemHandle": [ctypes.POINTER(_IpcHandle), u64],
        "cuIpcOpenMemHandle_v2": [ctypes.POINTER(u64), _IpcHandle, ctypes.c_uint],
    }
    for name, argtypes in signatures.items():
        getattr(driver, name).argtypes = argtypes
        getattr(driver, name).restype = ctypes.c_int
    return driver


def _call(name: str, *args) -> None:
    result = getattr(_driver(), name)(*args)
    if result != 0:
        raise RuntimeError(f"{name} failed with CUDA driver error {result}")


def export(tensor: torch.Tensor) -> tuple[bytes, int]:
    """(the IPC handle of the allocation that holds `tensor`, the tensor's byte offset within it). The allocation
    must stay alive as long as another process uses it."""
    torch.cuda.synchronize(tensor.device)
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    _call("cuMemGetAddressRange_v2", ctypes.byref(base), ctypes.byref(size), tensor.data_ptr())
    handle = _IpcHandle()
    # the driver wants the allocation's base
    _call("cuIpcGetMemHandle", ctypes.byref(handle), base.value)
    return bytes(handle), tensor.data_ptr() - base.value


# (handle, device index) -> where it was opened: an allocation opens once per context (the caching allocator's
# tensors often share one), and stays mapped while the process lives
_opened: dict[tuple[bytes, int], int] = {}


def open_address(exported: tuple[bytes, int], device: torch.device) -> int:
    """The address, valid for kernels on `device` in this process, of memory another process exported."""
    handle_bytes, offset = exported
    index = torch.cuda.current_device() if device.index is None else device.index
    if (handle_bytes, index) not in _opened:
        torch.cuda.set_device(index)
        torch.cuda.synchronize(index)  # the device's primary context is current on this thread
        base = ctypes.c_uint64()
        _call(
            "cuIpcOpenMemHandle_v2",
            ctypes.byref(base),
            _IpcHandle.from_buffer_copy(handle_bytes),
            LAZY_ENABLE_PEER_ACCESS,
        )
        _opened[handle_bytes, index] = base.value
    return _opened[handle_bytes, index] + offset
