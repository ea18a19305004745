"""The experts' gated MLP over tokens already sorted by expert: `grouped_mlp` (one padded batched
matmul per projection, no per-expert Python loop) and `grouped_mlp_reference` (a loop over experts,
the definition).

Owns: the numerics of one expert's fused gated MLP as Hugging Face transformers 5 computes it for a
fused `gate_up_proj` [E, 2 x I, H] / `down_proj` [E, H, I] layout: `gate, up = (x @ W_gu^T).chunk(2)`,
`act(gate) * up`, then `@ W_down^T`. Must not: route, sort, communicate or weight by the router (the
caller does all of that).

Note: [the interface] `grouped_mlp(x_sorted, counts, w_gate_up, w_down, act)`:
    x_sorted  [N, H]: the tokens, expert 0's rows first, then expert 1's, ... (N = counts.sum()).
    counts    [E] int64 (any device): how many rows belong to each expert; zeros allowed.
    w_gate_up [E, 2 x I, H]: expert e's gate rows [0, I) then up rows [I, 2I), as nn.Linear weights.
    w_down    [E, H, I].
    act       elementwise callable applied to the gate half.
    returns   [N, H] in x_sorted's order.
Any kernel with this contract (a Triton grouped GEMM, `torch._grouped_mm`) can replace `grouped_mlp`;
`grouped_mlp_reference` is the definition to test it against.

Note: [padding] `grouped_mlp` scatters the rows into an [E, max count, H] buffer (zeros past each
expert's count), runs two `torch.bmm`s and gathers the rows back. The padded rows are computed and
dropped; they contribute nothing to any gradient (their inputs are constants and their outputs are not
read). The cost is E x max count rows instead of N: fine for the balanced loads of training, wasteful
for a very skewed one (the grouped-GEMM kernels avoid it).

Note: [on the GPU] CUDA tensors go to ops/grouped_gemm's `grouped_mlp` (its Triton kernels, or
`torch._grouped_mm` for bf16 on Hopper: no padding, no per-expert loop), handed this layout's weights
as transposed views. On the CPU ops/ has only its per-group reference loop, so the padded batched
matmuls stay.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lightspeed.ops import grouped_gemm


def _check(x_sorted: torch.Tensor, counts: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> None:
    experts = w_gate_up.shape[0]
    if w_gate_up.dim() != 3 or w_down.dim() != 3 or w_down.shape[0] != experts or counts.numel() != experts:
        raise ValueError(f"grouped_mlp: w_gate_up {tuple(w_gate_up.shape)}, w_down {tuple(w_down.shape)} and counts "
                         f"{tuple(counts.shape)} must agree on the number of experts ([E, 2I, H], [E, H, I], [E])")
    if w_gate_up.shape[1] != 2 * w_down.shape[2] or w_gate_up.shape[2] != w_down.shape[1] != x_sorted.shape[-1]:
        raise ValueError(f"grouped_mlp: shapes do not chain: x {tuple(x_sorted.shape)}, w_gate_up "
                         f"{tuple(w_gate_up.shape)}, w_down {tuple(w_down.shape)}")


def grouped_mlp(x_sorted: torch.Tensor, counts: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Every expert's gated MLP on its rows of `x_sorted` (the Notes on the interface and padding)."""
    _check(x_sorted, counts, w_gate_up, w_down)
    if x_sorted.is_cuda:
        return grouped_kernel(x_sorted, counts, w_gate_up, w_down, act)
    experts, hidden = w_gate_up.shape[0], x_sorted.shape[-1]
    counts = counts.to(device=x_sorted.device, dtype=torch.long)
    rows = x_sorted.shape[0]
    if rows == 0:
        # no token anywhere: an empty result that still depends on the weights (zero gradients)
        return x_sorted * 0 + 0 * (w_gate_up.sum() + w_down.sum())
    width = int(counts.max())
    starts = torch.cumsum(counts, 0) - counts
    expert_of_row = torch.repeat_interleave(torch.arange(experts, device=x_sorted.device), counts, output_size=rows)
    slot = expert_of_row * width + (torch.arange(rows, device=x_sorted.device) - starts[expert_of_row])
    padded = x_sorted.new_zeros(experts * width, hidden).index_copy(0, slot, x_sorted).view(experts, width, hidden)
    gate, up = torch.bmm(padded, w_gate_up.transpose(1, 2)).chunk(2, dim=-1)
    out = torch.bmm(act(gate) * up, w_down.transpose(1, 2))
    return out.reshape(experts * width, hidden).index_select(0, slot)


def grouped_kernel(x_sorted: torch.Tensor, counts: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                   act: Callable[[torch.Tensor], torch.Tensor], backend: str = "auto") -> torch.Tensor:
    """`grouped_mlp` through ops/grouped_gemm (the Note on the GPU); `backend` as its `grouped_mlp`."""
    offsets = grouped_gemm.offsets_from_counts(counts.to(device=x_sorted.device))
    return grouped_gemm.grouped_mlp(x_sorted, offsets, w_gate_up.transpose(1, 2), w_down.transpose(1, 2), act,
                                    backend=backend)


def grouped_mlp_reference(x_sorted: torch.Tensor, counts: torch.Tensor, w_gate_up: torch.Tensor,
                          w_down: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`grouped_mlp` as a loop over experts: the definition (and DeepSpeed's `use_grouped_mm: false`)."""
    _check(x_sorted, counts, w_gate_up, w_down)
    outs, start = [], 0
    for e, n in enumerate(counts.tolist()):
        x = x_sorted[start:start + n]
        gate, up = torch.nn.functional.linear(x, w_gate_up[e]).chunk(2, dim=-1)
        outs.append(torch.nn.functional.linear(act(gate) * up, w_down[e]))
        start += n
    if not outs or start == 0:
        return x_sorted * 0 + 0 * (w_gate_up.sum() + w_down.sum())
    return torch.cat(outs)


__all__ = ["grouped_mlp", "grouped_mlp_reference"]
