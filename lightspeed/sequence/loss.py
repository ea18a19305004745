"""The loss of a sequence split over a sequence-parallel group: transformers' and DeepSpeed's weighting.

Owns: `sequence_parallel_loss`. Must not: compute per-token losses (the model does), or decide how the
engine combines the sp ranks' gradients (it reads what the engine recorded).

Each sp rank computes the mean loss over the counted tokens (labels != -100) of its slice. The loss of the
whole sequence is the token-weighted mean of those, sum_r(loss_r * n_r) / sum_r(n_r): that is the value
every rank of the group gets. Its gradient is this rank's share only, loss_r * n_r / sum(n): the other
ranks' terms enter as constants (transformers' `deepspeed_sp_compute_loss`, which the HF Trainer runs,
does the same). Summed over the sp ranks the shares are exactly the gradient of the whole-sequence loss.

Note: [the engine's sum over sp] The engine sums the sp ranks' gradients and averages over the
data-parallel ranks at ZeRO 0-2, and averages over dp x sp at ZeRO 3 (zero/reduce.py's Note on sequence
parallelism: DeepSpeed 0.19.8's default rule). Where it averages over sp the share is multiplied by sp,
as transformers does for DeepSpeed < 0.20.2 under ZeRO-3; either way the reduced gradient is the one a
single process computes on the whole sequence, averaged over the data-parallel replicas. The engine
records which at `initialize()` (comm/sequence_groups.py's `record_sp_gradient_mean`); before any engine
with sp > 1 exists the loss cannot know it and raises.
"""

from __future__ import annotations

from typing import Any

import torch

from lightspeed.comm import api as comm_api
from lightspeed.comm.sequence_groups import current_sequence_groups, sp_gradient_mean


def sequence_parallel_loss(loss: torch.Tensor, num_tokens: torch.Tensor | int, group: Any = None) -> torch.Tensor:
    """The whole sequence's mean token loss from this rank's mean `loss` (0-dim) over its `num_tokens`
    counted tokens: the same value on every rank of `group` (default: this process's sp group), with the
    gradient of this rank's share (times sp where the engine averages over sp; see the Note).
    A rank with no counted tokens contributes nothing (its NaN mean is masked out)."""
    if group is None:
        groups = current_sequence_groups()
        if groups is None:
            raise RuntimeError("sequence_parallel_loss: no sequence-parallel group exists in this process (set "
                               "sequence_parallel_size or call UlyssesSPAttentionHF.register_with_transformers)")
        group = groups.sp_group
    scale = comm_api.get_world_size(group) if sp_gradient_mean() else 1
    count = torch.as_tensor(num_tokens, device=loss.device).to(loss.dtype).reshape(()).detach()
    local_sum = torch.where(count > 0, loss.reshape(()), torch.zeros_like(loss.reshape(()))) * count
    totals = torch.stack((local_sum.detach(), count))
    comm_api.all_reduce(totals, group=group)
    share = local_sum * scale if scale != 1 else local_sum
    return (share + (totals[0] - share.detach())) / totals[1].clamp(min=1)
