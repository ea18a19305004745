"""`deepspeed.utils.torch`: DeepSpeed's torch-version gate `required_torch_version` and
`register_grad_hook` (a hook run once a parameter's gradient is accumulated)."""

from __future__ import annotations

import torch
from torch.torch_version import TorchVersion  # compares with version strings (torch vendors packaging)


def required_torch_version(min_version=None, max_version=None) -> bool:
    """True when the running torch is at least `min_version` and at most `max_version` (either may be
    omitted, not both), as DeepSpeed's."""
    if not (min_version or max_version):
        raise ValueError("required_torch_version: pass a min_version or a max_version")
    running = TorchVersion(torch.__version__)
    if min_version and running < str(min_version):
        return False
    return not (max_version and running > str(max_version))


def register_grad_hook(param: torch.nn.Parameter, hook):
    """`hook(param)` after each accumulation into `param.grad`; returns the removable handle (torch >= 2.1,
    which lightspeed requires, has the post-accumulate hook DeepSpeed prefers)."""
    return param.register_post_accumulate_grad_hook(hook)


__all__ = ["register_grad_hook", "required_torch_version"]
