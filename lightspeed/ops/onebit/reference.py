"""Sign bits packed 8 per byte, and back: the plain-PyTorch spec and the CPU path.

Layout: bit k (least significant first) of byte i holds element 8*i + k; a bit is 1 when the element
is >= 0 (so 0 counts as +1: one bit cannot say "zero", which is why the optimizers keep error
feedback). Bits past the last element are 0. Unpacking gives +1 / -1, optionally times a scale per
chunk of `chunk` consecutive elements (`scales[i // chunk]`).
"""

from __future__ import annotations

import torch

_WEIGHTS = {}


def _weights(device: torch.device) -> torch.Tensor:
    w = _WEIGHTS.get(device)
    if w is None:
        w = _WEIGHTS[device] = (2 ** torch.arange(8, dtype=torch.int32, device=device)).to(torch.uint8)
    return w


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """uint8 [ceil(n / 8)]: the signs of the n elements of `x` (any float dtype, flattened)."""
    flat = x.reshape(-1)
    n = flat.numel()
    bits = torch.zeros(((n + 7) // 8) * 8, dtype=torch.uint8, device=flat.device)
    bits[:n] = flat >= 0
    return (bits.view(-1, 8) * _weights(flat.device)).sum(dim=1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor, numel: int, scales: torch.Tensor | None = None, chunk: int | None = None,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[numel] of +1 / -1 (times `scales[i // chunk]` when given) from the bytes of `pack_signs`."""
    if packed.dtype != torch.uint8 or packed.numel() * 8 < numel:
        raise ValueError(f"unpack_signs: need uint8 with at least {(numel + 7) // 8} bytes, got {packed.dtype} "
                         f"[{packed.numel()}]")
    bits = (packed.reshape(-1, 1) & _weights(packed.device)) != 0
    out = bits.reshape(-1)[:numel].to(torch.float32).mul_(2).sub_(1)
    if scales is not None:  # in fp32, then one rounding to `dtype`
        if chunk is None or chunk <= 0 or scales.numel() * chunk < numel:
            raise ValueError(f"unpack_signs: {scales.numel()} scales of chunk {chunk} do not cover {numel} elements")
        scales = scales.reshape(-1).to(torch.float32)
        if numel % chunk == 0:
            out = out.view(-1, chunk).mul_(scales[: numel // chunk, None]).reshape(-1)
        else:
            out = out.mul_(scales.repeat_interleave(chunk)[:numel])
    return out if dtype == torch.float32 else out.to(dtype)
