"""The error a mixture-of-experts layer raises for a bad argument where DeepSpeed fails an `assert`.

Must not: hold a check (the raising code does)."""

from __future__ import annotations


class MoEArgumentError(ValueError, AssertionError):
    """A wrong argument to a MoE layer or gate (a ValueError, and an AssertionError for code written
    against DeepSpeed's asserts)."""


__all__ = ["MoEArgumentError"]
