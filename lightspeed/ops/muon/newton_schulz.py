"""Newton-Schulz orthogonalisation for Muon, with DeepSpeed's coefficients, steps, dtypes and scaling.

Owns: the two iterations DeepSpeed's Muon offers (`ns_method` "standard": the quintic iteration on the
rectangular matrix; "gram": the same polynomial iterated on the small Gram matrix X Xᵀ, restarted once),
each as a plain PyTorch reference written op for op as DeepSpeed's, and a fast path that fuses each
"scalar times matrix plus product" into one addmm/baddbmm (and is torch.compile'd on CUDA;
LIGHTSPEED_OPS_BACKEND=reference runs the reference there instead); the compute dtype per method and
device; the aspect-ratio scale; `muon_update` (momentum, Nesterov blend, orthogonalisation, scale) for
one whole matrix. Must not: know about shards, ranks or optimizers.

Note [DeepSpeed's numbers]: coefficients (a, b, c) = (3.4445, -4.7750, 2.0315), five steps, the input
divided by its Frobenius norm + 1e-7, a tall matrix iterated on its transpose, the result scaled by
sqrt(rows / cols) when rows > cols (of the gradient's last two dims, also for a 4-D conv filter,
which is iterated viewed as [out, in*kh*kw]). "standard" casts to its compute dtype before the
normalisation; "gram" normalises first, in fp32 for fp16 input (fp16's range would overflow) and in
the input's dtype otherwise, then casts. Gram restarts at step 2 (X <- Q X, R <- X Xᵀ) and iterates as
"standard" on square (or tall-after-transpose-equal) matrices, where it saves nothing.

Note [compute dtype]: as DeepSpeed's accelerator answers: "gram" in fp16 where fp16 is supported
(CUDA; a CPU whose oneDNN has fp16), else fp32; "standard" in bf16 (CUDA and CPU both report bf16).

Note [fast path]: `b*A + c*(A@A)` becomes addmm(A, A, A, beta=b, alpha=c) and `a*X + B@X`
addmm(X, B, X, beta=a): one kernel and one pass over the output instead of three. The product is
accumulated before the single rounding, so in a half dtype the result differs from the reference by
rounding (the tests bound it per dtype); in fp32 they agree to ~1e-6.
"""

from __future__ import annotations

import math
import os

import torch

__all__ = ["NS_METHODS", "NS_COEFFICIENTS", "NS_STEPS", "ns_compute_dtype", "newton_schulz", "newton_schulz_reference",
           "aspect_ratio_scale", "muon_update", "orthogonalize"]

NS_METHODS = ("gram", "standard")
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
_GRAM_RESTART = 2
_NORM_EPS = 1e-7


def ns_compute_dtype(method: str, device: torch.device | str) -> torch.dtype:
    """The dtype the iteration of `method` runs in on `device` (see Note [compute dtype])."""
    device = torch.device(device)
    if method == "gram":
        if device.type == "cuda":
            return torch.float16
        if device.type == "cpu" and _cpu_fp16():
            return torch.float16
        return torch.float32
    if method == "standard":
        return torch.bfloat16 if device.type in ("cuda", "cpu") else torch.float32
    raise ValueError(f"ns_method must be one of {NS_METHODS}, got {method!r}")


def _cpu_fp16() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):
        return False


def aspect_ratio_scale(rows: int, cols: int) -> float:
    """sqrt(rows / cols) for a tall matrix, 1 otherwise."""
    return math.sqrt(rows / cols) if rows > cols else 1.0


# ------------------------------------------------------------------------------------------------
# The reference: DeepSpeed's iterations, op for op.


def _standard_ref(G: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    a, b, c = NS_COEFFICIENTS
    X = G.to(dtype)
    tall = G.size(-2) > G.size(-1)
    if tall:
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + _NORM_EPS)
    for _ in range(steps):
        A = X @ X.mT
        B = b * A + c * A @ A
        X = a * X + B @ X
    return X.mT if tall else X


def _gram_ref(G: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    a, b, c = NS_COEFFICIENTS
    X = G.to(torch.float32 if G.dtype == torch.float16 else G.dtype)
    tall = G.size(-2) > G.size(-1)
    if tall:
        X = X.mT
    n, m = X.size(-2), X.size(-1)
    X = (X / (X.norm(dim=(-2, -1), keepdim=True) + _NORM_EPS)).to(dtype)
    if m <= n:
        for _ in range(steps):
            A = X @ X.mT
            B = b * A + c * A @ A
            X = a * X + B @ X
        return X.mT if tall else X
    R = X @ X.mT
    Q = None
    for i in range(steps):
        if i == _GRAM_RESTART:
            X = Q @ X
            R = X @ X.mT
            Q = None
        Z = b * R + c * R @ R
        if Q is None:
            Q = Z.clone()
            Q.diagonal(dim1=-2, dim2=-1).add_(a)
        else:
            Q = a * Q + Z @ Q
        if i < steps - 1 and i + 1 != _GRAM_RESTART:
            RZ = a * R + Z @ R
            R = a * RZ + Z @ RZ
    return X.mT @ Q.mT if tall else Q @ X


def newton_schulz_reference(G: torch.Tensor, steps: int = NS_STEPS, method: str = "gram",
                            dtype: torch.dtype | None = None) -> torch.Tensor:
    """DeepSpeed's iteration of `method` on G (2-D, or batched over leading dims), in `dtype` (default:
    `ns_compute_dtype`). Returns the compute dtype."""
    dtype = dtype or ns_compute_dtype(method, G.device)
    if G.ndim < 2:
        raise ValueError(f"Newton-Schulz needs a matrix, got shape {tuple(G.shape)}")
    return (_gram_ref if method == "gram" else _standard_ref)(G, steps, dtype)


# ------------------------------------------------------------------------------------------------
# The fast path: the same iterations with each `s*M + P@Q` one addmm / baddbmm.


def _fma(bias: torch.Tensor, m1: torch.Tensor, m2: torch.Tensor, beta: float, alpha: float = 1.0) -> torch.Tensor:
    """beta * bias + alpha * (m1 @ m2) in one kernel."""
    if bias.ndim == 2:
        return torch.addmm(bias, m1, m2, beta=beta, alpha=alpha)
    return torch.baddbmm(bias, m1, m2, beta=beta, alpha=alpha)


def _flat_batch(X: torch.Tensor) -> torch.Tensor:
    return X if X.ndim <= 3 else X.reshape(-1, *X.shape[-2:])


def _iterate_standard(X: torch.Tensor, steps: int) -> torch.Tensor:
    a, b, c = NS_COEFFICIENTS
    for _ in range(steps):
        A = X @ X.mT
        B = _fma(A, A, A, beta=b, alpha=c)
        X = _fma(X, B, X, beta=a)
    return X


def _ns_fast(G: torch.Tensor, steps: int, method: str, dtype: torch.dtype) -> torch.Tensor:
    a, b, c = NS_COEFFICIENTS
    shape = G.shape
    G = _flat_batch(G)
    tall = G.size(-2) > G.size(-1)
    if method == "standard":
        X = G.to(dtype)
        X = X.mT if tall else X
        X = X / (X.norm(dim=(-2, -1), keepdim=True) + _NORM_EPS)
        X = _iterate_standard(X.contiguous(), steps)
        return (X.mT if tall else X).reshape(shape)
    X = G.to(torch.float32 if G.dtype == torch.float16 else G.dtype)
    X = X.mT if tall else X
    n, m = X.size(-2), X.size(-1)
    X = (X / (X.norm(dim=(-2, -1), keepdim=True) + _NORM_EPS)).to(dtype).contiguous()
    if m <= n:
        X = _iterate_standard(X, steps)
        return (X.mT if tall else X).reshape(shape)
    R = X @ X.mT
    Q = None
    for i in range(steps):
        if i == _GRAM_RESTART:
            X = Q @ X
            R = X @ X.mT
            Q = None
        Z = _fma(R, R, R, beta=b, alpha=c)
        if Q is None:
            Q = Z.clone()
            Q.diagonal(dim1=-2, dim2=-1).add_(a)
        else:
            Q = _fma(Q, Z, Q, beta=a)
        if i < steps - 1 and i + 1 != _GRAM_RESTART:
            RZ = _fma(R, Z, R, beta=a)
            R = _fma(RZ, Z, RZ, beta=a)
    out = X.mT @ Q.mT if tall else Q @ X
    return out.reshape(shape)


_COMPILED = {}


def _compiled_fast():
    fn = _COMPILED.get("fast")
    if fn is None:
        fn = _COMPILED["fast"] = torch.compile(_ns_fast, dynamic=False)
    return fn


def newton_schulz(G: torch.Tensor, steps: int = NS_STEPS, method: str = "gram", dtype: torch.dtype | None = None,
                  compile: bool | None = None) -> torch.Tensor:
    """The fast path of `newton_schulz_reference` (see Note [fast path]); `compile` (default: on CUDA
    unless LIGHTSPEED_OPS_BACKEND=reference, which runs the reference instead) runs it torch.compile'd."""
    if method not in NS_METHODS:
        raise ValueError(f"ns_method must be one of {NS_METHODS}, got {method!r}")
    if G.ndim < 2:
        raise ValueError(f"Newton-Schulz needs a matrix, got shape {tuple(G.shape)}")
    dtype = dtype or ns_compute_dtype(method, G.device)
    if compile is None:
        backend = os.environ.get("LIGHTSPEED_OPS_BACKEND", "auto")
        if backend == "reference" and G.is_cuda:
            return newton_schulz_reference(G, steps, method, dtype)
        compile = G.is_cuda
    if compile:
        return _compiled_fast()(G, steps, method, dtype)
    return _ns_fast(G, steps, method, dtype)


def muon_update(grad: torch.Tensor, momentum: torch.Tensor, beta: float = 0.95, ns_steps: int = NS_STEPS,
                nesterov: bool = True, ns_method: str = "gram", reference: bool = False,
                compile: bool | None = None) -> torch.Tensor:
    """DeepSpeed's Muon update of one whole matrix: the momentum takes the gradient (unless the gradient
    holds inf/nan, which then passes through as the update), the Nesterov blend (written into `grad`)
    is orthogonalised and scaled. Returns the update in `grad`'s dtype."""
    finite = torch.isfinite(grad).all()
    momentum.copy_(torch.where(finite, momentum.lerp(grad, 1 - beta), momentum))
    update = grad.lerp_(momentum, beta) if nesterov else momentum
    update = orthogonalize(update, ns_steps, ns_method, reference=reference, compile=compile,
                           scale_shape=grad.shape)
    return torch.where(finite, update.to(grad.dtype).reshape(grad.shape), grad)


def orthogonalize(update: torch.Tensor, ns_steps: int = NS_STEPS, ns_method: str = "gram", *,
                  reference: bool = False, compile: bool | None = None, scale_shape=None) -> torch.Tensor:
    """Newton-Schulz of `update` (a 4-D filter viewed as [out, rest]) times the aspect-ratio scale of
    `scale_shape`'s last two dims (default: `update`'s). Returns the compute dtype."""
    scale_shape = scale_shape if scale_shape is not None else update.shape
    if update.ndim == 4:
        update = update.reshape(len(update), -1)
    if reference:
        out = newton_schulz_reference(update, ns_steps, ns_method)
    else:
        out = newton_schulz(update, ns_steps, ns_method, compile=compile)
    return out * aspect_ratio_scale(scale_shape[-2], scale_shape[-1])
