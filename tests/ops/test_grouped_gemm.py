"""lightspeed.ops.grouped_gemm: the grouped GEMM of MoE training (forward, dx, dw), the routing's permute /
unpermute and the experts' gated MLP. The reference (the spec, the CPU path) against per-group torch
matmuls and autograd; the Triton kernels (TRITON_INTERPRET=1 on CPU, set by tests/conftest.py; real on
CUDA) and the torch._grouped_mm path (where torch has it, on CPU too) against the reference, on awkward
sizes: K and N not multiples of 16, a handful of rows, empty groups, rows past the last group, strided
weights (HF's [G, N, K] parameters transposed), fp32 / bf16 / fp16. Interpreter cases are tiny."""
from __future__ import annotations

import os

import pytest
import torch

import lightspeed.ops.grouped_gemm as gg
from lightspeed.ops.grouped_gemm import (
    GroupedMatmul,
    choose_backend,
    grouped_mlp,
    grouped_mm,
    offsets_from_counts,
    permute,
    reference,
    unpermute,
)

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
RUN_HERE = INTERPRET or DEVICE == "cuda"
# tests/conftest.py sets TRITON_INTERPRET=1 on a machine without CUDA, unless the environment says otherwise
kernel_test = pytest.mark.skipif(not RUN_HERE, reason="TRITON_INTERPRET=0 and no CUDA: the kernel cannot run")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (rtol, atol as a fraction of the reference's largest magnitude): fp32 sums in another order; 16-bit
# outputs are one rounding of an fp32 sum (the interpreter rounds fp32 -> bf16 toward zero: one ulp)
TOL = {torch.float32: (1e-4, 1e-5), torch.bfloat16: (1.6e-2, 8e-3), torch.float16: (2e-3, 1e-3)}
# the MLP chains three products and two 16-bit roundings of intermediates (gate / up, the gated product):
# a one-ulp difference there moves a gradient's sum by a few ulps of its largest term
TOL_MLP = {torch.float32: (1e-4, 1e-5), torch.bfloat16: (5e-2, 2e-2), torch.float16: (1e-2, 4e-3)}

# (T, K, N, counts): K, N not multiples of 16; empty groups first, between and last; rows past the last
# group (sum(counts) < T); a single group; a group larger than one M tile
SHAPES = [(37, 20, 19, [5, 0, 25, 3]), (3, 8, 5, [0, 2]), (50, 33, 40, [50]), (24, 17, 24, [0, 0, 0])]


def _close(got, want, dtype, what="", tol=TOL):
    rtol, atol = tol[dtype]
    scale = max(want.float().abs().max().item(), 1e-3)
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol * scale, msg=lambda m: f"{what}: {m}")


def _problem(T, K, N, counts, dtype, seed=0, transposed=False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, K, generator=gen).to(device=DEVICE, dtype=dtype)
    if transposed:  # HF's [G, N, K] parameter read as [G, K, N]
        w = torch.randn(len(counts), N, K, generator=gen).to(device=DEVICE, dtype=dtype).transpose(1, 2)
    else:
        w = torch.randn(len(counts), K, N, generator=gen).to(device=DEVICE, dtype=dtype)
    offsets = offsets_from_counts(torch.tensor(counts, device=DEVICE))
    dout = torch.randn(T, N, generator=gen).to(device=DEVICE, dtype=dtype)
    return x, w, offsets, dout


def _fwd_bwd(x, w, offsets, dout, backend):
    xx, ww = x.clone().requires_grad_(), w.detach().clone().requires_grad_()
    y = GroupedMatmul.apply(xx, ww, offsets, backend) if backend == "torch" else grouped_mm(xx, ww, offsets, backend)
    y.backward(dout)
    return y.detach(), xx.grad, ww.grad


def _check_against_reference(x, w, offsets, dout, backend, dtype):
    y, dx, dw = _fwd_bwd(x, w, offsets, dout, backend)
    y_ref, dx_ref, dw_ref = _fwd_bwd(x, w, offsets, dout, "reference")
    _close(y, y_ref, dtype, "out")
    _close(dx, dx_ref, dtype, "dx")
    _close(dw, dw_ref, dtype, "dw")
    tail = int(offsets[-1]) if offsets.numel() else 0
    assert torch.all(y[tail:] == 0) and torch.all(dx[tail:] == 0)  # rows past the last group


# ---- the reference --------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,K,N,counts", SHAPES)
def test_reference_is_per_group_matmul_and_its_gradients(T, K, N, counts, dtype):
    """out, dx, dw of the reference path equal per-group fp32 matmuls rounded once, and autograd through a
    plain slicing loop (dw of an empty group is zero)."""
    x, w, offsets, dout = _problem(T, K, N, counts, dtype, transposed=True)
    y, dx, dw = _fwd_bwd(x, w, offsets, dout, "reference")
    xx, ww = x.float().requires_grad_(), w.float().requires_grad_()
    start, parts = 0, []
    for g, c in enumerate(counts):
        parts.append(xx[start:start + c] @ ww[g])
        start += c
    parts.append(torch.zeros(T - start, N, device=xx.device))
    want = torch.cat(parts)
    want.backward(dout.float())
    assert y.dtype == dw.dtype == dx.dtype == dtype and dw.shape == w.shape
    _close(y, want.to(dtype), dtype, "out")
    _close(dx, xx.grad, dtype, "dx")
    _close(dw, ww.grad, dtype, "dw")
    for g, c in enumerate(counts):
        if c == 0:
            assert torch.all(dw[g] == 0)


def test_reference_refuses_bad_offsets_and_inputs():
    x, w = torch.randn(6, 4), torch.randn(2, 4, 3)
    for bad in ([4, 2], [2, 7], [-1, 3]):
        with pytest.raises(ValueError, match="non-decreasing cumulative ends"):
            grouped_mm(x, w, torch.tensor(bad, dtype=torch.int32))
    ok = torch.tensor([2, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match="offsets must be int32"):
        grouped_mm(x, w, ok.long())
    with pytest.raises(ValueError, match=r"offsets must be int32 \[G=2\]"):
        grouped_mm(x, w, ok[:1])
    with pytest.raises(ValueError, match="x has K=5"):
        grouped_mm(torch.randn(6, 5), w, ok)
    with pytest.raises(ValueError, match="share one dtype"):
        grouped_mm(x, w.half(), ok)
    with pytest.raises(ValueError, match=r"x must be \[T, K\]"):
        grouped_mm(x, w[0], ok)
    with pytest.raises(ValueError, match="backend must be one of"):
        grouped_mm(x, w, ok, backend="cutlass")


# ---- the Triton kernels ---------------------------------------------------------------------------------

@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,K,N,counts", SHAPES[:2] + SHAPES[3:])
def test_triton_forward_backward_match_reference(T, K, N, counts, dtype):
    x, w, offsets, dout = _problem(T, K, N, counts, dtype, seed=1)
    _check_against_reference(x, w, offsets, dout, "triton", dtype)


@kernel_test
def test_triton_multi_tile_strided_weight_and_config():
    """Groups spanning several M tiles and K / N tiles (small blocks), an even K (no K mask), the weight a
    transposed view, and the tail's zero tiles."""
    from lightspeed.ops.grouped_gemm import triton as kernels

    x, w, offsets, dout = _problem(70, 64, 40, [0, 33, 1, 20], torch.float32, seed=2, transposed=True)
    cfg = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, num_warps=4, num_stages=1)
    y = kernels.grouped_mm(x, w, offsets, cfg)
    _close(y, reference.grouped_mm(x, w, offsets), torch.float32, "out")
    assert torch.all(y[54:] == 0)
    dw = kernels.wgrad(x, dout, offsets, dict(BLOCK_K=16, BLOCK_N=16, BLOCK_T=16, num_warps=4, num_stages=1))
    _close(dw, reference.grouped_mm_wgrad(x, dout, offsets), torch.float32, "dw")
    _check_against_reference(x, w, offsets, dout, "triton", torch.float32)


# ---- the torch._grouped_mm path ---------------------------------------------------------------------------

def _torch_grouped_mm_runs_here() -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        torch._grouped_mm(torch.randn(16, 16, device=DEVICE, dtype=torch.bfloat16),
                          torch.randn(2, 16, 16, device=DEVICE, dtype=torch.bfloat16),
                          offs=torch.tensor([8, 16], dtype=torch.int32, device=DEVICE))
    except (RuntimeError, NotImplementedError):
        return False
    return True


@pytest.mark.skipif(not _torch_grouped_mm_runs_here(), reason="this torch has no usable torch._grouped_mm here")
@pytest.mark.parametrize("transposed", [False, True])
def test_torch_path_forward_backward_match_reference(transposed):
    """The torch branch of GroupedMatmul (forced: the automatic rule takes it on Hopper only): bf16, K and N
    multiples of 8, an empty group, rows past the last group (zeroed), dw by the 2-D x 2-D form."""
    x, w, offsets, dout = _problem(40, 24, 16, [7, 0, 20, 9], torch.bfloat16, seed=3, transposed=transposed)
    _check_against_reference(x, w, offsets, dout, "torch", torch.bfloat16)


@pytest.mark.skipif(not _torch_grouped_mm_runs_here(), reason="this torch has no usable torch._grouped_mm here")
def test_torch_path_ignores_rows_past_the_last_group(monkeypatch):
    """NaN in the rows past the last group (the inner tensors grouped_mlp leaves unwritten there) reach
    no group's result; grouped_mlp on the torch path (forced, as on Hopper) matches the reference."""
    x, w, offsets, dout = _problem(40, 24, 16, [7, 0, 20, 9], torch.bfloat16, seed=7)
    x_nan, dout_nan = x.clone(), dout.clone()
    x_nan[36:], dout_nan[36:] = float("nan"), float("nan")
    y, dx, dw = _fwd_bwd(x_nan, w, offsets, dout_nan, "torch")
    y_ref, dx_ref, dw_ref = _fwd_bwd(x, w, offsets, dout, "reference")
    for got, want in ((y, y_ref), (dx, dx_ref), (dw, dw_ref)):
        _close(got, want, torch.bfloat16)
    monkeypatch.setattr(gg, "_torch_path_problem", lambda x, w: None)
    mx, moffsets, gate_up, down = _mlp_problem(torch.bfloat16, H=24, inter=16, counts=(4, 0, 7, 2), T=16)
    got = _mlp_grads(lambda a, b, c: grouped_mlp(a, moffsets, b, c, backend="torch"), mx, gate_up, down)
    want = _mlp_grads(lambda a, b, c: grouped_mlp(a, moffsets, b, c, backend="reference"), mx, gate_up, down)
    for name, g, r in zip(("out", "dx", "d gate_up", "d down"), got, want):
        _close(g, r, torch.bfloat16, name, TOL_MLP)
    assert torch.all(got[0][13:] == 0) and torch.all(got[1][13:] == 0)


# ---- the backend rule ---------------------------------------------------------------------------------------

def test_backend_rule_on_cpu(monkeypatch):
    x, w = torch.randn(4, 8), torch.randn(2, 8, 8)
    monkeypatch.delenv("LIGHTSPEED_OPS_BACKEND", raising=False)
    assert choose_backend(x, w) == "reference"
    with pytest.raises(ValueError, match="runs on CUDA tensors only"):
        choose_backend(x.bfloat16(), w.bfloat16(), "torch")
    monkeypatch.setenv("LIGHTSPEED_OPS_BACKEND", "torch")
    with pytest.raises(ValueError, match="torch._grouped_mm path cannot run"):
        choose_backend(x, w)
    monkeypatch.setenv("LIGHTSPEED_OPS_BACKEND", "reference")
    assert choose_backend(x, w) == "reference"
    monkeypatch.setenv("LIGHTSPEED_OPS_BACKEND", "triton")
    if INTERPRET:
        assert choose_backend(x, w) == "triton"
    else:
        with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
            choose_backend(x, w)


def test_probe_never_fails(monkeypatch):
    """A torch without _grouped_mm, or one whose _grouped_mm raises, rules the torch path out, no error."""
    monkeypatch.setattr(gg, "_probed", {})
    monkeypatch.delattr(torch, "_grouped_mm", raising=False)
    assert gg.torch_grouped_mm_available(torch.device("cpu")) is False

    def broken(*args, **kwargs):
        raise RuntimeError("grouped gemm is not supported here")

    monkeypatch.setattr(torch, "_grouped_mm", broken, raising=False)
    assert gg.torch_grouped_mm_available(torch.device("cpu")) is False
    assert gg._probed[("cpu", None)] is False


# ---- routing ------------------------------------------------------------------------------------------------

ROUTES = [[0, 2], [2, 1], [1, 1], [3, -1], [0, 5], [2, 0], [3, 3]]  # repeats, a -1 and a 5 (dropped, E = 4)


def _routing_problem(dtype, H=24, seed=4):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randn(len(ROUTES), H, generator=gen).to(device=DEVICE, dtype=dtype)
    idx = torch.tensor(ROUTES, device=DEVICE)
    weights = torch.rand(len(ROUTES), 2, generator=gen).to(DEVICE)
    return tokens, idx, weights


def test_reference_permute_layout():
    tokens, idx, weights = _routing_problem(torch.float32)
    tokens, idx, weights = tokens.cpu(), idx.cpu(), weights.cpu()
    sorted_rows, row_map, counts = reference.permute(tokens, idx, 4)
    assert counts.dtype == torch.int32 and counts.tolist() == [3, 3, 3, 3]
    # expert 0: routes (0,0), (4,0), (5,1); expert 1: (1,1), (2,0), (2,1); ... token order within an expert
    assert row_map.tolist() == [[0, 6], [7, 3], [4, 5], [9, -1], [1, -1], [8, 2], [10, 11]]
    for s in range(len(ROUTES)):
        for j in range(2):
            if row_map[s, j] >= 0:
                assert torch.equal(sorted_rows[row_map[s, j]], tokens[s])
    assert torch.all(sorted_rows[12:] == 0)  # the dropped routes' rows, after the kept ones
    out = reference.unpermute(sorted_rows, row_map, weights)
    want = torch.stack([sum(weights[s, j] * tokens[s] for j in range(2) if 0 <= ROUTES[s][j] < 4)
                        for s in range(len(ROUTES))])
    torch.testing.assert_close(out, want)


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_permute_unpermute_match_reference(dtype):
    """Forward bit for bit (a gather; fp32 sums in the same order), backward of tokens and weights."""
    tokens, idx, weights = _routing_problem(dtype, H=70)
    results = []
    for backend in ("triton", "reference"):
        t, w = tokens.clone().requires_grad_(), weights.clone().requires_grad_()
        sorted_rows, row_map, counts = permute(t, idx, 4, backend=backend)
        expert_out = sorted_rows * 1.5 + 1.0  # a stand-in for the experts: row i's gradient is 1.5 * grad
        out = unpermute(expert_out, row_map, w, backend=backend)
        out.backward(torch.linspace(-1, 1, out.numel(), device=DEVICE).view_as(out).to(dtype))
        results.append((sorted_rows.detach(), row_map, counts, out.detach(), t.grad, w.grad))
    (s1, m1, c1, o1, gt1, gw1), (s2, m2, c2, o2, gt2, gw2) = results
    assert torch.equal(s1, s2) and torch.equal(m1, m2) and torch.equal(c1, c2)
    _close(o1, o2, dtype, "out")
    _close(gt1, gt2, dtype, "grad tokens")
    _close(gw1, gw2, torch.float32 if dtype == torch.float32 else dtype, "grad weights")


def test_routing_checks():
    tokens, idx = torch.randn(3, 4), torch.tensor([[0], [1], [0]])
    with pytest.raises(ValueError, match=r"expert_idx \[S, k\]"):
        permute(tokens, idx[:2], 2)
    with pytest.raises(ValueError, match="must be integers"):
        permute(tokens, idx.float(), 2)
    with pytest.raises(ValueError, match="num_experts must be >= 1"):
        permute(tokens, idx, 0)
    sorted_rows, row_map, _ = permute(tokens, idx, 2)
    with pytest.raises(ValueError, match="row_map must be int64"):
        unpermute(sorted_rows, row_map.int(), torch.ones(3, 1))
    with pytest.raises(ValueError, match="row_map and weights"):
        unpermute(sorted_rows, row_map, torch.ones(3, 2))


# ---- the experts' MLP ---------------------------------------------------------------------------------------

def _mlp_problem(dtype, H=20, inter=12, counts=(4, 0, 7, 2), T=15, seed=5):
    gen = torch.Generator().manual_seed(seed)
    G = len(counts)
    x = torch.randn(T, H, generator=gen).to(device=DEVICE, dtype=dtype)
    # HF's layouts: gate_up_proj [G, 2I, H], down_proj [G, H, I], passed transposed
    gate_up = (torch.randn(G, 2 * inter, H, generator=gen) * 0.3).to(device=DEVICE, dtype=dtype)
    down = (torch.randn(G, H, inter, generator=gen) * 0.3).to(device=DEVICE, dtype=dtype)
    return x, offsets_from_counts(torch.tensor(counts, device=DEVICE)), gate_up, down


def _mlp_grads(fn, x, gate_up, down):
    xx, gu, dn = (t.clone().requires_grad_() for t in (x, gate_up, down))
    y = fn(xx, gu.transpose(1, 2), dn.transpose(1, 2))
    y.backward(torch.cos(torch.arange(y.numel(), device=y.device, dtype=torch.float32)).view_as(y).to(y.dtype))
    return y.detach(), xx.grad, gu.grad, dn.grad


@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh"])
def test_grouped_mlp_reference_path_matches_spec(activation):
    """fp32 on the reference path: the composed grouped_mm / activation / grouped_mm against the spec's
    per-group loop, forward and every gradient; rows past the last group are zero."""
    x, offsets, gate_up, down = _mlp_problem(torch.float32)
    got = _mlp_grads(lambda a, b, c: grouped_mlp(a, offsets, b, c, activation, backend="reference"), x, gate_up, down)
    want = _mlp_grads(lambda a, b, c: reference.grouped_mlp(a, offsets, b, c, activation), x, gate_up, down)
    for name, g, w in zip(("out", "dx", "d gate_up", "d down"), got, want):
        _close(g, w, torch.float32, name)
    assert torch.all(got[0][13:] == 0)


def test_grouped_mlp_callable_activation_and_no_rows():
    """A callable activation (a model's act_fn) equals its name; zero rows give an empty output and zero
    weight gradients."""
    x, offsets, gate_up, down = _mlp_problem(torch.float32)
    w = gate_up.transpose(1, 2)
    torch.testing.assert_close(grouped_mlp(x, offsets, w, down.transpose(1, 2), torch.nn.SiLU()),
                               grouped_mlp(x, offsets, w, down.transpose(1, 2), "silu"))
    zero = torch.zeros(4, dtype=torch.int32, device=DEVICE)
    for backend in ["reference"] + (["triton"] if RUN_HERE else []):
        got = _mlp_grads(lambda a, b, c: grouped_mlp(a, zero, b, c, backend=backend), x[:0], gate_up, down)
        assert got[0].shape == (0, 20) and torch.all(got[2] == 0) and torch.all(got[3] == 0)


def test_grouped_mlp_pair_equals_fused_and_checks():
    x, offsets, gate_up, down = _mlp_problem(torch.float32)
    w = gate_up.transpose(1, 2)
    fused = grouped_mlp(x, offsets, w, down.transpose(1, 2))
    pair = grouped_mlp(x, offsets, tuple(w.chunk(2, dim=-1)), down.transpose(1, 2))
    torch.testing.assert_close(fused, pair)
    with pytest.raises(ValueError, match="activation must be one of"):
        grouped_mlp(x, offsets, w, down.transpose(1, 2), "relu")
    with pytest.raises(ValueError, match=r"w_down must be \[G, I=12, H_out\]"):
        grouped_mlp(x, offsets, w, down)
    with pytest.raises(ValueError, match=r"w_gate_up must be \[G, H, 2I\]"):
        grouped_mlp(x, offsets, w[..., :-1], down.transpose(1, 2))


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_mlp_triton_matches_reference(dtype):
    x, offsets, gate_up, down = _mlp_problem(dtype)
    got = _mlp_grads(lambda a, b, c: grouped_mlp(a, offsets, b, c, backend="triton"), x, gate_up, down)
    want = _mlp_grads(lambda a, b, c: grouped_mlp(a, offsets, b, c, backend="reference"), x, gate_up, down)
    for name, g, w in zip(("out", "dx", "d gate_up", "d down"), got, want):
        _close(g, w, dtype, name, TOL_MLP)


@kernel_test
def test_moe_layer_end_to_end_on_triton():
    """permute -> grouped_mlp -> unpermute (top-2 of 3 experts, one never chosen) against a per-token loop."""
    gen = torch.Generator().manual_seed(6)
    S, H, inter, E = 9, 20, 12, 3
    tokens = torch.randn(S, H, generator=gen).to(DEVICE)
    idx = torch.stack([torch.randperm(2, generator=gen) for _ in range(S)]).to(DEVICE)  # experts 0, 1 only
    weights = torch.softmax(torch.randn(S, 2, generator=gen), -1).to(DEVICE)
    _, offsets, gate_up, down = _mlp_problem(torch.float32, H, inter, (0, 0, 0), 1)
    sorted_rows, row_map, counts = permute(tokens, idx, E, backend="triton")
    assert counts.tolist() == [S, S, 0]
    y = grouped_mlp(sorted_rows, offsets_from_counts(counts), gate_up.transpose(1, 2), down.transpose(1, 2),
                    backend="triton")
    out = unpermute(y, row_map, weights, backend="triton")
    for s in range(S):
        want = sum(weights[s, j] * (torch.nn.functional.silu(tokens[s] @ gate_up[e, :inter].T)
                                    * (tokens[s] @ gate_up[e, inter:].T)) @ down[e].T
                   for j, e in enumerate(idx[s].tolist()))
        torch.testing.assert_close(out[s], want, rtol=1e-4, atol=1e-5)
