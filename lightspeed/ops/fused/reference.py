"""Plain PyTorch references of `lightspeed.ops.fused`: the spec every fast path is tested against, and the
CPU path of the chunked linear cross-entropy.

`rms_norm`, `apply_rope` and `swiglu` are HF Llama's own formulas (LlamaRMSNorm.forward,
apply_rotary_pos_emb with rotate_half, LlamaMLP's act_fn(gate) * up), op for op, autograd for the
backward. `linear_cross_entropy` is `F.cross_entropy(F.linear(x, w, b).float(), ...)`, the logits
materialised whole (HF's loss upcasts the logits to fp32 the same way). `ce_chunk_grad` is the torch
version of the Triton per-chunk kernel: the loss of each row and the logits' gradient, written in place.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm: normalise in fp32, round to x's dtype, then scale by `weight`."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """HF apply_rotary_pos_emb: x * cos + rotate_half(x) * sin, cos / sin [B, T, D] unsqueezed at
    `unsqueeze_dim` to broadcast over the heads."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, each op in the inputs' dtype (as LlamaMLP runs it)."""
    return F.silu(gate) * up


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                         bias: torch.Tensor | None = None, ignore_index: int = -100, label_smoothing: float = 0.0,
                         reduction: str = "mean", softcap: float | None = None) -> torch.Tensor:
    """The spec: the logits materialised, upcast to fp32, optionally soft-capped
    (cap * tanh(logits / cap)), then torch's cross-entropy."""
    logits = F.linear(x, weight, bias).float()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return F.cross_entropy(logits, target, ignore_index=ignore_index, label_smoothing=label_smoothing,
                           reduction=reduction)


def ce_chunk_grad(logits: torch.Tensor, target: torch.Tensor, scale: torch.Tensor, ignore_index: int,
                  label_smoothing: float, softcap: float | None) -> torch.Tensor:
    """Per-row loss (fp32, 0 on ignored rows) of a chunk of logits [n, V]; overwrites `logits` with
    d(sum of losses * scale)/d(logits) (0 on ignored rows). `scale`: a 0-dim fp32 tensor."""
    z = logits.float()
    if softcap is not None:
        t = torch.tanh(z / softcap)
        z = softcap * t
    valid = target != ignore_index
    safe = torch.where(valid, target, torch.zeros_like(target))
    lse = torch.logsumexp(z, dim=-1)
    z_y = z.gather(1, safe[:, None]).squeeze(1)
    vocab = z.shape[1]
    loss = (1.0 - label_smoothing) * (lse - z_y)
    if label_smoothing:
        loss = loss + label_smoothing * (lse - z.mean(dim=-1))
    grad = torch.softmax(z, dim=-1)
    grad.scatter_add_(1, safe[:, None], torch.full_like(z_y[:, None], -(1.0 - label_smoothing)))
    if label_smoothing:
        grad -= label_smoothing / vocab
    if softcap is not None:
        grad *= 1.0 - t * t
    grad *= torch.where(valid, scale, torch.zeros_like(scale))[:, None]
    logits.copy_(grad)
    return torch.where(valid, loss, torch.zeros_like(loss))
