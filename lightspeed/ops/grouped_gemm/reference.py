"""The grouped GEMM and the MoE routing of `lightspeed.ops.grouped_gemm` in plain PyTorch: the spec the
Triton kernels and `torch._grouped_mm` are tested against, and the CPU path.

Groups. x [T, K] holds the rows of G groups one after another; `offsets` (int32 [G], as
`torch._grouped_mm`'s `offs`) are the groups' cumulative end rows: group g is rows
[offsets[g - 1], offsets[g]) (offsets[-1] = 0 for g = 0). A group may be empty; offsets are
non-decreasing and offsets[G - 1] <= T. Rows from offsets[G - 1] on belong to no group: their output
rows are zero (and so are their input gradients). Every product is accumulated in fp32 and rounded once
to the inputs' dtype.

Routes. A token s routed to k experts has k routes r = s * k + j (expert expert_idx[s, j]). `permute`
orders the routes by expert, stably (routes to one expert keep token order), so the result is the same
on every run and every path; a route whose expert is outside [0, E) is dropped: it sorts after every
kept route, its row of `sorted` is zero, it is not counted, and its row_map entry is -1.

Note: [host reads] Each function here reads offsets or routes back to the host (`tolist`), which waits
for the device: the spec is written for clarity, not speed; the kernels read them on the device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = ("silu", "gelu", "gelu_tanh")


def group_bounds(offsets: torch.Tensor, rows: int) -> list[tuple[int, int]]:
    """[(start, end)] row ranges of the groups; raises ValueError unless offsets are non-decreasing,
    >= 0 and <= rows."""
    ends = [int(e) for e in offsets.tolist()]
    bounds, start = [], 0
    for g, end in enumerate(ends):
        if end < start or end > rows:
            raise ValueError(f"grouped_mm: offsets must be non-decreasing cumulative ends within [0, {rows}], "
                             f"got offsets[{g}] = {end} after {start}")
        bounds.append((start, end))
        start = end
    return bounds


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """out [T, N]: rows of group g are x_g @ w[g] (w [G, K, N]); rows past offsets[-1] are zero."""
    out = torch.zeros(x.shape[0], w.shape[2], dtype=x.dtype, device=x.device)
    for g, (start, end) in enumerate(group_bounds(offsets, x.shape[0])):
        if end > start:
            out[start:end] = (x[start:end].float() @ w[g].float()).to(x.dtype)
    return out


def grouped_mm_wgrad(x: torch.Tensor, dout: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """dw [G, K, N] with dw[g] = x_g^T @ dout_g (zero for an empty group): the weight gradient of
    `grouped_mm`, itself a grouped GEMM whose groups split the reduction dimension."""
    G = offsets.shape[0]
    dw = torch.zeros(G, x.shape[1], dout.shape[1], dtype=x.dtype, device=x.device)
    for g, (start, end) in enumerate(group_bounds(offsets, x.shape[0])):
        if end > start:
            dw[g] = (x[start:end].float().t() @ dout[start:end].float()).to(x.dtype)
    return dw


def route_keys(expert_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Each route's expert, flattened [S * k] int64; dropped routes (outside [0, E)) get E."""
    flat = expert_idx.reshape(-1).long()
    return torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)


def route_order(expert_idx: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order [S * k]: the route at each sorted position, row_map [S, k] int64: each route's sorted row or
    -1, counts [E] int32). No host sync (the kernels' path uses it too)."""
    keys = route_keys(expert_idx, num_experts)
    order = torch.argsort(keys, stable=True)
    positions = torch.empty_like(order)
    positions[order] = torch.arange(order.numel(), device=order.device)
    row_map = torch.where(keys < num_experts, positions, -1).view(expert_idx.shape)
    counts = torch.zeros(num_experts + 1, dtype=torch.int32, device=keys.device)
    counts.scatter_add_(0, keys, torch.ones_like(keys, dtype=torch.int32))
    return order, row_map, counts[:num_experts]


def permute(tokens: torch.Tensor, expert_idx: torch.Tensor,
            num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted [S * k, H]: each route's token row in expert order, row_map [S, k], counts [E]); see the
    module's "Routes". Differentiable in `tokens` through torch's index ops."""
    k = expert_idx.shape[1]
    order, row_map, counts = route_order(expert_idx, num_experts)
    kept = (route_keys(expert_idx, num_experts) < num_experts)[order]
    sorted_rows = tokens[order // k] * kept[:, None].to(tokens.dtype)
    return sorted_rows, row_map, counts


def unpermute(sorted_out: torch.Tensor, row_map: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """out [S, H] with out[s] = sum_j weights[s, j] * sorted_out[row_map[s, j]] over the kept routes,
    accumulated in fp32, in sorted_out's dtype."""
    kept = row_map >= 0
    rows = sorted_out[row_map.clamp(min=0)].float()  # [S, k, H]
    scale = torch.where(kept, weights.float(), 0.0)
    return (rows * scale[..., None]).sum(dim=1).to(sorted_out.dtype)


def activate(gate: torch.Tensor, activation) -> torch.Tensor:
    """activation(gate): one of ACTIVATIONS by name, or any elementwise callable (e.g. HF's act_fn)."""
    if callable(activation):
        return activation(gate)
    if activation == "silu":
        return F.silu(gate)
    if activation == "gelu":
        return F.gelu(gate)
    if activation == "gelu_tanh":
        return F.gelu(gate, approximate="tanh")
    raise ValueError(f"grouped_mlp: activation must be one of {', '.join(ACTIVATIONS)}, got {activation!r}")


def split_gate_up(w_gate_up) -> tuple[torch.Tensor, torch.Tensor]:
    """(w_gate, w_up) [G, H, I] from one [G, H, 2I] tensor (gate first) or a pair."""
    if isinstance(w_gate_up, (tuple, list)):
        return w_gate_up[0], w_gate_up[1]
    return w_gate_up.chunk(2, dim=-1)


def grouped_mlp(x: torch.Tensor, offsets: torch.Tensor, w_gate_up, w_down: torch.Tensor,
                activation="silu") -> torch.Tensor:
    """The experts' gated MLP on sorted rows: for group g, (act(x_g @ W_gate[g]) * (x_g @ W_up[g])) @
    w_down[g], each product by the reference `grouped_mm`, the activation in fp32; rows past offsets[-1]
    give zero. Differentiable through torch's autograd (the loop is plain slicing)."""
    w_gate, w_up = split_gate_up(w_gate_up)
    out = torch.zeros(x.shape[0], w_down.shape[2], dtype=x.dtype, device=x.device)
    for g, (start, end) in enumerate(group_bounds(offsets, x.shape[0])):
        if end > start:
            xg = x[start:end].float()
            h = activate(xg @ w_gate[g].float(), activation) * (xg @ w_up[g].float())
            out[start:end] = (h @ w_down[g].float()).to(x.dtype)
    return out
