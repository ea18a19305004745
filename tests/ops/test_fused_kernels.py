"""lightspeed.ops.fused: RMSNorm, RoPE, SwiGLU (Triton, forward and backward) against HF's formulas in
reference.py, and the chunked fused linear cross-entropy (both paths) against
F.cross_entropy(F.linear(...)), on awkward shapes (odd hidden sizes, a transposed q, GQA, broadcast cos,
chunks that do not divide the tokens), fp32 and bf16, with ignore_index, label smoothing, soft-capping,
bias, both reductions. Kernels run under TRITON_INTERPRET=1 on CPU (tests/conftest.py), tiny shapes."""
from __future__ import annotations

import os

import pytest
import torch

from lightspeed.ops import fused
from lightspeed.ops.fused import reference
from lightspeed.ops.fused.linear_ce import default_chunk_size

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
kernel_test = pytest.mark.skipif(not (INTERPRET or DEVICE == "cuda"), reason="TRITON_INTERPRET=0 and no CUDA")
DTYPES = [torch.float32, torch.bfloat16]
# (rtol, atol as a fraction of the reference's largest magnitude). The kernels compute in fp32 and round
# once; the references round after every op in the inputs' dtype (HF's order), so bf16 differs by an ulp
# or two of bf16 (2^-8 relative); fp32 differs by summation order only.
TOL = {torch.float32: (1e-5, 1e-6), torch.bfloat16: (2e-2, 1.6e-2)}
# the linear cross-entropy's gradients go through two matmuls of a 16-bit softmax gradient, and dW is a
# sum over chunks rounded to bf16 once per chunk
TOL_CE = {torch.float32: (1e-5, 1e-6), torch.bfloat16: (3e-2, 2e-2)}


def _close(got, want, dtype, what, tol=TOL):
    rtol, atol = tol[dtype]
    scale = max(want.float().abs().max().item(), 0.1)  # an all-but-zero dx (hidden size 1)
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol * scale, msg=lambda m: f"{what}: {m}")


def _leaf(t):
    return t.detach().clone().requires_grad_(True)


def _run(fn, inputs, grads):
    leaves = [_leaf(t) for t in inputs]
    out = fn(*leaves)
    out = out if isinstance(out, tuple) else (out,)
    torch.autograd.backward(out, grads)
    return out, [t.grad for t in leaves]


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,wdtype", [((3, 5, 37), None), ((2, 64), None), ((4, 1), None), ((3, 20), "fp32")])
def test_rms_norm_matches_hf(dtype, shape, wdtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=g) * 3).to(DEVICE, dtype)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(DEVICE, torch.float32 if wdtype else dtype)
    dy = torch.randn(shape, generator=g).to(DEVICE, torch.promote_types(dtype, w.dtype))
    (y, ), (dx, dw) = _run(lambda a, b: fused.rms_norm(a, b, 1e-6, backend="triton"), [x, w], [dy])
    (y_ref, ), (dx_ref, dw_ref) = _run(lambda a, b: reference.rms_norm(a, b, 1e-6), [x, w], [dy])
    assert y.dtype == y_ref.dtype and dx.dtype == x.dtype and dw.dtype == w.dtype
    for got, want, what in ((y, y_ref, "y"), (dx, dx_ref, "dx"), (dw, dw_ref, "dw")):
        _close(got, want, dtype, f"rms_norm {what}")


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [1, 2])
def test_rope_matches_hf(dtype, dim):
    g = torch.Generator().manual_seed(1)
    B, T, H, KV, D = 2, 6, 3, 1, 10
    # q as HF makes it: a [B, T, H, D] projection transposed to [B, H, T, D] (not contiguous)
    q = torch.randn(B, T, H, D, generator=g).to(DEVICE, dtype)
    k = torch.randn(B, T, KV, D, generator=g).to(DEVICE, dtype)
    if dim == 1:
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    angle = torch.randn(1, T, D // 2, generator=g)
    cos = torch.cat([angle.cos(), angle.cos()], -1).to(DEVICE, dtype)  # [1, T, D]: broadcast over the batch
    sin = torch.cat([angle.sin(), (angle * 0.5).sin()], -1).to(DEVICE, dtype)  # the halves may differ
    grads = [torch.randn(q.shape, generator=g).to(DEVICE, dtype), torch.randn(k.shape, generator=g).to(DEVICE, dtype)]
    out, (dq, dk) = _run(lambda a, b: fused.apply_rope(a, b, cos, sin, dim, backend="triton"), [q, k], grads)
    ref, (dq_ref, dk_ref) = _run(lambda a, b: reference.apply_rope(a, b, cos, sin, dim), [q, k], grads)
    for got, want, what in ((out[0], ref[0], "q"), (out[1], ref[1], "k"), (dq, dq_ref, "dq"), (dk, dk_ref, "dk")):
        assert got.shape == want.shape and got.dtype == want.dtype, what
        _close(got, want, dtype, f"rope {what}")


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(4, 33), (2, 3, 5), (1300,)])
def test_swiglu_matches_reference(dtype, shape):
    g = torch.Generator().manual_seed(2)
    gate, up, dy = (torch.randn(shape, generator=g).to(DEVICE, dtype) * 2 for _ in range(3))
    (y, ), (dg, du) = _run(lambda a, b: fused.swiglu(a, b, backend="triton"), [gate, up], [dy])
    (y_ref, ), (dg_ref, du_ref) = _run(reference.swiglu, [gate, up], [dy])
    for got, want, what in ((y, y_ref, "y"), (dg, dg_ref, "dgate"), (du, du_ref, "dup")):
        _close(got, want, dtype, f"swiglu {what}")


def _ce_case(dtype, bias=True, seed=3, tokens=(2, 9), hidden=16, vocab=70):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*tokens, hidden, generator=g).to(DEVICE, dtype)
    w = (torch.randn(vocab, hidden, generator=g) * 0.3).to(DEVICE, dtype)
    b = torch.randn(vocab, generator=g).to(DEVICE, dtype) if bias else None
    t = torch.randint(0, vocab, tokens, generator=g)
    t[0, :4] = -100
    t[-1, -1] = -100
    return x, w, b, t.to(DEVICE)


CE_CASES = [  # (label_smoothing, softcap, reduction, chunk_size, bias)
    (0.0, None, "mean", 5, True), (0.1, None, "sum", 4, False), (0.1, 5.0, "mean", None, True),
    (0.0, 2.0, "sum", 18, False)]


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=kernel_test)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("smoothing,softcap,reduction,chunk,bias", CE_CASES)
def test_fused_linear_cross_entropy_matches_reference(backend, dtype, smoothing, softcap, reduction, chunk, bias):
    x, w, b, t = _ce_case(dtype, bias)
    inputs = [x, w] + ([b] if bias else [])
    kw = dict(label_smoothing=smoothing, softcap=softcap, reduction=reduction)

    def fast(x, w, b=None):
        return fused.fused_linear_cross_entropy(x, w, t, b, chunk_size=chunk, backend=backend, **kw)

    def spec(x, w, b=None):
        return reference.linear_cross_entropy(x.view(-1, x.shape[-1]), w, t.view(-1), b, **kw)

    (loss, ), grads = _run(fast, inputs, [torch.tensor(0.75, device=DEVICE)])  # a non-unit upstream gradient
    (loss_ref, ), grads_ref = _run(spec, inputs, [torch.tensor(0.75, device=DEVICE)])
    assert loss.dtype == torch.float32 and loss.dim() == 0
    _close(loss, loss_ref, dtype, "loss", TOL_CE)
    for got, want, what in zip(grads, grads_ref, ("dx", "dW", "db")):
        assert got.dtype == want.dtype, what
        _close(got, want, dtype, what, TOL_CE)


def test_fused_linear_cross_entropy_under_autocast_and_errors():
    x, w, b, t = _ce_case(torch.float32)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        loss = fused.fused_linear_cross_entropy(x, w, t, b)
        want = torch.nn.functional.cross_entropy(torch.nn.functional.linear(x, w, b).float().view(-1, 70), t.view(-1))
    torch.testing.assert_close(loss, want, rtol=2e-2, atol=2e-2)
    with torch.no_grad():  # no gradient wanted: the losses only
        loss = fused.fused_linear_cross_entropy(_leaf(x), w, t, b, label_smoothing=0.2, chunk_size=7)
    torch.testing.assert_close(loss, reference.linear_cross_entropy(x.view(-1, 16), w, t.view(-1), b,
                                                                    label_smoothing=0.2), rtol=1e-5, atol=1e-6)
    assert not loss.requires_grad
    with pytest.raises(ValueError, match="reduction must be one of mean, sum"):
        fused.fused_linear_cross_entropy(x, w, t, reduction="none")
    with pytest.raises(ValueError, match="does not fit weight"):
        fused.fused_linear_cross_entropy(x, w.t(), t)
    with pytest.raises(ValueError, match="targets for 18 rows"):
        fused.fused_linear_cross_entropy(x, w, t[:, :3])
    with pytest.raises(ValueError, match="share a dtype"):
        fused.fused_linear_cross_entropy(x, w.bfloat16(), t)
    with pytest.raises(ValueError, match="backend must be one of"):
        fused.fused_linear_cross_entropy(x, w, t, backend="cuda")
    xl = _leaf(x)
    loss = fused.fused_linear_cross_entropy(xl, w, t)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        loss.backward()
    assert default_chunk_size(4096, 128256, 2048) == 128 and default_chunk_size(18, 70, 16) == 4
    assert default_chunk_size(3, 10, 100) == 3  # never more than the tokens


@kernel_test
def test_rope_refuses_cos_with_grad_and_bad_shapes():
    q = torch.randn(1, 2, 3, 4, device=DEVICE)
    cos = torch.randn(1, 3, 4, device=DEVICE, requires_grad=True)
    with pytest.raises(ValueError, match="no gradient to cos"):
        fused.apply_rope(q, q, cos, cos, backend="triton")
    with pytest.raises(ValueError, match="head dim must be even"):
        fused.apply_rope(q[..., :3], q[..., :3], cos[..., :3], cos[..., :3])
    with pytest.raises(ValueError, match="weight \\[5\\] does not fit"):
        fused.rms_norm(q, torch.ones(5))


@kernel_test
def test_custom_ops_fake_implementations_match():
    """The Triton launchers' custom ops (what torch.compile sees): schema and fake shapes / dtypes / strides
    agree with the real kernels."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 4, 10, generator=g).to(DEVICE)
    w = torch.randn(10, generator=g).to(DEVICE, torch.bfloat16)
    q = torch.randn(2, 4, 3, 8, generator=g).to(DEVICE).transpose(1, 2)
    cos = torch.randn(2, 3, 8, generator=g).to(DEVICE)
    y, rstd = torch.ops.lightspeed.fused_rms_norm_forward(x, w, 1e-6)
    checks = [(torch.ops.lightspeed.fused_rms_norm_forward, (x, w, 1e-6)),
              (torch.ops.lightspeed.fused_rms_norm_backward, (torch.randn_like(y), x, w, rstd)),
              (torch.ops.lightspeed.fused_swiglu_forward, (x, x.bfloat16())),
              (torch.ops.lightspeed.fused_swiglu_backward, (x, x + 1, x - 1)),
              (torch.ops.lightspeed.fused_rope, (q, cos, cos.sin(), 2, True))]
    for op, args in checks:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
