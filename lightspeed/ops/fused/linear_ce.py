"""The chunked fused linear + cross-entropy: loss = CE(x @ W^T + b, target) without the [tokens, vocab]
logits ever existing whole.

Owns: `LinearCrossEntropy` (the autograd.Function), the chunk-size rule, the argument checks. The per-chunk
softmax / loss / logits-gradient is `triton.ce_chunk_grad` on the Triton path and
`reference.ce_chunk_grad` on the reference path (same contract).

Note: [gradients in the forward] The forward walks the tokens in chunks: logits_c = x_c W^T (+ b) in the
inputs' dtype, the chunk's row losses and d(loss)/d(logits_c) written over logits_c, then dx_c = dlogits_c W
and dW += dlogits_c^T x_c (db += the column sums). Only one chunk's logits live at a time; the backward
multiplies the stored dx, dW, db by the incoming gradient (in place: a second backward through the same
graph is refused). dW accumulates in W's dtype (`addmm_`), as dx does in x's; db in fp32.

Note: [fp16] The gradients are computed in the forward, before the backward's incoming gradient (a
loss scale, 1 / accumulation steps) multiplies them: in fp16 a small gradient may underflow where the
unfused head, scaled first, keeps it. bf16 and fp32 have fp32's range. A target outside [0, vocab) that
is not ignore_index is not checked on the Triton path (torch's cross-entropy raises; the kernel reads
out of its row).

Note: [chunk size] Default: the power of two nearest above tokens / ceil(vocab / hidden), so a chunk's
logits are about the size of x (Liger-Kernel's rule); `chunk_size` overrides it.

Note: [reduction] "mean" divides by the number of targets that are not `ignore_index` (a 0-dim device
tensor: no host sync; with none, the loss is nan as torch's is), "sum" does not; label smoothing is
torch's: (1 - eps) * nll + eps * mean over the vocabulary of -log p, on the non-ignored rows. Soft-capping
(`softcap`): the logits become cap * tanh(logits / cap) before the softmax (Gemma 2's final cap).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

REDUCTIONS = ("mean", "sum")


def default_chunk_size(tokens: int, vocab: int, hidden: int) -> int:
    factor = -(-vocab // max(hidden, 1))
    rows = max(1, -(-tokens // factor))
    return max(1, min(tokens, 1 << (rows - 1).bit_length()))


def chunked_loss(x, weight, bias, target, ignore_index, label_smoothing, reduction, softcap, chunk_size, chunk_fn,
                 needs: tuple[bool, bool, bool]):
    """(loss, dx, dW, db) of the chunk walk (Note: [gradients in the forward]); a gradient is None
    where `needs` says it is not wanted (with none wanted, only the losses are computed)."""
    tokens, _ = x.shape
    valid = target != ignore_index
    if reduction == "mean":
        scale = valid.sum().to(torch.float32).reciprocal()
    else:
        scale = torch.ones((), dtype=torch.float32, device=x.device)
    grad_x = torch.empty_like(x) if needs[0] else None
    grad_w = torch.zeros_like(weight) if needs[1] else None
    grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=x.device) if bias is not None and needs[2] \
        else None
    losses = torch.empty(tokens, dtype=torch.float32, device=x.device)
    for start in range(0, tokens, chunk_size):
        end = min(start + chunk_size, tokens)
        xc = x[start:end]
        logits = F.linear(xc, weight, bias)
        losses[start:end] = chunk_fn(logits, target[start:end], scale, ignore_index, label_smoothing, softcap)
        if grad_x is not None:
            torch.mm(logits, weight, out=grad_x[start:end])
        if grad_w is not None:
            grad_w.addmm_(logits.t(), xc)
        if grad_b is not None:
            grad_b += logits.sum(0, dtype=torch.float32)
    return losses.sum() * scale, grad_x, grad_w, grad_b


class LinearCrossEntropy(torch.autograd.Function):
    """(x [N, H], weight [V, H], bias [V] or None, target [N]) -> the scalar loss; see the module Notes."""

    @staticmethod
    def forward(ctx, x, weight, bias, target, ignore_index, label_smoothing, reduction, softcap, chunk_size,
                chunk_fn):
        loss, grad_x, grad_w, grad_b = chunked_loss(x, weight, bias, target, ignore_index, label_smoothing, reduction,
                                                    softcap, chunk_size, chunk_fn, ctx.needs_input_grad[:3])
        ctx.save_for_backward(grad_x, grad_w, grad_b)
        ctx.bias_dtype = bias.dtype if bias is not None else None
        ctx.done = False
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        if ctx.done:
            raise RuntimeError("fused_linear_cross_entropy: a second backward through the same loss is not "
                               "supported (its gradients are computed in the forward and scaled in place)")
        ctx.done = True
        grad_x, grad_w, grad_b = ctx.saved_tensors
        if grad_x is not None:
            grad_x.mul_(grad_loss.to(grad_x.dtype))
        if grad_w is not None:
            grad_w.mul_(grad_loss.to(grad_w.dtype))
        if grad_b is not None:
            grad_b = (grad_b * grad_loss).to(ctx.bias_dtype)
        return grad_x, grad_w, grad_b, None, None, None, None, None, None, None


def check_arguments(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias, ignore_index,
                    label_smoothing: float, reduction: str, softcap, chunk_size) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"fused_linear_cross_entropy: reduction must be one of {', '.join(REDUCTIONS)} "
                         f"(got {reduction!r})")
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"fused_linear_cross_entropy: x [..., {x.shape[-1]}] does not fit weight "
                         f"{list(weight.shape)} (want [vocab, {x.shape[-1]}])")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"fused_linear_cross_entropy: bias {list(bias.shape)} does not fit weight "
                         f"{list(weight.shape)}")
    if target.numel() != x.numel() // max(x.shape[-1], 1):
        raise ValueError(f"fused_linear_cross_entropy: {target.numel()} targets for {x.numel() // x.shape[-1]} rows")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"fused_linear_cross_entropy: label_smoothing must be in [0, 1] (got {label_smoothing})")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"fused_linear_cross_entropy: softcap must be > 0 or None (got {softcap})")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"fused_linear_cross_entropy: chunk_size must be >= 1 (got {chunk_size})")
