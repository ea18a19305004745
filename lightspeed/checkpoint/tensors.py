"""`clone_tensors_for_torch_save(item, device)`: copies of the tensors in a nested state (dicts, lists,
tuples) that own their storage, so `torch.save` writes only each tensor's own elements, not the whole
flat buffer a view shares (DeepSpeed's `deepspeed.checkpoint.utils.clone_tensors_for_torch_save`)."""

from __future__ import annotations

import torch


def clone_tensors_for_torch_save(item, device: torch.device | str = torch.device("cpu")):
    """`item` with every tensor detached and copied to `device` (cloned when already there); other
    values returned as they are; dict types kept (an OrderedDict stays one)."""
    if torch.is_tensor(item):
        device = torch.device(device)
        return item.detach().clone() if item.device == device else item.detach().to(device)
    if isinstance(item, list):
        return [clone_tensors_for_torch_save(v, device) for v in item]
    if isinstance(item, tuple):
        return tuple(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)({k: clone_tensors_for_torch_save(v, device) for k, v in item.items()})
    return item
