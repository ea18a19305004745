"""`QuantizedLinear`: a drop-in for nn.Linear (and transformers' Conv1D) whose weight lives packed as
FP6 e3m2, INT8 or INT4 (layout: `lightspeed.ops.wquant.reference`). Owns the module and its buffers;
the arithmetic lives in `lightspeed.ops.wquant`.

Note: layout version. The packed bit layout may change between versions; each module carries a
`layout_version` buffer, and loading a state dict packed with another layout (or without the buffer)
raises instead of computing with misread bits: re-quantize from the float weights.

Note: scales are stored as the int16 bit pattern of their fp16 values, so `model.half()` /
`model.to(torch.bfloat16)` cast the bias but can never round the scales the codes were computed
against; `scales_fp16` views them back.
"""

from __future__ import annotations

import torch
from torch import nn

from lightspeed.ops.wquant import QuantizedWeight, dequantize, quantize, quantized_matmul, reserve_scratch
from lightspeed.ops.wquant.reference import LAYOUT_VERSION, PACK_TILE, check_quant_args, plane_specs
from lightspeed.parallel.module_kinds import is_conv1d, is_linear, linear_dims  # noqa: F401 (re-exported)


def _plane_shapes(fmt: str, n: int, k: int) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """Buffer name, shape and dtype of the packed weight (tile-major, K padded to the pack tile and N to
    the storage row group; see reference.py)."""
    return [(name, shape, dtype) for name, (shape, dtype) in zip(("qweight",), plane_specs(fmt, n, k, PACK_TILE))]


class QuantizedLinear(nn.Module):
    """y = x @ dequant(W).T + bias, W: [out_features, in_features] packed (any in_features: K is padded to
    the pack tile inside the planes). x: [..., in_features] fp16/bf16
    (fp32 runs the reference), y in x's dtype. CPU runs the plain-PyTorch reference, CUDA the Triton
    kernel. Build one with `from_linear`; the constructor makes empty buffers for `load_state_dict`."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, weight: str = "fp6",
                 group_size: int | None = None, dtype: torch.dtype = torch.float16, device=None):
        super().__init__()
        check_quant_args(weight, (out_features, in_features), group_size)
        self.in_features = in_features
        self.out_features = out_features
        self.weight_format = weight
        self.group_size = group_size
        self.weight_dtype = dtype
        for name, shape, plane_dtype in _plane_shapes(weight, out_features, in_features):
            self.register_buffer(name, torch.zeros(shape, dtype=plane_dtype, device=device))
        num_groups = 1 if group_size is None else in_features // group_size
        self.register_buffer("scales", torch.zeros((out_features, num_groups), dtype=torch.int16, device=device))
        if bias:
            self.register_buffer("bias", torch.zeros(out_features, dtype=dtype, device=device))
        else:
            self.bias = None
        self.register_buffer("layout_version", torch.tensor(LAYOUT_VERSION, dtype=torch.int32, device=device))
        self._packed_view = None  # (qweight, scales, their QuantizedWeight): `quantized_weight`, once per buffers
        self._reserve_scratch()

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self._reserve_scratch()  # `.to("cuda")` and the like
        return self

    def _reserve_scratch(self) -> None:
        """On a GPU, size the kernel's shared split-K buffers for this layer now, not in its first call,
        which may run inside a CUDA graph capture or torch.compile's CUDA-graph warm-up."""
        if self.qweight.is_cuda:
            reserve_scratch(self.qweight.device, self.weight_format, self.out_features)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        saved = state_dict.get(prefix + "layout_version")
        if saved is None or int(saved) != LAYOUT_VERSION:
            found = "none" if saved is None else int(saved)
            raise ValueError(f"{prefix or 'QuantizedLinear'}: packed with layout version {found}, this version "
                             f"reads {LAYOUT_VERSION}; re-quantize from the float weights")
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    @classmethod
    def from_linear(cls, linear: nn.Module, weight: str = "fp6", group_size: int | None = None, *,
                    device=None, dtype: torch.dtype | None = None) -> "QuantizedLinear":
        """Quantize an nn.Linear (weight [out, in]) or a transformers Conv1D (weight [in, out]) on its
        device, in its dtype; or first moved to `device` and cast to `dtype` (only this layer's weight
        makes that trip: `init_inference` quantizes a model on its way to the GPU layer by layer). The
        linear itself is left as it was."""
        if isinstance(linear, nn.Linear):
            w = linear.weight.detach()
        elif is_conv1d(linear):
            w = linear.weight.detach().t()
        else:
            raise ValueError(f"from_linear needs an nn.Linear or transformers Conv1D (got {type(linear).__name__})")
        bias = None if linear.bias is None else linear.bias.detach()
        return cls.from_float(w.to(device=device, dtype=dtype), bias, weight=weight, group_size=group_size)

    @classmethod
    def from_float(cls, w: torch.Tensor, bias: torch.Tensor | None = None, weight: str = "fp6",
                   group_size: int | None = None) -> "QuantizedLinear":
        """Quantize the float weight `w` [out_features, in_features] on its device; the module computes
        in w's dtype (the bias is copied into it)."""
        out_features, in_features = w.shape
        qw = quantize(w, weight, group_size)
        module = cls(in_features, out_features, bias=bias is not None, weight=weight, group_size=group_size,
                     dtype=w.dtype, device=w.device)
        module._load_packed(qw)
        if bias is not None:
            module.bias.copy_(bias)
        return module

    def _load_packed(self, qw: QuantizedWeight) -> None:
        names = [name for name, _, _ in _plane_shapes(self.weight_format, self.out_features, self.in_features)]
        for name, plane in zip(names, qw.planes):
            getattr(self, name).copy_(plane)
        self.scales.copy_(qw.scales.view(torch.int16))

    @property
    def scales_fp16(self) -> torch.Tensor:
        return self.scales.view(torch.float16)

    def quantized_weight(self) -> QuantizedWeight:
        """The packed weight as the ops layer sees it (views of this module's buffers; made again only when
        the buffers are replaced, e.g. by `.to()`: an eager decode step is bound by the host)."""
        if torch.compiler.is_compiling():  # a fresh view: keeping one would be a traced side effect (a recompile)
            return self._new_view()
        view = getattr(self, "_packed_view", None)  # modules pickled by older versions lack it
        if view is not None and view[0] is self.qweight and view[1] is self.scales:
            return view[2]
        qw = self._new_view()
        self._packed_view = (self.qweight, self.scales, qw)
        return qw

    def _new_view(self) -> QuantizedWeight:
        return QuantizedWeight(self.weight_format, (self.out_features, self.in_features), self.group_size,
                               (self.qweight,), self.scales_fp16, self.weight_dtype, PACK_TILE)

    def dequantize_weight(self) -> torch.Tensor:
        """The float weight [out_features, in_features] this module represents, in the original dtype."""
        return dequantize(self.quantized_weight(), dtype=self.weight_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return quantized_matmul(x, self.quantized_weight(), self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"weight={self.weight_format}, group_size={self.group_size}")


def linear_from_float(weight: torch.Tensor, bias: torch.Tensor | None = None,
                      quant: tuple[str, int | None] | None = None) -> nn.Module:
    """A layer computing x @ weight.T + bias for a float weight [N, K] on its device: an nn.Linear
    holding the tensors as they are (made contiguous), or a QuantizedLinear when `quant` is (format,
    group_size). No gradients: inference layers."""
    weight, bias = weight.contiguous(), None if bias is None else bias.contiguous()
    if quant is not None:
        return QuantizedLinear.from_float(weight, bias, weight=quant[0], group_size=quant[1])
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    layer.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        layer.bias = nn.Parameter(bias, requires_grad=False)
    return layer
