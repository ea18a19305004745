"""Weight-only quantized matmul (FP6 e3m2, INT8, INT4): quantizers and packing in `reference.py`,
Triton kernels in `kernels.py` (launched by `triton.py`) and `grouped.py` (imported only when a CUDA tensor needs them), and the
dispatchers `quantized_matmul` and `grouped_quantized_matmul` (a MoE layer's experts), which validate
inputs, run Triton on CUDA and the plain-PyTorch reference on CPU. Imports only torch and the layers
below ops/."""

from __future__ import annotations

import contextlib

import torch

from lightspeed._utils.logging import get_logger

from .reference import (
    FORMATS,
    QuantizedWeight,
    dequantize,
    fp6_code_values,
    fp6_decode,
    fp6_encode,
    fp6_to_fp16_bits,
    plane_specs,
    quantize,
    reference_grouped_matmul,
    reference_matmul,
    stack_weights,
)

logger = get_logger(__name__)
_KERNEL_DTYPES = (torch.float16, torch.bfloat16)
_logged: set[str] = set()


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        logger.info(message)


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _check_args(x: torch.Tensor, qweight: QuantizedWeight, bias: torch.Tensor | None) -> None:
    n, k = qweight.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features but the quantized weight expects K={k}")
    if not x.is_floating_point() or x.dtype not in (*_KERNEL_DTYPES, torch.float32):
        raise ValueError(f"x must be float16, bfloat16 or float32 (got {x.dtype})")
    if x.device != qweight.device:
        raise ValueError(f"x is on {x.device} but the quantized weight is on {qweight.device}")
    if bias is not None and (bias.shape != (n,) or bias.device != x.device):
        raise ValueError(f"bias must have shape ({n},) on {x.device} (got {tuple(bias.shape)} on {bias.device})")


def quantized_matmul(x: torch.Tensor, qweight: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ dequant(W).T (+ bias). x: [..., K] (fp16/bf16 for the kernel; fp32 runs the reference),
    W: packed [N, K]; y: [..., N] in x's dtype, accumulated in fp32. CUDA -> Triton kernel (from 512
    rows of x on, 1024 for int4: the weight dequantized once by Triton, then torch.matmul), CPU ->
    reference. Raises ValueError for a wrong K, dtype or device.

    Under torch.compile, and when x or bias needs a gradient, it runs as the operator
    `torch.ops.lightspeed.quantized_matmul` (Note: torch.compile), whose backward gives x and bias their
    gradients (the packed weight is frozen: no gradient)."""
    _check_args(x, qweight, bias)
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad))
    if needs_grad or torch.compiler.is_compiling():  # the operator carries the backward formula
        return torch.ops.lightspeed.quantized_matmul(x, list(qweight.planes), qweight.scales, bias, qweight.format,
                                                     qweight.shape[0], qweight.shape[1], qweight.group_size,
                                                     qweight.dtype, qweight.tile)
    return _matmul(x, qweight, bias)


def _matmul(x: torch.Tensor, qweight: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    n, k = qweight.shape
    if x.device.type != "cuda":
        return reference_matmul(x, qweight, bias)
    if x.dtype not in _KERNEL_DTYPES:
        _log_once(f"quantized_matmul: {x.dtype} activations run the dequantize+matmul reference (kernel: fp16/bf16)")
        return reference_matmul(x, qweight, bias)
    from .triton import wq_matmul  # lazy: imports triton

    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if x2.shape[0] == 0:
        return x.new_empty((*lead, n))
    if bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous()):
        bias = bias.to(x.dtype).contiguous()
    on_current = x.device.index == torch.cuda.current_device()  # triton launches on the current device
    with contextlib.nullcontext() if on_current else torch.cuda.device(x.device):
        return wq_matmul(x2, qweight, bias).reshape(*lead, n)


MAX_GROUPED_ROWS = 64  # the grouped kernel takes one M block: a decode step's routes (tokens x top-k)


def grouped_quantized_matmul(x: torch.Tensor, qweight: QuantizedWeight, experts: torch.Tensor) -> torch.Tensor:
    """The experts' products of a mixture-of-experts layer, in route order: y [T * k, N] with y[t * k + i] =
    x[t] @ dequant(W_e).T for e = experts[t, i]; routes to no expert (e outside [0, E)) give zero rows.
    `qweight` stacks E experts' [N, K] weights (planes [E, ...], scales [E, N, groups];
    `QuantizedWeight.expert`); x [T, K]; experts [T, k] integers on x's device, read on the device, so a
    CUDA call neither syncs with the host nor reads the weights of experts no route chose (each chosen
    one's once). CUDA: one Triton launch for fp16/bf16 x, T * k <= MAX_GROUPED_ROWS; CPU: the reference.
    Under torch.compile, the operator `torch.ops.lightspeed.grouped_quantized_matmul`. No backward: an x
    that needs a gradient is refused, as is anything else malformed (ValueError)."""
    planes, scales = qweight.planes, qweight.scales
    n, k = qweight.shape
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be [tokens, {k}] (got {tuple(x.shape)})")
    groups = 1 if qweight.group_size is None else -(-k // qweight.group_size)
    if scales.dim() != 3 or tuple(scales.shape[1:]) != (n, groups) or not scales.is_contiguous() or len(planes) != 1:
        raise ValueError(f"grouped_quantized_matmul: scales must be a contiguous [experts, {n}, {groups}] "
                         f"(got {tuple(scales.shape)}, strides {scales.stride()})")
    num_experts = scales.shape[0]
    (shape, dtype), = plane_specs(qweight.format, n, k, qweight.tile)
    if tuple(planes[0].shape) != (num_experts, *shape) or planes[0].dtype != dtype or not planes[0].is_contiguous():
        raise ValueError(f"grouped_quantized_matmul: the packed planes must be a contiguous {dtype} "
                         f"{(num_experts, *shape)} (got {planes[0].dtype} {tuple(planes[0].shape)})")
    if (experts.dim() != 2 or experts.shape[0] != x.shape[0] or experts.is_floating_point()
            or experts.is_complex() or experts.device != x.device):
        raise ValueError(f"experts must be [{x.shape[0]}, top_k] integers on {x.device} (got {experts.dtype} "
                         f"{tuple(experts.shape)} on {experts.device})")
    if x.device != qweight.device:
        raise ValueError(f"x is on {x.device} but the quantized weights are on {qweight.device}")
    if torch.is_grad_enabled() and x.requires_grad:
        raise ValueError("grouped_quantized_matmul has no backward: x must not require a gradient "
                         "(QuantizedExperts runs its per-expert layers then)")
    if torch.compiler.is_compiling():  # one graph node (Note: torch.compile)
        return torch.ops.lightspeed.grouped_quantized_matmul(x, list(planes), scales, experts, qweight.format, n, k,
                                                             qweight.group_size, qweight.dtype, qweight.tile)
    return _grouped_matmul(x, qweight, experts)


def _grouped_matmul(x: torch.Tensor, qweight: QuantizedWeight, experts: torch.Tensor) -> torch.Tensor:
    if x.device.type != "cuda":
        return reference_grouped_matmul(x, qweight, experts)
    if x.dtype not in _KERNEL_DTYPES or experts.numel() > MAX_GROUPED_ROWS:
        raise ValueError(f"grouped_quantized_matmul on CUDA takes fp16/bf16 x and at most {MAX_GROUPED_ROWS} routes "
                         f"(got {x.dtype}, {experts.numel()} routes)")
    from .grouped import wq_grouped_matmul  # lazy: imports triton

    if x.stride(-1) != 1:
        x = x.contiguous()
    with contextlib.nullcontext() if x.device.index == torch.cuda.current_device() else torch.cuda.device(x.device):
        return wq_grouped_matmul(x, qweight, experts.contiguous())


@torch.library.custom_op("lightspeed::grouped_quantized_matmul", mutates_args=())
def _grouped_quantized_matmul_op(x: torch.Tensor, planes: list[torch.Tensor], scales: torch.Tensor,
                                 experts: torch.Tensor, weight_format: str, n: int, k: int, group_size: int | None,
                                 dtype: torch.dtype, tile: int) -> torch.Tensor:
    """`grouped_quantized_matmul` as one operator for torch.compile (as `quantized_matmul`'s below)."""
    return _grouped_matmul(x, QuantizedWeight(weight_format, (n, k), group_size, tuple(planes), scales, dtype, tile),
                           experts)


@_grouped_quantized_matmul_op.register_fake
def _grouped_quantized_matmul_fake(x, planes, scales, experts, weight_format, n, k, group_size, dtype, tile):
    return x.new_empty((experts.numel(), n))


def reserve_scratch(device: torch.device, weight_format: str, n: int) -> None:
    """Size the kernel's per-device scratch buffers for a layer of `n` outputs on `device` (a CUDA device)
    ahead of its first call (triton.py `reserve_scratch`)."""
    from .triton import reserve_scratch

    reserve_scratch(device, weight_format, n)


def reserve_grouped_scratch(device: torch.device, weight_format: str, n: int, experts: int) -> None:
    """`reserve_scratch` for `grouped_quantized_matmul` over `experts` weights of `n` outputs."""
    from .grouped import reserve_grouped_scratch

    reserve_grouped_scratch(device, weight_format, n, experts)


# Note: torch.compile. Dynamo cannot trace the kernel launch (the tuner, launch plans and their
# data_ptr() calls), so while compiling `quantized_matmul` emits this custom operator instead: one graph
# node whose fake implementation gives the output's shape and dtype, and whose eager implementation is
# the same dispatch as outside torch.compile (Triton on CUDA, the reference on CPU). Outside
# torch.compile the operator is skipped: the dispatcher's per-call cost matters to an eager decode step.
@torch.library.custom_op("lightspeed::quantized_matmul", mutates_args=())
def _quantized_matmul_op(x: torch.Tensor, planes: list[torch.Tensor], scales: torch.Tensor,
                         bias: torch.Tensor | None, weight_format: str, n: int, k: int, group_size: int | None,
                         dtype: torch.dtype, tile: int) -> torch.Tensor:
    qweight = QuantizedWeight(weight_format, (n, k), group_size, tuple(planes), scales, dtype, tile)
    return _matmul(x, qweight, bias)


@_quantized_matmul_op.register_fake
def _quantized_matmul_fake(x, planes, scales, bias, weight_format, n, k, group_size, dtype, tile):
    return x.new_empty((*x.shape[:-1], n))


# Backward: the kernel's output has no autograd graph, so without this formula an x that needs a gradient
# (adapters trained on a frozen quantized model) would silently get none from CUDA. grad_x = grad_y @ W in
# x's dtype, as F.linear's backward would, through the operator below (one graph node for compiled
# backward graphs too); grad_bias = the sum of grad_y over the leading dims.
def _setup_backward(ctx, inputs, output):
    x, planes, scales, bias, weight_format, n, k, group_size, dtype, tile = inputs
    ctx.save_for_backward(scales, *planes)
    ctx.weight = (weight_format, n, k, group_size, dtype, tile)
    ctx.x_dtype = x.dtype
    ctx.bias_dtype = None if bias is None else bias.dtype


def _backward(ctx, grad):
    scales, *planes = ctx.saved_tensors
    weight_format, n, k, group_size, dtype, tile = ctx.weight
    grad_x = grad_bias = None
    if ctx.needs_input_grad[0]:
        grad_x = torch.ops.lightspeed.quantized_matmul_grad_input(grad.to(ctx.x_dtype), list(planes), scales,
                                                                  weight_format, n, k, group_size, dtype, tile)
    if ctx.bias_dtype is not None and ctx.needs_input_grad[3]:
        grad_bias = grad.reshape(-1, n).sum(0).to(ctx.bias_dtype)
    return grad_x, [None] * len(planes), None, grad_bias, None, None, None, None, None, None


@torch.library.custom_op("lightspeed::quantized_matmul_grad_input", mutates_args=())
def _grad_input_op(grad: torch.Tensor, planes: list[torch.Tensor], scales: torch.Tensor, weight_format: str,
                   n: int, k: int, group_size: int | None, dtype: torch.dtype, tile: int) -> torch.Tensor:
    """grad @ dequant(W): [..., N] -> [..., K] in grad's dtype. CUDA fp16/bf16: the Triton dequantizer in
    row chunks + cuBLAS (`dequant.dense_grad_input`); otherwise the reference dequantization."""
    qweight = QuantizedWeight(weight_format, (n, k), group_size, tuple(planes), scales, dtype, tile)
    lead = grad.shape[:-1]
    grad2 = grad.reshape(-1, n)
    if grad.device.type != "cuda" or grad.dtype not in _KERNEL_DTYPES:
        return (grad2 @ dequantize(qweight, dtype=grad.dtype)).reshape(*lead, k)
    from .dequant import dense_grad_input  # lazy: imports triton

    on_current = grad.device.index == torch.cuda.current_device()
    with contextlib.nullcontext() if on_current else torch.cuda.device(grad.device):
        return dense_grad_input(grad2, qweight).reshape(*lead, k)


@_grad_input_op.register_fake
def _grad_input_fake(grad, planes, scales, weight_format, n, k, group_size, dtype, tile):
    return grad.new_empty((*grad.shape[:-1], k))


_quantized_matmul_op.register_autograd(_backward, setup_context=_setup_backward)


__all__ = [
    "FORMATS",
    "MAX_GROUPED_ROWS",
    "QuantizedWeight",
    "dequantize",
    "fp6_code_values",
    "fp6_decode",
    "fp6_encode",
    "fp6_to_fp16_bits",
    "grouped_quantized_matmul",
    "quantize",
    "quantized_matmul",
    "reference_grouped_matmul",
    "reference_matmul",
    "reserve_grouped_scratch",
    "stack_weights",
    "triton_available",
]
