"""lightspeed.ops.onebit: sign packing, reference (the spec) and Triton kernels (run by
TRITON_INTERPRET=1 on CPU, in a child pytest) on awkward sizes, with and without chunk scales."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from lightspeed.ops.onebit import reference

# triton reads TRITON_INTERPRET at import: the kernel tests run in one child pytest that sets it
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
RUN_HERE = INTERPRET or DEVICE == "cuda"
kernel_test = pytest.mark.skipif(not RUN_HERE, reason="runs in the TRITON_INTERPRET=1 child (see below)")

SIZES = [1, 7, 8, 9, 63, 257, 1000, 8191, 8193, 20_001]


def _signs(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x >= 0, 1.0, -1.0)


@pytest.mark.parametrize("n", SIZES + [0])
def test_reference_round_trip(n):
    x = torch.randn(n)
    x[::5] = 0.0  # zero counts as +1
    packed = reference.pack_signs(x)
    assert packed.dtype == torch.uint8 and packed.numel() == (n + 7) // 8
    assert torch.equal(reference.unpack_signs(packed, n), _signs(x))


def test_reference_bit_order_and_padding():
    x = torch.tensor([1.0, -1, -1, -1, -1, -1, -1, 1, -2, 3])  # bits LSB first; bits past the end are 0
    assert reference.pack_signs(x).tolist() == [0b10000001, 0b00000010]


@pytest.mark.parametrize("n,chunk", [(24, 8), (1000, 40), (20, 8)])  # 20: the last chunk is partial
def test_reference_chunk_scales(n, chunk):
    x = torch.randn(n)
    scales = torch.rand((n + chunk - 1) // chunk) + 0.5
    out = reference.unpack_signs(reference.pack_signs(x), n, scales, chunk, dtype=torch.float64)
    want = (_signs(x) * scales.repeat_interleave(chunk)[:n]).double()
    assert out.dtype == torch.float64 and torch.equal(out, want)


def test_reference_rejects_short_inputs():
    with pytest.raises(ValueError, match="at least 2 bytes"):
        reference.unpack_signs(torch.zeros(1, dtype=torch.uint8), 9)
    with pytest.raises(ValueError, match="do not cover"):
        reference.unpack_signs(torch.zeros(2, dtype=torch.uint8), 16, torch.ones(1), 8)


@pytest.mark.skipif(RUN_HERE, reason="already interpreting or on CUDA")
def test_interpreted_in_subprocess():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__],
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout


@kernel_test
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_triton_pack_matches_reference(n, dtype):
    from lightspeed.ops.onebit import triton as kernels

    x = torch.randn(n, device=DEVICE).to(dtype)
    x[::7] = 0
    assert torch.equal(kernels.pack_signs(x).cpu(), reference.pack_signs(x.cpu()))


@kernel_test
@pytest.mark.parametrize("n,chunk", [(1, 8), (9, 8), (1000, 40), (8193, 256), (20_001, 4096)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_unpack_matches_reference(n, chunk, dtype):
    from lightspeed.ops.onebit import triton as kernels

    packed = torch.randint(0, 256, ((n + 7) // 8,), dtype=torch.uint8)
    scales = torch.rand((n + chunk - 1) // chunk) + 0.25
    want = reference.unpack_signs(packed, n, scales, chunk, dtype=dtype)
    got = kernels.unpack_signs(packed.to(DEVICE), n, scales.to(DEVICE), chunk, dtype=dtype).cpu()
    assert torch.equal(got, want)
    assert torch.equal(kernels.unpack_signs(packed.to(DEVICE), n).cpu(), reference.unpack_signs(packed, n))
