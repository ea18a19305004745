"""Grouped GEMM for mixture-of-experts training: `grouped_mm` (each group of rows times its own matrix,
forward and backward through `GroupedMatmul`), the routing around it (`permute` / `unpermute`: tokens to
expert-sorted rows and back, weighted), and the experts' gated MLP built on both (`grouped_mlp`).

Owns: the grouped products and their gradients, the routing's gather / weighted combine, the choice of
kernel (`choose_backend`). `reference.py` is the spec and the CPU path, `triton.py` the kernels (imported
lazily). Must not: communicate (the all-to-all of expert parallelism is parallel/'s), or hold parameters
(callers own the [G, K, N] weights; HF's [experts, out, in] parameters are passed as `.transpose(1, 2)`
views, which every path reads through strides).

Note: [backend rule] Each `grouped_mm` (and each product of its backward) runs on one of three paths:
- "torch": `torch._grouped_mm` (CUTLASS), when every one holds: CUDA tensors, bf16, a Hopper GPU (compute
  capability 9.x), K and N multiples of 8 with 16-byte aligned pointers (its stride rule), and a probe
  call on that device succeeded (run once per device, never inside a CUDA-graph capture; a missing or
  failing `torch._grouped_mm` just rules this path out, logged once);
- "triton": the kernels of `triton.py`, for other CUDA tensors (fp32, fp16, awkward K / N, other GPUs);
- "reference": the loop over groups of `reference.py`, for CPU tensors (and for CUDA tensors when triton
  cannot be imported, logged once).
`backend=` ("auto" by default) or LIGHTSPEED_OPS_BACKEND=reference|triton|torch forces a path; a forced
path that cannot run raises ValueError saying why. "triton" on CPU tensors needs TRITON_INTERPRET=1 (the
tests' way). `permute` / `unpermute` have no torch path: "torch" runs the reference there.

Note: [rows past the last group] Rows of x from offsets[-1] on belong to no group; their rows of the
output and of dx are zero on every path (the Triton kernel stores zeros there; the torch path, whose
kernel leaves them unwritten, zeroes them with one masked fill). permute puts dropped routes there.

Note: [determinism] No path uses atomics: the same inputs give the same bits run to run (routing orders
routes stably by expert, and sums a token's k routes in j order in fp32).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable

import torch

from lightspeed._utils.logging import get_logger

from . import reference
from .reference import ACTIVATIONS

__all__ = ["ACTIVATIONS", "BACKENDS", "GroupedMatmul", "choose_backend", "grouped_mlp", "grouped_mm",
           "offsets_from_counts", "permute", "reference", "torch_grouped_mm_available", "unpermute"]

logger = get_logger(__name__)
BACKENDS = ("auto", "triton", "torch", "reference")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_logged: set[str] = set()
_probed: dict[tuple, bool] = {}


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        logger.info(message)


def _triton_importable() -> bool:
    try:
        importlib.import_module("triton")
    except ImportError:
        return False
    return True


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def torch_grouped_mm_available(device: torch.device) -> bool:
    """Whether `torch._grouped_mm` exists and a small bf16 call on `device` gives the right result
    (probed once per device; False without probing inside a CUDA-graph capture)."""
    device = torch.device(device)
    if not hasattr(torch, "_grouped_mm"):
        _log_once("grouped_mm: this torch has no torch._grouped_mm; the torch path is off")
        return False
    key = (device.type, device.index)
    if key not in _probed:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return False
        try:
            gen = torch.Generator().manual_seed(0)
            x = torch.randn(32, 16, generator=gen).to(device=device, dtype=torch.bfloat16)
            w = torch.randn(3, 16, 16, generator=gen).to(device=device, dtype=torch.bfloat16)
            offs = torch.tensor([16, 16, 32], dtype=torch.int32, device=device)
            got = torch._grouped_mm(x, w, offs=offs).float()
            want = reference.grouped_mm(x, w, offs).float()
            _probed[key] = bool(torch.allclose(got, want, rtol=2e-2, atol=2e-2))
            if not _probed[key]:
                _log_once(f"grouped_mm: torch._grouped_mm gave wrong results on {device}; the torch path is off")
        except (RuntimeError, NotImplementedError, TypeError) as exc:
            _probed[key] = False
            _log_once(f"grouped_mm: torch._grouped_mm fails on {device} ({type(exc).__name__}: "
                      f"{str(exc).splitlines()[0] if str(exc) else ''}); the torch path is off")
    return _probed[key]


def _torch_path_problem(x: torch.Tensor, w: torch.Tensor) -> str | None:
    """Why the torch path cannot take x @ w (None if it can); see Note: [backend rule]."""
    if not x.is_cuda:
        return "it runs on CUDA tensors only"
    if x.dtype != torch.bfloat16:
        return f"it is used for bf16 only, got {x.dtype}"
    if torch.cuda.get_device_capability(x.device)[0] != 9:
        return "it is used on Hopper (compute capability 9.x) only"
    if x.shape[1] % 8 or w.shape[2] % 8:
        return f"K and N must be multiples of 8 (16-byte strides), got K={x.shape[1]}, N={w.shape[2]}"
    if any(t.data_ptr() % 16 for t in (x, w)):
        return "its operands must be 16-byte aligned"
    if x.stride(1) != 1 or x.stride(0) % 8 or not ((w.stride(2) == 1 and w.stride(1) % 8 == 0)
                                                  or (w.stride(1) == 1 and w.stride(2) % 8 == 0)):
        return "x must be row-major and each w[g] row- or column-major, with 16-byte strides"
    if not torch_grouped_mm_available(x.device):
        return "torch._grouped_mm is missing or failed its probe on this device"
    return None


def choose_backend(x: torch.Tensor, w: torch.Tensor, backend: str = "auto") -> str:
    """The path ("triton", "torch" or "reference") of x @ w per Note: [backend rule]."""
    if backend == "auto":
        backend = os.environ.get("LIGHTSPEED_OPS_BACKEND", "auto") or "auto"
    if backend not in BACKENDS:
        raise ValueError(f"grouped_mm: backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "torch":
        problem = _torch_path_problem(x, w)
        if problem:
            raise ValueError(f"grouped_mm: the torch._grouped_mm path cannot run: {problem}")
        return "torch"
    if backend == "triton":
        if not _triton_importable():
            raise ValueError("grouped_mm: the triton path needs triton, which cannot be imported")
        if not x.is_cuda and not _interpreting():
            raise ValueError("grouped_mm: the triton path needs CUDA tensors or TRITON_INTERPRET=1")
        return "triton"
    if backend == "reference" or not x.is_cuda:
        return "reference"
    if _torch_path_problem(x, w) is None:
        return "torch"
    if _triton_importable():
        return "triton"
    _log_once("grouped_mm: triton cannot be imported; CUDA tensors run the reference loop")
    return "reference"


def _zero_tail(out: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    if out.shape[0] and offsets.numel():
        tail = torch.arange(out.shape[0], device=out.device) >= offsets[-1]
        out.masked_fill_(tail[:, None], 0)
    elif out.shape[0]:
        out.zero_()
    return out


def _mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, backend: str,
        zero_tail: bool = True) -> torch.Tensor:
    if backend == "triton":
        from . import triton as kernels

        return kernels.grouped_mm(x, w, offsets)
    if backend == "torch":
        if w.shape[0] == 0 or x.shape[0] == 0:
            return torch.zeros(x.shape[0], w.shape[2], dtype=x.dtype, device=x.device)
        out = torch._grouped_mm(x, w, offs=offsets)
        return _zero_tail(out, offsets) if zero_tail else out
    return reference.grouped_mm(x, w, offsets)


def _wgrad(x: torch.Tensor, dout: torch.Tensor, offsets: torch.Tensor, backend: str) -> torch.Tensor:
    if backend == "triton":
        from . import triton as kernels

        return kernels.wgrad(x, dout, offsets)
    if backend == "torch" and offsets.numel() and x.shape[0]:
        # 2-D x 2-D with offs: the groups split the reduction dimension (T); an empty group gives zeros
        return torch._grouped_mm(x.t(), dout, offs=offsets)
    return reference.grouped_mm_wgrad(x, dout, offsets)


class GroupedMatmul(torch.autograd.Function):
    """out = grouped_mm(x, w, offsets) with dx = grouped_mm(dout, w^T) (w^T a strided view) and dw[g] =
    x_g^T dout_g; forward and backward run on the path `backend` names (already resolved, see
    `choose_backend`). Use `grouped_mm`, which validates and resolves.

    zero_tail_out / zero_tail_dx: whether the torch path zeroes out's / dx's rows past the last group
    (Note: [rows past the last group]); the other paths always do. `grouped_mlp` turns off the ones
    whose rows only reach products that never read them (its inner tensors)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, backend: str,
                zero_tail_out: bool = True, zero_tail_dx: bool = True) -> torch.Tensor:
        ctx.save_for_backward(x, w, offsets)
        ctx.backend, ctx.zero_tail_dx = backend, zero_tail_dx
        return _mm(x, w, offsets, backend, zero_tail_out)

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        x, w, offsets = ctx.saved_tensors
        dout = dout.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = _mm(dout, w.transpose(1, 2), offsets, ctx.backend, ctx.zero_tail_dx)
        if ctx.needs_input_grad[1]:
            dw = _wgrad(x, dout, offsets, ctx.backend)
        return dx, dw, None, None, None, None


def _check_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> None:
    if x.dim() != 2 or w.dim() != 3:
        raise ValueError(f"grouped_mm: x must be [T, K] and w [G, K, N], got {tuple(x.shape)} and {tuple(w.shape)}")
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"grouped_mm: x has K={x.shape[1]} but w is [G, {w.shape[1]}, N]")
    if x.dtype not in _DTYPES or w.dtype != x.dtype:
        raise ValueError(f"grouped_mm: x and w must share one dtype of float32, bfloat16, float16, got {x.dtype} "
                         f"and {w.dtype}")
    if offsets.dtype != torch.int32 or offsets.dim() != 1 or offsets.shape[0] != w.shape[0]:
        raise ValueError(f"grouped_mm: offsets must be int32 [G={w.shape[0]}] cumulative group ends, got "
                         f"{offsets.dtype} {tuple(offsets.shape)}")
    if not (x.device == w.device == offsets.device):
        raise ValueError(f"grouped_mm: x, w and offsets must be on one device, got {x.device}, {w.device}, "
                         f"{offsets.device}")


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """out [T, N]: the rows of group g (rows offsets[g - 1] .. offsets[g] of x [T, K]) times w[g] (w [G, K,
    N]); rows past offsets[-1] give zero rows. offsets: int32 [G] cumulative ends (torch._grouped_mm's
    `offs`); groups may be empty. fp32 / bf16 / fp16 (x and w alike), fp32 accumulation, output in x's
    dtype. Differentiable in x and w (`GroupedMatmul`). Offsets' values are not checked on the device
    paths (that would wait for the device); the reference path raises on bad ones."""
    return _grouped_mm(x, w, offsets, backend, True, True)


def _grouped_mm(x, w, offsets, backend: str, zero_tail_out: bool, zero_tail_dx: bool) -> torch.Tensor:
    _check_mm(x, w, offsets)
    return GroupedMatmul.apply(x, w, offsets, choose_backend(x, w, backend), zero_tail_out, zero_tail_dx)


def offsets_from_counts(counts: torch.Tensor) -> torch.Tensor:
    """int32 cumulative ends [G] from per-group row counts [G] (no host sync)."""
    return torch.cumsum(counts, 0, dtype=torch.int32)


# ---- routing ------------------------------------------------------------------------------------------

def _routing_backend(t: torch.Tensor, backend: str) -> str:
    if backend == "auto":
        backend = os.environ.get("LIGHTSPEED_OPS_BACKEND", "auto") or "auto"
    if backend not in BACKENDS:
        raise ValueError(f"permute: backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "triton":
        if not _triton_importable():
            raise ValueError("permute: the triton path needs triton, which cannot be imported")
        if not t.is_cuda and not _interpreting():
            raise ValueError("permute: the triton path needs CUDA tensors or TRITON_INTERPRET=1")
        return "triton"
    if backend == "auto" and t.is_cuda and _triton_importable():
        return "triton"
    return "reference"


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens: torch.Tensor, expert_idx: torch.Tensor, num_experts: int):
        from . import triton as kernels

        order, row_map, counts = reference.route_order(expert_idx, num_experts)
        keys = reference.route_keys(expert_idx, num_experts)
        sorted_rows = kernels.gather_rows(tokens.contiguous(), order, keys, expert_idx.shape[1], num_experts)
        ctx.save_for_backward(row_map)
        ctx.mark_non_differentiable(row_map, counts)
        return sorted_rows, row_map, counts

    @staticmethod
    def backward(ctx, grad_sorted: torch.Tensor, _row_map, _counts):
        from . import triton as kernels

        (row_map,) = ctx.saved_tensors
        return kernels.combine(grad_sorted.contiguous(), row_map, None), None, None


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, sorted_out: torch.Tensor, row_map: torch.Tensor, weights: torch.Tensor):
        from . import triton as kernels

        sorted_out, weights = sorted_out.contiguous(), weights.contiguous()
        ctx.save_for_backward(sorted_out, row_map, weights)
        return kernels.combine(sorted_out, row_map, weights)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        from . import triton as kernels

        sorted_out, row_map, weights = ctx.saved_tensors
        grad_rows, grad_w = kernels.scatter_rows(grad.contiguous(), row_map, weights, sorted_out,
                                                 sorted_out.shape[0])
        return grad_rows, None, grad_w if ctx.needs_input_grad[2] else None


def permute(tokens: torch.Tensor, expert_idx: torch.Tensor, num_experts: int,
            backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted [S * k, H], row_map [S, k] int64, counts [E] int32) of tokens [S, H] routed by expert_idx [S, k]
    (integers; a route outside [0, num_experts) is dropped: -1 in row_map, a zero row after the kept
    ones, not counted). sorted's rows are the routes in expert order, stably (token order within an
    expert); row_map[s, j] is route (s, j)'s row. Differentiable in tokens. No host sync."""
    if tokens.dim() != 2 or expert_idx.dim() != 2 or expert_idx.shape[0] != tokens.shape[0]:
        raise ValueError(f"permute: tokens must be [S, H] and expert_idx [S, k], got {tuple(tokens.shape)} and "
                         f"{tuple(expert_idx.shape)}")
    if expert_idx.is_floating_point() or expert_idx.is_complex() or expert_idx.device != tokens.device:
        raise ValueError(f"permute: expert_idx must be integers on {tokens.device}, got {expert_idx.dtype} on "
                         f"{expert_idx.device}")
    if num_experts < 1:
        raise ValueError(f"permute: num_experts must be >= 1, got {num_experts}")
    if _routing_backend(tokens, backend) == "triton":
        return _Permute.apply(tokens, expert_idx, num_experts)
    return reference.permute(tokens, expert_idx, num_experts)


def unpermute(sorted_out: torch.Tensor, row_map: torch.Tensor, weights: torch.Tensor,
              backend: str = "auto") -> torch.Tensor:
    """out [S, H], out[s] = sum_j weights[s, j] * sorted_out[row_map[s, j]] over kept routes (row_map >= 0),
    in fp32, in sorted_out's dtype. Differentiable in sorted_out and weights ([S, k], any float dtype)."""
    if sorted_out.dim() != 2 or row_map.dim() != 2 or weights.shape != row_map.shape:
        raise ValueError(f"unpermute: sorted_out must be [R, H], row_map and weights [S, k], got "
                         f"{tuple(sorted_out.shape)}, {tuple(row_map.shape)}, {tuple(weights.shape)}")
    if row_map.dtype != torch.int64 or not weights.is_floating_point():
        raise ValueError(f"unpermute: row_map must be int64 (permute's) and weights floating point, got "
                         f"{row_map.dtype} and {weights.dtype}")
    if not (sorted_out.device == row_map.device == weights.device):
        raise ValueError("unpermute: sorted_out, row_map and weights must be on one device")
    if _routing_backend(sorted_out, backend) == "triton":
        return _Unpermute.apply(sorted_out, row_map.contiguous(), weights)
    return reference.unpermute(sorted_out, row_map, weights)


# ---- the experts' MLP ---------------------------------------------------------------------------------

def grouped_mlp(x: torch.Tensor, offsets: torch.Tensor, w_gate_up, w_down: torch.Tensor,
                activation: str | Callable[[torch.Tensor], torch.Tensor] = "silu",
                backend: str = "auto") -> torch.Tensor:
    """The experts' gated MLP on expert-sorted rows x [T, H]: for group g (offsets as in `grouped_mm`),
    (act(x_g @ W_gate[g]) * (x_g @ W_up[g])) @ w_down[g] -> [T, H_out]. w_gate_up: [G, H, 2I] (gate
    columns first, then up; HF's gate_up_proj [G, 2I, H] passed as .transpose(1, 2)) or a pair (w_gate,
    w_up) of [G, H, I]; w_down [G, I, H_out]. activation: "silu" (SwiGLU), "gelu" (GeGLU), "gelu_tanh", or
    an elementwise callable applied to the gate half (e.g. the model's act_fn).
    Products by `grouped_mm` (the same `backend`), activation and gating by torch in x's dtype;
    differentiable in x and every weight. Rows past offsets[-1] give zero rows."""
    if not callable(activation) and activation not in ACTIVATIONS:
        raise ValueError(f"grouped_mlp: activation must be one of {', '.join(ACTIVATIONS)}, got {activation!r}")
    pair = isinstance(w_gate_up, (tuple, list))
    if pair:
        if len(w_gate_up) != 2 or w_gate_up[0].shape != w_gate_up[1].shape:
            raise ValueError("grouped_mlp: a (w_gate, w_up) pair must hold two [G, H, I] tensors of one shape")
        inter = w_gate_up[0].shape[-1]
    else:
        if w_gate_up.dim() != 3 or w_gate_up.shape[-1] % 2:
            raise ValueError(f"grouped_mlp: w_gate_up must be [G, H, 2I], got {tuple(w_gate_up.shape)}")
        inter = w_gate_up.shape[-1] // 2
    if w_down.dim() != 3 or w_down.shape[1] != inter:
        raise ValueError(f"grouped_mlp: w_down must be [G, I={inter}, H_out], got {tuple(w_down.shape)}")
    # the inner tensors' rows past the last group reach only grouped products, which never read them: the
    # torch path leaves them unwritten (GroupedMatmul's zero_tail_*); the output and dx are zeroed there
    if pair:
        gate = _grouped_mm(x, w_gate_up[0], offsets, backend, False, True)
        up = _grouped_mm(x, w_gate_up[1], offsets, backend, False, True)
    else:
        gate, up = _grouped_mm(x, w_gate_up, offsets, backend, False, True).chunk(2, dim=-1)
    return _grouped_mm(reference.activate(gate, activation) * up, w_down, offsets, backend, True, False)
