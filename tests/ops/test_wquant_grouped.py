"""The grouped (mixture-of-experts) quantized matmul: `wq_grouped_matmul`'s Triton kernel (TRITON_INTERPRET=1
on CPU, in a child pytest as in test_wquant_triton.py; in-process on CUDA) against the per-expert
dequantize + fp32 matmul reference, with experts that get no rows, rows routed nowhere, odd N, padded K,
split-K with per-expert counters, per-group scales; the dispatcher's checks."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from lightspeed.ops.wquant import (
    MAX_GROUPED_ROWS,
    grouped_quantized_matmul,
    quantize,
    reference_grouped_matmul,
    reference_matmul,
    stack_weights,
)

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
RUN_HERE = INTERPRET or DEVICE == "cuda"
kernel_test = pytest.mark.skipif(not RUN_HERE, reason="runs in the TRITON_INTERPRET=1 child (see below)")
TOL = {torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 8e-3)}


@pytest.mark.skipif(RUN_HERE, reason="already interpreting or on CUDA")
def test_interpreted_in_subprocess():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__],
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout


def _experts(e, n, k, fmt, group_size, seed):
    gen = torch.Generator().manual_seed(seed)
    return stack_weights([quantize(torch.randn(n, k, generator=gen) * 0.05, fmt, group_size)
                          for _ in range(e)]).to(DEVICE)


def _offsets(counts):
    return torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)


def _check(y, x, qw, offsets):
    """Each expert's rows against its own reference product; rows past offsets[-1] are not compared."""
    bounds = offsets.tolist()
    for e in range(len(bounds) - 1):
        rows = slice(bounds[e], bounds[e + 1])
        if bounds[e + 1] == bounds[e]:
            continue
        ref = reference_matmul(x[rows], qw.expert(e))
        rtol, atol = TOL[x.dtype]
        torch.testing.assert_close(y[rows].float(), ref.float(), rtol=rtol,
                                   atol=atol * max(ref.float().abs().max().item(), 1e-3) + 1e-6)


@kernel_test
@pytest.mark.parametrize("fmt,group_size", [("fp6", None), ("int8", None), ("int4", None), ("int4", 48)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_grouped_kernel_matches_each_experts_reference(fmt, group_size, dtype):
    """5 experts, N = 70 (a partial N block), K = 200 (2 K-tiles, padded; 240 with groups of 48): rows
    (2, 0, 3, 0, 1) per expert and 2 rows routed nowhere (past offsets[E], as dropped routes), SPLIT_K 1
    and 2 (per-expert counters, left at zero), then every row on one expert and one row in all."""
    from lightspeed.ops.wquant import launch
    from lightspeed.ops.wquant import triton as wt

    n, k = 70, 240 if group_size else 200  # 240 = 5 groups of 48
    qw = _experts(5, n, k, fmt, group_size, seed=3)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(8, k, generator=gen).to(device=DEVICE, dtype=dtype)
    for counts in ((2, 0, 3, 0, 1), (0, 0, 0, 6, 0), (1, 0, 0, 0, 0)):
        offsets = _offsets(counts)
        for split_k in (1, 2):
            cfg = {"BLOCK_N": 32, "SPLIT_K": split_k, "ONE_DOT": 1, "num_warps": 4, "num_stages": 2}
            _check(wt.wq_grouped_matmul(x, qw, offsets, config=cfg), x, qw, offsets)
    assert all(int(c.abs().sum()) == 0 for c in launch.counters.values())


@kernel_test
def test_grouped_kernel_default_config_and_dispatcher():
    """The config `grouped_config` picks (the interpreter's fixed one on CPU), through the dispatcher on
    CUDA, for every row count of one decode step's routes up to MAX_GROUPED_ROWS."""
    from lightspeed.ops.wquant import triton as wt

    qw = _experts(4, 96, 256, "fp6", None, seed=5)
    gen = torch.Generator().manual_seed(6)
    for rows in (1, 2, 16, 33, MAX_GROUPED_ROWS):
        x = torch.randn(rows, 256, generator=gen).to(device=DEVICE, dtype=torch.float16)
        counts = [rows // 4] * 3 + [rows - 3 * (rows // 4)]
        offsets = _offsets(counts)
        y = wt.wq_grouped_matmul(x, qw, offsets) if DEVICE == "cpu" else grouped_quantized_matmul(x, qw, offsets)
        _check(y, x, qw, offsets)


def test_reference_and_checks():
    """CPU dispatch = the reference (rows routed nowhere are zero there); malformed inputs are refused."""
    qw = stack_weights([quantize(torch.randn(24, 64) * 0.05, "int8") for _ in range(3)])
    x = torch.randn(5, 64, dtype=torch.float16)
    offsets = torch.tensor([0, 2, 2, 4])
    y = grouped_quantized_matmul(x, qw, offsets)
    torch.testing.assert_close(y, reference_grouped_matmul(x, qw, offsets))
    torch.testing.assert_close(y[:2], reference_matmul(x[:2], qw.expert(0)))
    torch.testing.assert_close(y[2:4], reference_matmul(x[2:4], qw.expert(2)))
    assert int(y[4].abs().sum()) == 0
    with pytest.raises(ValueError, match="offsets must be 4 integers"):
        grouped_quantized_matmul(x, qw, torch.tensor([0, 5]))
    with pytest.raises(ValueError, match=r"x must be \[rows, 64\]"):
        grouped_quantized_matmul(x[:, :32], qw, offsets)
    with pytest.raises(ValueError, match="scales must be"):
        grouped_quantized_matmul(x, qw.expert(0), offsets)
    with pytest.raises(ValueError, match="differ in format"):
        stack_weights([quantize(torch.randn(24, 64), "int8"), quantize(torch.randn(24, 64), "int4")])
