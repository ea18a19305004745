"""Stochastic rounding of fp32 values to bf16: the plain-PyTorch spec, and the seeds of its random bits.

Owns: `stochastic_round_bf16` (fp32 -> bf16 with uniform random bits below the bf16 mantissa),
`round_in_place` (an optimizer's fp32 result written into its bf16 tensor that way) and `mix_seed`
(the 62-bit seed of one step's draws from a base seed and integers naming the step, launch or
chunk). The Triton kernels do the same bit operation (`multi_tensor/triton.py`); the CPU optimizers
and the fused optimizers' reference path call this one. Must not: choose when rounding is stochastic
(`bf16.stochastic_rounding`, read by zero/optimizers.py).

Note [the bit trick]: a finite fp32 value x lies between two neighbouring bf16 values, the one
nearer zero (x's bits with the low 16 cleared) and the next one away from zero. Adding a uniform
16-bit integer r to x's bit pattern and clearing the low 16 bits moves to the one away from zero
exactly when r >= 2**16 - low16(x), i.e. with probability low16(x) / 2**16, which is x's distance
from the one nearer zero in units of the gap: the expected result is x (unbiased). A carry into the
exponent is the correct next neighbour (the format is monotone in its bit pattern); a value above
bf16's largest finite rounds to inf with that probability, as round-to-nearest does above half a
gap. inf and nan are left as they are (their bits are not touched).
"""
from __future__ import annotations

import torch

__all__ = ["mix_seed", "round_in_place", "stochastic_round_bf16"]

_MASK64 = (1 << 64) - 1
_LOW16 = 0xFFFF
_EXP_MASK = 0x7F800000


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def mix_seed(base: int, *parts: int) -> int:
    """A seed in [2**62, 2**63) from `base` and `parts` (step, launch, chunk ...): different parts give
    unrelated seeds, the same parts the same seed. Always above 2**62 so Triton passes it as one int64
    type (no recompilation between steps) and Philox uses both of its 32-bit key words."""
    h = _splitmix64(base & _MASK64)
    for part in parts:
        h = _splitmix64(h ^ (int(part) & _MASK64))
    return (1 << 62) | (h & ((1 << 62) - 1))


def stochastic_round_bf16(x: torch.Tensor, generator: torch.Generator | None = None,
                          bits: torch.Tensor | None = None) -> torch.Tensor:
    """`x` (fp32) rounded to bf16 stochastically (see the Note): a bf16 tensor of x's shape. The 16
    random bits per element are `bits` (integers in [0, 2**16), x's shape) when given, else drawn
    with ``torch.randint`` from `generator` on x's device."""
    if x.dtype != torch.float32:
        raise TypeError(f"stochastic_round_bf16: needs an fp32 tensor (got {x.dtype})")
    if bits is None:
        bits = torch.randint(0, _LOW16 + 1, x.shape, dtype=torch.int32, device=x.device, generator=generator)
    # the fp32 bit pattern as int32: adding r < 2**16 to a finite value's pattern never leaves the int32
    # range (the largest finite magnitude is 0x7F7FFFFF; negatives are the same magnitudes with the sign bit)
    raw = x.view(torch.int32)
    rounded = (raw + bits.to(torch.int32)) & ~_LOW16
    finite = (raw & _EXP_MASK) != _EXP_MASK
    out = torch.where(finite, rounded, raw)
    # the low 16 bits of every finite result are zero, so the conversion is exact; inf and nan convert as themselves
    return out.view(torch.float32).to(torch.bfloat16)


def round_in_place(dst: torch.Tensor, value: torch.Tensor, generator: torch.Generator) -> None:
    """dst.copy_(value), with the fp32 `value` rounded stochastically when `dst` is bf16 (a plain copy
    otherwise: an fp32 tensor takes the value as it is)."""
    if dst.dtype == torch.bfloat16:
        dst.copy_(stochastic_round_bf16(value.reshape(dst.shape).float(), generator))
    else:
        dst.copy_(value.reshape(dst.shape))
