"""The grouped (mixture-of-experts) quantized matmul: `wq_grouped_matmul`'s Triton kernel (TRITON_INTERPRET=1 on
CPU, for real on CUDA) against the per-expert dequantize + fp32 matmul reference, in route order: experts
no route chose, routes to no expert, one expert for several routes, both slot modes (fewer routes than
experts or not), odd N, padded K, split-K with per-expert counters, per-group scales; the dispatcher's
checks."""
from __future__ import annotations

import os

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
# tests/conftest.py sets TRITON_INTERPRET=1 on a machine without CUDA, unless the environment says otherwise
kernel_test = pytest.mark.skipif(not RUN_HERE, reason="TRITON_INTERPRET=0 and no CUDA: the kernel cannot run")
TOL = {torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 8e-3)}


def _experts(e, n, k, fmt, group_size, seed):
    gen = torch.Generator().manual_seed(seed)
    return stack_weights([quantize(torch.randn(n, k, generator=gen) * 0.05, fmt, group_size)
                          for _ in range(e)]).to(DEVICE)


def _check(y, x, qw, experts):
    """Each route's row against its expert's reference product; routes to no expert are zero rows."""
    per_x = experts.shape[1]
    assert y.shape == (experts.numel(), qw.shape[0]) and y.dtype == x.dtype
    for r, e in enumerate(experts.reshape(-1).tolist()):
        if not 0 <= e < qw.scales.shape[0]:
            assert int((y[r] != 0).sum()) == 0
            continue
        ref = reference_matmul(x[r // per_x:r // per_x + 1], qw.expert(e))
        rtol, atol = TOL[x.dtype]
        torch.testing.assert_close(y[r:r + 1].float(), ref.float(), rtol=rtol,
                                   atol=atol * max(ref.float().abs().max().item(), 1e-3) + 1e-6)


def _routes(rows):
    return torch.tensor(rows, dtype=torch.int64, device=DEVICE)


# (routes [tokens, top-k]) over 5 experts: fewer routes than experts (route slots: a repeated expert, a
# route to no expert), then more (expert slots: 2 experts unused, every route of a token distinct)
ROUTES = [[[3, 1]], [[4, 4], [5, 0]], [[2, 0], [0, 3], [3, 2], [6, 0]], [[1], [1], [1], [1], [1], [1]]]


@kernel_test
@pytest.mark.parametrize("fmt,group_size", [("fp6", None), ("int8", None), ("int4", None), ("int4", 48)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_grouped_kernel_matches_each_experts_reference(fmt, group_size, dtype):
    """5 experts of N = 70 (a partial N block) x K = 200 (2 K-tiles, padded; 240 = 5 groups of 48), the
    routes above, SPLIT_K 1 and 2 (per-expert counters, left at zero)."""
    from lightspeed.ops.wquant import launch
    from lightspeed.ops.wquant import grouped as wt

    n, k = 70, 240 if group_size else 200
    qw = _experts(5, n, k, fmt, group_size, seed=3)
    gen = torch.Generator().manual_seed(4)
    for rows in ROUTES:
        experts = _routes(rows)
        x = torch.randn(experts.shape[0], k, generator=gen).to(device=DEVICE, dtype=dtype)
        for split_k in (1, 2):
            cfg = {"BLOCK_N": 32, "SPLIT_K": split_k, "ONE_DOT": 1, "num_warps": 4, "num_stages": 2}
            _check(wt.wq_grouped_matmul(x, qw, experts, config=cfg), x, qw, experts)
    assert all(int(c.abs().sum()) == 0 for c in launch.counters.values())


@kernel_test
def test_grouped_kernel_default_config_and_dispatcher():
    """The config `grouped_config` picks (the interpreter's fixed one on CPU), through the dispatcher on
    CUDA, for route counts of a decode step up to MAX_GROUPED_ROWS (top-2 of 4 experts)."""
    from lightspeed.ops.wquant import grouped as wt

    qw = _experts(4, 96, 256, "fp6", None, seed=5)
    gen = torch.Generator().manual_seed(6)
    for tokens in (1, 2, 16, MAX_GROUPED_ROWS // 2):
        x = torch.randn(tokens, 256, generator=gen).to(device=DEVICE, dtype=torch.float16)
        experts = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(tokens)]).to(DEVICE)
        y = wt.wq_grouped_matmul(x, qw, experts) if DEVICE == "cpu" else grouped_quantized_matmul(x, qw, experts)
        _check(y, x, qw, experts)


def test_reference_and_checks():
    """CPU dispatch = the reference; malformed inputs are refused."""
    qw = stack_weights([quantize(torch.randn(24, 64) * 0.05, "int8") for _ in range(3)])
    x = torch.randn(2, 64, dtype=torch.float16)
    experts = torch.tensor([[2, 0], [3, 2]])
    y = grouped_quantized_matmul(x, qw, experts)
    torch.testing.assert_close(y, reference_grouped_matmul(x, qw, experts))
    torch.testing.assert_close(y[0:1], reference_matmul(x[0:1], qw.expert(2)))
    torch.testing.assert_close(y[1:2], reference_matmul(x[0:1], qw.expert(0)))
    torch.testing.assert_close(y[3:4], reference_matmul(x[1:2], qw.expert(2)))
    assert int(y[2].abs().sum()) == 0  # expert 3 does not exist: a dropped route
    with pytest.raises(ValueError, match=r"experts must be \[2, top_k\] integers"):
        grouped_quantized_matmul(x, qw, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"experts must be \[2, top_k\] integers"):
        grouped_quantized_matmul(x, qw, experts.float())
    with pytest.raises(ValueError, match=r"x must be \[tokens, 64\]"):
        grouped_quantized_matmul(x[:, :32], qw, experts)
    with pytest.raises(ValueError, match="scales must be"):
        grouped_quantized_matmul(x, qw.expert(0), experts)
    with pytest.raises(ValueError, match="differ in format"):
        stack_weights([quantize(torch.randn(24, 64), "int8"), quantize(torch.randn(24, 64), "int4")])
    with pytest.raises(ValueError, match="no backward"):
        grouped_quantized_matmul(x.float().requires_grad_(True), qw, experts)


@pytest.mark.parametrize("fmt,group_size", [("fp6", None), ("int4", 32)])
def test_grouped_operator_passes_opcheck(fmt, group_size):
    """The torch.compile operator: schema, fake implementation against the real one (CPU), and its value."""
    gen = torch.Generator().manual_seed(8)
    qw = stack_weights([quantize(torch.randn(40, 64, generator=gen), fmt, group_size) for _ in range(3)])
    x = torch.randn(3, 64, generator=gen)
    experts = torch.tensor([[0, 2], [2, 1], [3, 0]])
    op = torch.ops.lightspeed.grouped_quantized_matmul.default
    args = (x, list(qw.planes), qw.scales, experts, qw.format, 40, 64, qw.group_size, qw.dtype, qw.tile)
    torch.library.opcheck(op, args)
    torch.testing.assert_close(op(*args), reference_grouped_matmul(x, qw, experts))


@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA")
@pytest.mark.parametrize("fmt", ["int4", "fp6"])
def test_cuda_grouped_kernel_block_n_128_configs_repeatedly(fmt):
    """BLOCK_N 128 with 4 warps, 3 and 4 stages, the splits the heuristic picks from, 5 calls each: the
    configs where a K-tile's wgmmas left in flight across the loop corrupt int4 (a runtime 1.0 that the
    compiler could fold did that here: wrong int4 configs in every cell of an H200 sweep)."""
    from lightspeed.ops.wquant import grouped as wt

    qw = _experts(6, 1024, 2048, fmt, None, seed=9)
    gen = torch.Generator().manual_seed(10)
    for rows in ([[1, 4]], [[0, 2], [3, 5], [2, 5], [1, 0]]):
        experts = _routes(rows)
        x = torch.randn(experts.shape[0], 2048, generator=gen).to(device=DEVICE, dtype=torch.float16)
        for split_k in (1, 2, 6):
            for stages in (3, 4):
                cfg = {"BLOCK_N": 128, "SPLIT_K": split_k, "ONE_DOT": 1, "num_warps": 4, "num_stages": stages}
                for _ in range(5):
                    _check(wt.wq_grouped_matmul(x, qw, experts, config=cfg), x, qw, experts)
