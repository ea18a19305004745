"""`deepspeed.checkpoint.utils`: `clone_tensors_for_torch_save` (lightspeed/checkpoint/tensors.py)."""

from lightspeed.checkpoint.tensors import clone_tensors_for_torch_save

__all__ = ["clone_tensors_for_torch_save"]
