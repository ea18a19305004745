"""What a strategy may ask of an optimizer that reduces the gradients' information itself.

Owns: the `ReducesOwnGradients` capability. A strategy that finds it on its optimizer asks, before
each accumulation window's backward at the boundary, whether the coming step wants the gradients
left local (not all-reduced): the one-bit optimizers after their warm-up, which communicate
compressed momentum instead. Must not: know a strategy or the engine.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class ReducesOwnGradients(Protocol):
    def owns_gradient_reduction(self) -> bool:
        """True when the next `step()` expects each rank's own (local, unreduced) gradients."""
        ...
