"""`deepspeed.git_version_info`: the build facts DeepSpeed records at install time (its tests read
`torch_info` to skip by torch/CUDA/NCCL version). lightspeed answers with the DeepSpeed release it
presents, the running torch, and no compiled ops: it builds none of DeepSpeed's C++/CUDA extensions
(its kernels are Triton and PyTorch), so every op reads as neither installed nor compatible."""

from __future__ import annotations

import torch

from lightspeed._utils.accelerator import get_accelerator
from lightspeed.compat.registration import DEEPSPEED_VERSION


class _NoOps(dict):
    """op name -> False, for any name DeepSpeed's op builders use."""

    def __missing__(self, key):
        return False


def _major_minor(text: str | None) -> str:
    return ".".join(text.split(".")[:2]) if text else "0.0"


def _nccl_version() -> str:
    if not torch.cuda.is_available():
        return "0.0"
    major, minor, *_ = torch.cuda.nccl.version()
    return f"{major}.{minor}"


version = DEEPSPEED_VERSION
git_hash = "[none]"  # not a DeepSpeed build
git_branch = "[none]"
installed_ops = _NoOps()
compatible_ops = _NoOps()
accelerator_name = get_accelerator().device_name()
torch_info = {
    "version": _major_minor(torch.__version__),
    "bf16_support": torch.cuda.is_available() and torch.cuda.is_bf16_supported(),
    "cuda_version": _major_minor(torch.version.cuda),
    "nccl_version": _nccl_version(),
    "hip_version": _major_minor(getattr(torch.version, "hip", None)),
}

__all__ = ["accelerator_name", "compatible_ops", "git_branch", "git_hash", "installed_ops", "torch_info", "version"]
