"""`DistributedAttention` (DeepSpeed's `deepspeed.sequence.layer.DistributedAttention`): Ulysses sequence
parallelism around an unchanged local attention.

Owns: the layout rules (which dimension is the sequence, which the heads) and the two all-to-alls around
the local attention. Must not: compute attention, or communicate other than through
`lightspeed.comm.differentiable`.

Each rank holds a slice of the sequence with every head: [s/P, b, h, d] (sequence first, DeepSpeed's
default) or [b, s/P, h, d] (`batch_dim_idx=0`). Before the local attention an all-to-all makes that the
whole sequence with h/P heads; after it, the inverse all-to-all brings the context back to the local
slice of the sequence with every head. The local attention sees ordinary full-length sequences, so
causal masking and softmax are unchanged. The head count must be divisible by the sp size.
"""

from __future__ import annotations

from typing import Any

import torch

from lightspeed.comm.differentiable import seq_all_to_all


class DistributedAttention(torch.nn.Module):
    """`DistributedAttention(local_attention, sequence_process_group, scatter_idx=2, gather_idx=0)`.

    `forward(query, key, value, batch_dim_idx=None, rotary_pos_emb=None, *args, **kwargs)`: with
    `batch_dim_idx` None the inputs are split along `scatter_idx` (heads) and joined along `gather_idx`
    (sequence), DeepSpeed's original layout rule; with `batch_dim_idx` 0 or 1 the sequence is dimension
    `1 - batch_dim_idx` and the heads dimension 2, DeepSpeed's current rule. Extra arguments go to
    `local_attention(q, k, v, *args, **kwargs)`, whose output has the layout of its inputs.
    """

    def __init__(self, local_attention: Any, sequence_process_group: Any, scatter_idx: int = 2,
                 gather_idx: int = 0, sp_stream: Any = None) -> None:
        super().__init__()
        if sp_stream is not None:
            raise NotImplementedError("DistributedAttention(sp_stream=...): overlapping the all-to-alls with "
                                      "compute on a side stream is not implemented")
        if scatter_idx == gather_idx:
            raise ValueError(f"DistributedAttention: scatter_idx and gather_idx must differ (both {scatter_idx})")
        self.local_attn = local_attention
        self.spg = sequence_process_group
        self.scatter_idx = scatter_idx
        self.gather_idx = gather_idx

    def _dims(self, batch_dim_idx) -> tuple[int, int]:
        """(heads dimension, sequence dimension) of the inputs."""
        if batch_dim_idx is None:
            return self.scatter_idx, self.gather_idx
        if batch_dim_idx not in (0, 1) or isinstance(batch_dim_idx, bool):
            raise ValueError(f"DistributedAttention: batch_dim_idx must be 0 ([b, s, h, d]) or 1 ([s, b, h, d]), "
                             f"got {batch_dim_idx!r}")
        return 2, 1 - batch_dim_idx

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, batch_dim_idx: int | None = None,
                rotary_pos_emb=None, *args: Any, **kwargs: Any) -> torch.Tensor:
        if rotary_pos_emb is not None:
            raise NotImplementedError("DistributedAttention(rotary_pos_emb=...): rotary embedding applied after the "
                                      "all-to-all is not implemented; apply it to the local slice before the call")
        heads, seq = self._dims(batch_dim_idx)
        q, k, v = (seq_all_to_all(t, self.spg, heads, seq) for t in (query, key, value))
        context = self.local_attn(q, k, v, *args, **kwargs)
        return seq_all_to_all(context, self.spg, seq, heads)
