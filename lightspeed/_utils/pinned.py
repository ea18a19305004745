"""Page-locked host tensors of exactly the size asked for.

torch's pinned allocator (`torch.empty(..., pin_memory=True)`, `tensor.pin_memory()`) rounds every
allocation up to a power of two: one transformer block's fp32 master of 805 MB takes 1 GiB, and the
offloaded state of a 6.7B model (master, gradient and 16-bit parameter shards, about 10 bytes per
parameter pinned) grows by a third, past a 128 GiB host (`benchmarks/offload.py`, one H200 host,
2026-12-02). `page_locked_empty` maps anonymous memory of the exact size, faults its pages in on
torch's CPU threads and registers it with the CUDA driver (`cudaHostRegister`), so copies to and from
the device run asynchronously as from any pinned tensor (`is_pinned()` is true). The registration is
undone, and the mapping released, when the last tensor viewing the memory is gone.
"""

from __future__ import annotations

import ctypes
import mmap
import sys

import torch


class _Registered:
    """Owns one registered mapping; kept alive by the ctypes array every tensor over it holds."""

    def __init__(self, mapping: mmap.mmap, ptr: int):
        self.mapping, self.ptr = mapping, ptr

    def __del__(self) -> None:
        if sys.is_finalizing():  # the process is ending: the driver and the OS take the memory back
            return
        if self.ptr is not None and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # no copy may still read or write the pages
            torch.cuda.cudart().cudaHostUnregister(self.ptr)
        self.mapping.close()


def page_locked_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D host tensor of `numel` elements (zero-filled), page-locked for the CUDA device. Raises
    RuntimeError naming the size when the driver refuses (e.g. the locked-memory limit)."""
    if not torch.cuda.is_available():
        raise RuntimeError("page-locked host memory needs a CUDA device")
    nbytes = numel * dtype.itemsize
    if nbytes == 0:
        return torch.empty(0, dtype=dtype, pin_memory=True)
    mapping = mmap.mmap(-1, nbytes)  # anonymous: page-aligned, zero pages until first touched
    probe = ctypes.c_uint8.from_buffer(mapping)
    ptr = ctypes.addressof(probe)
    del probe  # a live export would stop the mapping from closing
    array = (ctypes.c_uint8 * nbytes).from_address(ptr)
    array._owner = owner = _Registered(mapping, ptr)  # dies with the last tensor over `array`
    out = torch.frombuffer(array, dtype=dtype, count=numel)
    out.zero_()  # faults the pages in on torch's threads, so registering only locks them
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(ptr, nbytes, 0)
    if err != cudart.cudaError.success:
        owner.ptr = None
        raise RuntimeError(f"cannot page-lock {nbytes} bytes of host memory (cudaHostRegister: {err})")
    return out
