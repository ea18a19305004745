"""Exception types for misuse of the engine's API where DeepSpeed fails an `assert`.

Each is also an AssertionError, so code written against DeepSpeed that catches AssertionError catches
it, while lightspeed's one-line message and its usual base type (RuntimeError for a call made at the
wrong time, ValueError for a wrong argument) stay. Must not: hold any check (the raising code does)."""

from __future__ import annotations


class UsageAssertionError(RuntimeError, AssertionError):
    """An engine method called where it cannot run (e.g. `no_sync()` at ZeRO stage 2, `step()` at an
    accumulation boundary inside `no_sync()`)."""


class ArgumentAssertionError(ValueError, AssertionError):
    """A required argument missing or wrong (e.g. `initialize(model=None)`)."""


__all__ = ["ArgumentAssertionError", "UsageAssertionError"]
