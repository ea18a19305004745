"""Fused training kernels for transformer blocks: RMSNorm, rotary position embedding (RoPE), SwiGLU and the
chunked linear + cross-entropy head (the kernels Liger-Kernel made common), each forward and backward.

Owns: `rms_norm`, `apply_rope`, `swiglu`, `fused_linear_cross_entropy`, their autograd.Functions on the
Triton path, and the choice of path (`choose_backend`). `reference.py` is the spec (HF Llama's formulas,
`F.cross_entropy(F.linear(...))`) and the CPU path; `triton.py` the kernels (imported lazily);
`linear_ce.py` the chunked head. Must not: know model classes (runtime/kernel_patch.py swaps these in),
or communicate.

Note: [backend rule] Each call runs on one of two paths: "triton" for CUDA tensors when triton imports,
"reference" otherwise (CPU tensors; CUDA without triton, logged once). `backend=` ("auto" by default) or
LIGHTSPEED_OPS_BACKEND=reference|triton forces a path; "triton" on CPU tensors needs TRITON_INTERPRET=1
(the tests' way), and a forced path that cannot run raises ValueError saying why. The linear
cross-entropy is chunked on both paths (the reference path computes each chunk's loss and logits
gradient with torch ops); the plain, unchunked spec is `reference.linear_cross_entropy`.

Note: [precision] Statistics and elementwise math run in fp32 and round once to the output dtype (the
references round after each op, as HF does: the tolerance table in tests/ops/test_fused_kernels.py).
RMSNorm rounds the normalised row to x's dtype before the weight multiplies it (HF's order); outputs are
promote(x, weight) for RMSNorm, promote(q, cos) for RoPE, as the references' type promotion gives.

Note: [torch.compile] RMSNorm, RoPE and SwiGLU are autograd.Functions whose forward and backward call
torch custom ops (lightspeed::fused_*), one per Triton launcher, with fake implementations: the compiler
traces the Functions and keeps each launch as one opaque call, with no graph break. The linear
cross-entropy runs under `torch.compiler.disable`: a graph break at the loss, the chunk loop eager (its
time is the matmuls; a traced loop would let the compiler keep chunks' logits alive together).
"""

from __future__ import annotations

import importlib
import importlib.util
import os

import torch

from lightspeed._utils.logging import get_logger

from . import reference
from .linear_ce import LinearCrossEntropy, check_arguments, chunked_loss, default_chunk_size

__all__ = ["BACKENDS", "choose_backend", "fused_linear_cross_entropy", "reference", "rms_norm", "apply_rope",
           "swiglu"]

logger = get_logger(__name__)
BACKENDS = ("auto", "triton", "reference")
_logged: set[str] = set()


def _kernels():
    return importlib.import_module("lightspeed.ops.fused.triton")


_HAS_TRITON = importlib.util.find_spec("triton") is not None  # found, not imported (Note: [TRITON_INTERPRET])


def _triton_importable() -> bool:
    return _HAS_TRITON


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def choose_backend(x: torch.Tensor, backend: str = "auto", what: str = "fused kernels") -> str:
    """The path ("triton" or "reference") for inputs on x's device, per Note: [backend rule]."""
    if backend == "auto":
        backend = os.environ.get("LIGHTSPEED_OPS_BACKEND", "auto") or "auto"
    if backend not in BACKENDS:
        raise ValueError(f"{what}: backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "triton":
        if not _triton_importable():
            raise ValueError(f"{what}: the triton path needs triton, which cannot be imported")
        if not x.is_cuda and not _interpreting():
            raise ValueError(f"{what}: the triton path needs CUDA tensors or TRITON_INTERPRET=1")
        return "triton"
    if backend == "reference" or not x.is_cuda:
        return "reference"
    if not _triton_importable():
        message = f"{what}: triton cannot be imported; CUDA tensors take the reference path"
        if message not in _logged:
            _logged.add(message)
            logger.warning(message)
        return "reference"
    return "triton"


# ------------------------------------------------------------------------------------------------ custom ops
# The Triton launchers as torch custom ops: torch.compile keeps each as one opaque call (its fake
# implementation gives the shapes), so nothing of the launchers is traced (Note: [torch.compile]).
@torch.library.custom_op("lightspeed::fused_rms_norm_forward", mutates_args=())
def _rms_forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _kernels().rms_norm_forward(x, weight, eps)


@_rms_forward.register_fake
def _(x, weight, eps):
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return (x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype)),
            x.new_empty(rows, dtype=torch.float32))


@torch.library.custom_op("lightspeed::fused_rms_norm_backward", mutates_args=())
def _rms_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                  rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _kernels().rms_norm_backward(dy, x, weight, rstd)


@_rms_backward.register_fake
def _(dy, x, weight, rstd):
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(weight)


@torch.library.custom_op("lightspeed::fused_rope", mutates_args=())
def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int,
          backward: bool) -> torch.Tensor:
    return _kernels().rope_apply(x, _broadcast(cos, unsqueeze_dim, x.shape), _broadcast(sin, unsqueeze_dim, x.shape),
                                 backward=backward)


@_rope.register_fake
def _(x, cos, sin, unsqueeze_dim, backward):
    return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, cos.dtype))


@torch.library.custom_op("lightspeed::fused_swiglu_forward", mutates_args=())
def _swiglu_forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return _kernels().swiglu_forward(gate, up)


@_swiglu_forward.register_fake
def _(gate, up):
    return gate.new_empty(gate.shape, dtype=torch.promote_types(gate.dtype, up.dtype))


@torch.library.custom_op("lightspeed::fused_swiglu_backward", mutates_args=())
def _swiglu_backward(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _kernels().swiglu_backward(dy, gate.contiguous(), up.contiguous())


@_swiglu_backward.register_fake
def _(dy, gate, up):
    return (torch.empty_like(gate, memory_format=torch.contiguous_format),
            torch.empty_like(up, memory_format=torch.contiguous_format))


# ------------------------------------------------------------------------------------------------ RMSNorm
class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        y, rstd = _rms_forward(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = _rms_backward(dy, x, weight, rstd)
        return dx, dw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, backend: str = "auto") -> torch.Tensor:
    """HF LlamaRMSNorm(x) with `weight` [hidden] and `eps` (reference.rms_norm is the spec)."""
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"rms_norm: weight {list(weight.shape)} does not fit x [..., {x.shape[-1]}]")
    if choose_backend(x, backend, "rms_norm") == "reference":
        return reference.rms_norm(x, weight, eps)
    return RMSNormFunction.apply(x, weight, float(eps))


# ------------------------------------------------------------------------------------------------ RoPE
def _broadcast(t: torch.Tensor, dim: int, shape: torch.Size) -> torch.Tensor:
    return t.unsqueeze(dim).expand(shape)


class RoPEFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin, unsqueeze_dim):
        ctx.save_for_backward(cos, sin)
        ctx.unsqueeze_dim, ctx.q_dtype, ctx.k_dtype = unsqueeze_dim, q.dtype, k.dtype
        return _rope(q, cos, sin, unsqueeze_dim, False), _rope(k, cos, sin, unsqueeze_dim, False)

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        gq = _rope(dq, cos, sin, ctx.unsqueeze_dim, True).to(ctx.q_dtype) if dq is not None else None
        gk = _rope(dk, cos, sin, ctx.unsqueeze_dim, True).to(ctx.k_dtype) if dk is not None else None
        return gq, gk, None, None, None


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1,
               backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """HF apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim): q, k 4-D ([B, heads, T, D] with
    unsqueeze_dim 1, [B, T, heads, D] with 2), cos / sin [B or 1, T, D]; no gradient flows to cos / sin
    on the Triton path (ValueError if they require one)."""
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or cos.shape != sin.shape:
        raise ValueError(f"apply_rope: wants 4-D q, k and 3-D cos, sin of one shape (got q {list(q.shape)}, "
                         f"k {list(k.shape)}, cos {list(cos.shape)}, sin {list(sin.shape)})")
    if q.shape[-1] % 2 or q.shape[-1] != k.shape[-1] or cos.shape[-1] != q.shape[-1]:
        raise ValueError(f"apply_rope: head dim must be even and shared by q, k, cos (got {q.shape[-1]}, "
                         f"{k.shape[-1]}, {cos.shape[-1]})")
    if choose_backend(q, backend, "apply_rope") == "reference":
        return reference.apply_rope(q, k, cos, sin, unsqueeze_dim)
    if cos.requires_grad or sin.requires_grad:
        raise ValueError("apply_rope: the triton path gives no gradient to cos / sin; detach them or pass "
                         "backend='reference'")
    return RoPEFunction.apply(q, k, cos, sin, unsqueeze_dim)


# ------------------------------------------------------------------------------------------------ SwiGLU
class SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return _swiglu_forward(gate, up)

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        dg, du = _swiglu_backward(dy, gate, up)
        return dg, du


def swiglu(gate: torch.Tensor, up: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """silu(gate) * up (LlamaMLP's act_fn(gate_proj(x)) * up_proj(x) with act silu)."""
    if gate.shape != up.shape:
        raise ValueError(f"swiglu: gate {list(gate.shape)} and up {list(up.shape)} differ")
    if choose_backend(gate, backend, "swiglu") == "reference":
        return reference.swiglu(gate, up)
    return SwiGLUFunction.apply(gate, up)


# ------------------------------------------------------------------------------------------------ linear CE
@torch.compiler.disable
def fused_linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                               bias: torch.Tensor | None = None, ignore_index: int = -100,
                               label_smoothing: float = 0.0, reduction: str = "mean", softcap: float | None = None,
                               chunk_size: int | None = None, backend: str = "auto") -> torch.Tensor:
    """CE(x @ weight^T + bias, target) with x [..., H], weight [V, H], target [...] (int), chunked over the
    tokens (linear_ce.py's Notes); reference.linear_cross_entropy is the spec. Under autocast the
    product runs in the autocast dtype, as F.linear's would."""
    check_arguments(x, weight, target, bias, ignore_index, label_smoothing, reduction, softcap, chunk_size)
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        x, weight = x.to(dtype), weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
    if x.dtype != weight.dtype or (bias is not None and bias.dtype != weight.dtype):
        raise ValueError(f"fused_linear_cross_entropy: x, weight and bias must share a dtype (got {x.dtype}, "
                         f"{weight.dtype}, {bias.dtype if bias is not None else None})")
    path = choose_backend(x, backend, "fused_linear_cross_entropy")
    chunk_fn = _kernels().ce_chunk_grad if path == "triton" else reference.ce_chunk_grad
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    target = target.reshape(-1).contiguous()
    chunk = chunk_size or default_chunk_size(x2.shape[0], weight.shape[0], weight.shape[1])
    args = (x2, weight, bias, target, int(ignore_index), float(label_smoothing), reduction, softcap, chunk, chunk_fn)
    if not torch.is_grad_enabled() or not any(t is not None and t.requires_grad for t in (x2, weight, bias)):
        with torch.autocast(device_type, enabled=False):  # evaluation: the losses only, no gradient computed
            return chunked_loss(*args, needs=(False, False, False))[0]
    with torch.autocast(device_type, enabled=False):
        return LinearCrossEntropy.apply(*args)
