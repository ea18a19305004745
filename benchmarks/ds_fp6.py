"""DeepSpeed's FP6-LLM kernel (`CUDAWf6Af16Linear`, DeepSpeed-FP6) as a baseline for `fp6_gemm.py --deepspeed`.

Its CUDA source compiles the matmul body only for 8.0 <= __CUDA_ARCH__ < 9.0, so on a Hopper GPU it is
built as sm_80 code plus compute_80 PTX (TORCH_CUDA_ARCH_LIST="8.0+PTX", always set here: a CUDA
image's own "9.0a" is not parseable by DeepSpeed's builder) and the driver compiles that PTX for the
GPU at load; built for sm_90 the kernel would be empty and return garbage, which is why every shape
is checked against the dequantize + matmul reference before it is timed. The op is JIT-built by
DeepSpeed's InferenceCoreBuilder (nvcc + ninja, about a minute on 16 cores; the build is cached in
torch's extension folder, TORCH_EXTENSIONS_DIR). A prebuilt copy of that op library
(`inference_core_ops.so` from the cache folder, built with the same torch) can be named with
LIGHTSPEED_DS_CORE_OPS_SO instead; it is loaded as is, skipping the build.

Both kernels get the same quantized weight: DeepSpeed's `preprocess_weight` packs "fake FP6" fp16 values
(e3m2 values stored in fp16, exact) with per-channel fp16 scales, which are our codes and scales.
DeepSpeed's kernel needs N % 256 == 0 and K % 64 == 0.
"""

from __future__ import annotations

import os
import time

import torch

import lightspeed.ops.wquant as wq
from lightspeed.ops.wquant.reference import fp6_decode, unpack_codes


def _register_prebuilt(path: str) -> None:
    """Load a prebuilt inference_core_ops library and hand it to DeepSpeed's op loader (its load()
    returns a registered op before trying a build)."""
    import importlib.util

    from deepspeed.ops.op_builder import InferenceCoreBuilder
    from deepspeed.ops.op_builder.builder import OpBuilder

    spec = importlib.util.spec_from_file_location(InferenceCoreBuilder.NAME, path)
    if spec is None or spec.loader is None:
        raise FileNotFoundError(f"LIGHTSPEED_DS_CORE_OPS_SO: cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    OpBuilder._loaded_ops[InferenceCoreBuilder.NAME] = module


class DeepSpeedFP6:
    """Builds DeepSpeed's FP6 linear op once; `pack` converts a lightspeed FP6 weight, `__call__` runs it."""

    def __init__(self):
        os.environ["TORCH_CUDA_ARCH_LIST"] = "8.0+PTX"
        t0 = time.perf_counter()
        from deepspeed.inference.v2.kernels.core_ops.cuda_linear.cuda_linear import CUDAWf6Af16Linear

        prebuilt = os.environ.get("LIGHTSPEED_DS_CORE_OPS_SO")
        if prebuilt:
            _register_prebuilt(prebuilt)

        self.linear = CUDAWf6Af16Linear()  # loads (JIT-builds) InferenceCoreBuilder
        self.build_s = time.perf_counter() - t0

    @staticmethod
    def supports(n: int, k: int) -> bool:
        return n % 256 == 0 and k % 64 == 0

    def pack(self, qw: wq.QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(2-bit plane, 4-bit plane, fp16 scales [N]) on the weight's device, from our FP6 codes."""
        if qw.format != "fp6" or qw.group_size is not None:
            raise ValueError("DeepSpeed's FP6 kernel takes per-channel FP6 weights only")
        fake_fp6 = fp6_decode(unpack_codes(qw).cpu()).to(torch.float16).contiguous()  # e3m2 values: exact in fp16
        w2, w4 = self.linear.inf_module.preprocess_weight(fake_fp6)
        return w2.to(qw.device), w4.to(qw.device), qw.scales.reshape(-1).contiguous()

    def __call__(self, x: torch.Tensor, packed, n: int) -> torch.Tensor:
        w2, w4, scales = packed
        out = torch.empty((x.shape[0], n), dtype=torch.float16, device=x.device)
        self.linear(out, x, w2, w4, scales, n, x.shape[0], x.shape[1])
        return out
