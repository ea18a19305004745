"""What a strategy may ask of an optimizer that reduces the gradients' information itself.

Owns: the `ReducesOwnGradients` capability. A strategy that finds it on its optimizer asks, before
each accumulation window's backward at the boundary, whether the coming step wants the gradients
left local (not all-reduced): the one-bit optimizers after their warm-up, which communicate
compressed momentum instead; and, around building a checkpoint's state dict, to gather the state that
differs from rank to rank (error feedback) where the saved param groups hold it. Must not: know a
strategy or the engine.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class ReducesOwnGradients(Protocol):
    def owns_gradient_reduction(self) -> bool:
        """True when the next `step()` expects each rank's own (local, unreduced) gradients."""
        ...

    def gather_error_feedback(self) -> None:
        """Collective (every rank): put every rank's per-rank state where a checkpoint saves it."""
        ...

    def drop_gathered_error_feedback(self) -> None:
        """Free what `gather_error_feedback` gathered."""
        ...
