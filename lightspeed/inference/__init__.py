"""Inference: weight-only quantized linear layers and `init_inference` (DeepSpeed's entry point,
without kernel injection or tensor parallelism). Uses ops/ and _utils/; never imports triton."""

from lightspeed.inference.engine import init_inference, quantize_linears
from lightspeed.inference.quantized_linear import QuantizedLinear

__all__ = ["QuantizedLinear", "init_inference", "quantize_linears"]
