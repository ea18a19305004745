"""lightspeed.ops.quantize: block-wise int8 / int4 quantization, the reference (the spec) and the Triton
kernels (run by TRITON_INTERPRET=1 on CPU, in a child pytest) on awkward sizes."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from lightspeed.ops.quantize import reference

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
RUN_HERE = INTERPRET or DEVICE == "cuda"
kernel_test = pytest.mark.skipif(not RUN_HERE, reason="runs in the TRITON_INTERPRET=1 child (see below)")

# (rows, n, block): partial last blocks, odd n (a half-used last byte at 4 bits), n below one block,
# a non-power-of-two block
SHAPES = [(1, 1, 16), (1, 7, 16), (3, 33, 16), (2, 1000, 64), (4, 4097, 4096), (1, 20_001, 2048), (5, 301, 48)]
# what one code step may cost: half a step of rounding; on the GPU a division may be off by an ulp
TOL = {8: 0.5 / 127, 4: 0.5 / 7}


def _data(rows, n, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=g) * torch.logspace(-3, 2, rows)[:, None]
    x[:, ::11] = 0.0
    return x.to(dtype)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("rows,n,block", SHAPES)
def test_reference_round_trip_within_half_a_step(bits, rows, n, block):
    x = _data(rows, n)
    codes, scales = reference.quantize(x, bits, block)
    assert codes.dtype == torch.uint8 and codes.shape == (rows, reference.code_bytes(n, bits))
    assert scales.shape == (rows, reference.num_blocks(n, block)) and scales.dtype == torch.float32
    back = reference.dequantize(codes, scales, n, bits, block)
    step = scales.repeat_interleave(block, dim=1)[:, :n]
    assert torch.all((back - x).abs() <= step * 0.5 * (1 + 1e-5) + 1e-30)
    # the largest element of every block is exact (it defines the scale)
    assert torch.equal(back.abs().amax(), x.abs().amax())


def test_reference_layout():
    x = torch.tensor([[1.0, -1.0, 0.3, 0.0, -0.25]])
    codes, scales = reference.quantize(x, 4, 4)
    assert torch.equal(scales, torch.tensor([[1.0, 0.25]]) / 7)
    # nibbles: 1 -> 7+8=15, -1 -> -7+8=1, 0.3 -> 2+8=10, 0 -> 8; -0.25 (its own block) -> 1, padding 8
    assert codes.tolist() == [[15 | (1 << 4), 10 | (8 << 4), 1 | (8 << 4)]]
    c8, _ = reference.quantize(x, 8, 16)
    assert c8.tolist() == [[255, 1, 166, 128, 96]]  # -31.75 rounds half up to -32


def test_zero_block_and_bad_arguments():
    codes, scales = reference.quantize(torch.zeros(2, 10), 8, 4)
    assert torch.all(scales == 0) and torch.all(codes == 128)
    assert torch.equal(reference.dequantize(codes, scales, 10, 8, 4), torch.zeros(2, 10))
    with pytest.raises(ValueError, match="bits must be 8 or 4"):
        reference.quantize(torch.ones(4), 2, 4)
    with pytest.raises(ValueError, match="even"):
        reference.quantize(torch.ones(4), 8, 3)
    with pytest.raises(ValueError, match="need uint8 codes"):
        reference.dequantize(torch.zeros(1, 3, dtype=torch.uint8), torch.zeros(1, 1), 4, 8, 4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reference_low_precision_input_and_output(dtype):
    x = _data(2, 300, dtype)
    codes, scales = reference.quantize(x, 8, 64)
    assert torch.equal(codes, reference.quantize(x.float(), 8, 64)[0])
    out = torch.empty(600, dtype=dtype)
    reference.dequantize(codes, scales, 300, 8, 64, out=out)
    assert torch.equal(out.view(2, 300), reference.dequantize(codes, scales, 300, 8, 64).to(dtype))


@pytest.mark.skipif(RUN_HERE, reason="already interpreting or on CUDA")
def test_interpreted_in_subprocess():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout


@kernel_test
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("rows,n,block", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_reference(bits, rows, n, block, dtype):
    from lightspeed.ops.quantize import triton as kernels

    x = _data(rows, n, dtype, seed=rows * n)
    want_codes, want_scales = reference.quantize(x, bits, block)
    codes, scales = kernels.quantize(x.to(DEVICE), bits, block)
    codes, scales = codes.cpu(), scales.cpu()
    torch.testing.assert_close(scales, want_scales, rtol=1e-6, atol=0)
    if DEVICE == "cpu":
        assert torch.equal(codes, want_codes)
    else:  # a division may round differently: a code may move by one step
        lo, hi = (lambda c: (c & 0xF, c >> 4)) if bits == 4 else (lambda c: (c, c))
        assert all((a.int() - b.int()).abs().max() <= 1 for a, b in zip(lo(codes), lo(want_codes)))
    for out_dtype in (torch.float32, dtype):
        want = reference.dequantize(want_codes, want_scales, n, bits, block, out_dtype)
        got = kernels.dequantize(want_codes.to(DEVICE), want_scales.to(DEVICE), n, bits, block, out_dtype).cpu()
        assert got.dtype == out_dtype
        _same_value(got, want)
    out = torch.empty(rows * n, dtype=dtype, device=DEVICE)
    kernels.dequantize(want_codes.to(DEVICE), want_scales.to(DEVICE), n, bits, block, out=out)
    _same_value(out.cpu().view(rows, n), reference.dequantize(want_codes, want_scales, n, bits, block, dtype))


def _same_value(got, want):
    """fp32 bit for bit; a 16-bit output within one unit in the last place (the interpreter's fp32 -> bf16
    cast truncates where the GPU's and torch's round to nearest even)"""
    if got.dtype == torch.float32:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got.float(), want.float(), rtol=2.0 ** -7, atol=0)
