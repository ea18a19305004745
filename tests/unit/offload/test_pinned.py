"""Exact-size page-locked host tensors (`_utils/pinned.py`): on a CUDA machine they are pinned, the
size asked for, round-trip through asynchronous copies and release their memory with the last view."""

import gc
import os

import pytest
import torch

from lightspeed._utils.pinned import page_locked_empty

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="page-locking needs a CUDA device")


def test_without_cuda_it_refuses():
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    with pytest.raises(RuntimeError, match="CUDA device"):
        page_locked_empty(10, torch.float32)


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pinned_exact_and_async_round_trip(dtype):
    numel = 3 * 2**20 + 17  # not a power of two, not page-aligned
    host = page_locked_empty(numel, dtype)
    assert host.is_pinned() and host.numel() == numel and host.dtype == dtype
    assert bool((host == 0).all())
    src = torch.randn(numel, device="cuda").to(dtype)
    host.copy_(src, non_blocking=True)
    back = torch.empty_like(src)
    back.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, src)
    view = host[5:9]
    del host
    gc.collect()
    assert torch.equal(view, src[5:9].cpu())  # a view keeps the registered memory alive


@cuda
def test_memory_is_the_size_asked_and_is_returned():
    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    numel = 805 * 2**20 // 4  # 805 MiB of fp32: torch's pinned allocator would take 1 GiB
    before = rss()
    host = page_locked_empty(numel, torch.float32)
    grown = rss() - before
    assert 0.95 * numel * 4 < grown < 1.05 * numel * 4
    del host
    gc.collect()
    assert rss() - before < 0.05 * numel * 4
