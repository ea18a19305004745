"""The experts' gated MLP over tokens already sorted by expert: `grouped_mlp` (one padded batched
matmul per projection, no per-expert Python loop) and `grouped_mlp_reference` (a loop over experts,
the definition), with optional per-expert biases; and the gated activations of the supported models
(`HalvesGLU`, `ClampedSwiGLU`).

Owns: the numerics of one expert's fused gated MLP as Hugging Face transformers 5 computes it:
`h = x @ W_gu^T (+ b_gu)`, `a = glu(h)`, `a @ W_down^T (+ b_down)`, where `glu` maps the fused gate|up
projection [.., 2I] to [.., I]. Must not: route, sort, communicate or weight by the router (the caller
does all of that).

Note: [the interface] `grouped_mlp(x_sorted, counts, w_gate_up, w_down, act, b_gate_up, b_down)`:
    x_sorted  [N, H]: the tokens, expert 0's rows first, then expert 1's, ... (N = counts.sum()).
    counts    [E] int64 (any device): how many rows belong to each expert; zeros allowed.
    w_gate_up [E, 2 x I, H]: expert e's fused gate|up rows, as nn.Linear weights (a model storing
              [E, H, 2I] passes a `.transpose(1, 2)` view).
    w_down    [E, H, I] (likewise).
    act       a `GatedActivation` (the fused projection to its gated product), or an elementwise
              callable, meaning `HalvesGLU(act)`: `act(h[:, :I]) * h[:, I:]` (Mixtral, Qwen, DeepSeek).
    b_gate_up [E, 2 x I] or None, b_down [E, H] or None: expert e's biases, added to its rows.
    returns   [N, H] in x_sorted's order.
Any kernel with this contract can replace `grouped_mlp`; `grouped_mlp_reference` is the definition to
test it against.

Note: [gated activations] `HalvesGLU(act)`: gate the first half, up the second (transformers' `act_fn`
experts). `ClampedSwiGLU(alpha, limit)`: GPT-OSS's experts (`GptOssExperts._apply_gate`): gate the
even columns, up the odd ones, gate clamped above at `limit`, up to [-limit, limit],
`(up + 1) * gate * sigmoid(alpha * gate)`, the same operations in the same order.

Note: [padding] `grouped_mlp` on the CPU scatters the rows into an [E, max count, H] buffer (zeros
past each expert's count), runs two `torch.bmm`s (each expert's bias broadcast over its slots) and
gathers the rows back. The padded rows are computed and dropped; they contribute nothing to any
gradient (their inputs are constants and their outputs are not read). The cost is E x max count rows
instead of N: fine for the balanced loads of training, wasteful for a very skewed one.

Note: [on the GPU] CUDA tensors go to ops/grouped_gemm (its Triton kernels, or `torch._grouped_mm` for
bf16 on Hopper: no padding, no per-expert loop), handed this layout's weights as transposed views:
without biases and with `HalvesGLU`, its `grouped_mlp` whole; otherwise its `grouped_mm` for each
projection, each row's expert bias gathered by its expert (`repeat_interleave` sized by N, no host
sync) and added, the gated activation by torch between the two. The bias gradient is summed per
expert in fp32 (as the model's broadcast add reduces), by `index_add_`: on CUDA in an unspecified
order unless `torch.use_deterministic_algorithms` is on.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lightspeed.ops import grouped_gemm


class GatedActivation:
    """The experts' gated activation: the fused gate|up projection [.., 2I] to [.., I]. `interleaved`:
    gate and up of unit u are columns 2u and 2u + 1 (else u and I + u)."""

    interleaved = False

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} must define __call__")


class HalvesGLU(GatedActivation):
    """`act(gate) * up` with gate the first half of the projection, up the second."""

    def __init__(self, act: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.act = act

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        gate, up = h.chunk(2, dim=-1)
        return self.act(gate) * up

    def __repr__(self) -> str:
        return f"HalvesGLU({self.act!r})"


class ClampedSwiGLU(GatedActivation):
    """GPT-OSS's gated activation (the Note on gated activations)."""

    interleaved = True

    def __init__(self, alpha: float, limit: float) -> None:
        self.alpha, self.limit = alpha, limit

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        gate, up = h[..., ::2], h[..., 1::2]
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def __repr__(self) -> str:
        return f"ClampedSwiGLU(alpha={self.alpha}, limit={self.limit})"


def as_gated(act) -> GatedActivation:
    """`act` itself when a `GatedActivation`, else `HalvesGLU(act)` (an elementwise callable)."""
    if isinstance(act, GatedActivation):
        return act
    if not callable(act):
        raise TypeError(f"grouped_mlp: act must be a GatedActivation or an elementwise callable, got {act!r}")
    return HalvesGLU(act)


def _check(x_sorted: torch.Tensor, counts: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
           b_gate_up: torch.Tensor | None, b_down: torch.Tensor | None) -> None:
    experts = w_gate_up.shape[0]
    if w_gate_up.dim() != 3 or w_down.dim() != 3 or w_down.shape[0] != experts or counts.numel() != experts:
        raise ValueError(f"grouped_mlp: w_gate_up {tuple(w_gate_up.shape)}, w_down {tuple(w_down.shape)} and counts "
                         f"{tuple(counts.shape)} must agree on the number of experts ([E, 2I, H], [E, H, I], [E])")
    if w_gate_up.shape[1] != 2 * w_down.shape[2] or w_gate_up.shape[2] != w_down.shape[1] != x_sorted.shape[-1]:
        raise ValueError(f"grouped_mlp: shapes do not chain: x {tuple(x_sorted.shape)}, w_gate_up "
                         f"{tuple(w_gate_up.shape)}, w_down {tuple(w_down.shape)}")
    for name, bias, want in (("b_gate_up", b_gate_up, w_gate_up.shape[:2]), ("b_down", b_down, w_down.shape[:2])):
        if bias is not None and tuple(bias.shape) != tuple(want):
            raise ValueError(f"grouped_mlp: {name} must be [E, out] = {tuple(want)}, got {tuple(bias.shape)}")


def _empty(x_sorted, *tensors) -> torch.Tensor:
    # no token anywhere: an empty result that still depends on every weight (zero gradients)
    return x_sorted * 0 + 0 * sum(t.sum() for t in tensors if t is not None)


def grouped_mlp(x_sorted: torch.Tensor, counts: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                act, b_gate_up: torch.Tensor | None = None, b_down: torch.Tensor | None = None) -> torch.Tensor:
    """Every expert's gated MLP on its rows of `x_sorted` (the Notes on the interface and padding)."""
    _check(x_sorted, counts, w_gate_up, w_down, b_gate_up, b_down)
    if x_sorted.is_cuda:
        return grouped_kernel(x_sorted, counts, w_gate_up, w_down, act, b_gate_up=b_gate_up, b_down=b_down)
    glu = as_gated(act)
    experts, hidden = w_gate_up.shape[0], x_sorted.shape[-1]
    counts = counts.to(device=x_sorted.device, dtype=torch.long)
    rows = x_sorted.shape[0]
    if rows == 0:
        return _empty(x_sorted, w_gate_up, w_down, b_gate_up, b_down)
    width = int(counts.max())
    starts = torch.cumsum(counts, 0) - counts
    expert_of_row = torch.repeat_interleave(torch.arange(experts, device=x_sorted.device), counts, output_size=rows)
    slot = expert_of_row * width + (torch.arange(rows, device=x_sorted.device) - starts[expert_of_row])
    padded = x_sorted.new_zeros(experts * width, hidden).index_copy(0, slot, x_sorted).view(experts, width, hidden)
    h = torch.bmm(padded, w_gate_up.transpose(1, 2))
    if b_gate_up is not None:
        h = h + b_gate_up.unsqueeze(1)
    out = torch.bmm(glu(h), w_down.transpose(1, 2))
    if b_down is not None:
        out = out + b_down.unsqueeze(1)
    return out.reshape(experts * width, hidden).index_select(0, slot)


def grouped_kernel(x_sorted: torch.Tensor, counts: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                   act, backend: str = "auto", b_gate_up: torch.Tensor | None = None,
                   b_down: torch.Tensor | None = None) -> torch.Tensor:
    """`grouped_mlp` through ops/grouped_gemm (the Note on the GPU); `backend` as its `grouped_mm`."""
    glu = as_gated(act)
    counts = counts.to(device=x_sorted.device)
    offsets = grouped_gemm.offsets_from_counts(counts)
    if b_gate_up is None and b_down is None and isinstance(glu, HalvesGLU):
        return grouped_gemm.grouped_mlp(x_sorted, offsets, w_gate_up.transpose(1, 2), w_down.transpose(1, 2),
                                        glu.act, backend=backend)
    rows = x_sorted.shape[0]
    expert_of_row = torch.repeat_interleave(torch.arange(counts.numel(), device=x_sorted.device), counts,
                                            output_size=rows)
    h = grouped_gemm.grouped_mm(x_sorted, w_gate_up.transpose(1, 2), offsets, backend=backend)
    if b_gate_up is not None:
        h = h + _ExpertBias.apply(b_gate_up, expert_of_row)
    out = grouped_gemm.grouped_mm(glu(h), w_down.transpose(1, 2), offsets, backend=backend)
    if b_down is not None:
        out = out + _ExpertBias.apply(b_down, expert_of_row)
    return out


class _ExpertBias(torch.autograd.Function):
    """Each row's expert bias, `bias[expert_of_row]`; the bias gradient summed per expert in fp32 (the
    Note on the GPU), not in the bias dtype as `index_select`'s own backward would."""

    @staticmethod
    def forward(ctx, bias: torch.Tensor, expert_of_row: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(expert_of_row)
        ctx.experts, ctx.dtype = bias.shape[0], bias.dtype
        return bias.index_select(0, expert_of_row)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (expert_of_row,) = ctx.saved_tensors
        total = grad.new_zeros(ctx.experts, grad.shape[1], dtype=torch.float32)
        return total.index_add_(0, expert_of_row, grad.float()).to(ctx.dtype), None


def grouped_mlp_reference(x_sorted: torch.Tensor, counts: torch.Tensor, w_gate_up: torch.Tensor,
                          w_down: torch.Tensor, act, b_gate_up: torch.Tensor | None = None,
                          b_down: torch.Tensor | None = None) -> torch.Tensor:
    """`grouped_mlp` as a loop over experts: the definition (and DeepSpeed's `use_grouped_mm: false`)."""
    _check(x_sorted, counts, w_gate_up, w_down, b_gate_up, b_down)
    glu = as_gated(act)
    linear = torch.nn.functional.linear
    outs, start = [], 0
    for e, n in enumerate(counts.tolist()):
        x = x_sorted[start:start + n]
        h = linear(x, w_gate_up[e], None if b_gate_up is None else b_gate_up[e])
        outs.append(linear(glu(h), w_down[e], None if b_down is None else b_down[e]))
        start += n
    if not outs or start == 0:
        return _empty(x_sorted, w_gate_up, w_down, b_gate_up, b_down)
    return torch.cat(outs)


__all__ = ["ClampedSwiGLU", "GatedActivation", "HalvesGLU", "as_gated", "grouped_kernel", "grouped_mlp",
           "grouped_mlp_reference"]
