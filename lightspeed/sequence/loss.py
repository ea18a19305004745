"""The loss of a sequence split over a sequence-parallel group: transformers' and DeepSpeed's weighting.

Owns: `sequence_parallel_loss`. Must not: compute per-token losses (the model does).

Each sp rank computes the mean loss over the counted tokens (labels != -100) of its slice. The loss of the
whole sequence is the token-weighted mean of those, sum_r(loss_r * n_r) / sum_r(n_r), formed on every rank
from an all-gather that autograd differentiates (transformers' `deepspeed_sp_compute_loss`, which the HF
Trainer runs, does the same). Every rank of the group then holds the same loss and backpropagates it, so
the all-gather's backward hands each rank sp times its share: summed over the group the parameter
gradients are sp times the gradient of the whole-sequence loss. The engine averages gradients over the
dp x sp group (it divides by dp * sp), which makes them exactly the gradient a single process computes
on the whole sequence, averaged over data-parallel replicas.

Note: DeepSpeed's ZeRO divides by dp only (`world_size / sequence_parallel_size`), so with this loss its
gradients come out sp times the single-process ones (visible through gradient clipping and Adam's eps);
lightspeed keeps the exact average.
"""

from __future__ import annotations

from typing import Any

import torch

from lightspeed.comm.differentiable import all_gather_autograd
from lightspeed.comm.sequence_groups import current_sequence_groups


def sequence_parallel_loss(loss: torch.Tensor, num_tokens: torch.Tensor | int, group: Any = None) -> torch.Tensor:
    """The whole sequence's mean token loss from this rank's mean `loss` (0-dim) over its `num_tokens`
    counted tokens; the same value on every rank of `group` (default: this process's sp group).
    A rank with no counted tokens contributes nothing (its NaN mean is masked out)."""
    if group is None:
        groups = current_sequence_groups()
        if groups is None:
            raise RuntimeError("sequence_parallel_loss: no sequence-parallel group exists in this process (set "
                               "sequence_parallel_size or call UlyssesSPAttentionHF.register_with_transformers)")
        group = groups.sp_group
    count = torch.as_tensor(num_tokens, device=loss.device).to(loss.dtype).reshape(())
    losses = all_gather_autograd(loss.reshape(()), group)
    counts = all_gather_autograd(count.detach(), group)
    has_tokens = counts > 0
    weighted = torch.where(has_tokens, losses, torch.zeros_like(losses)) * counts
    return weighted.sum() / counts.sum().clamp(min=1)
