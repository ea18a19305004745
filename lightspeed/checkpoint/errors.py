"""The exception type for checkpoints that cannot be read or written (and its variant for the problems
DeepSpeed asserts on). Lives at the bottom of checkpoint/ so every module in it (and the engine above) can
raise and catch it."""

from __future__ import annotations

__all__ = ["CheckpointAssertionError", "CheckpointError"]


class CheckpointError(ValueError):
    """A checkpoint problem, in one line that names the file, e.g.
    ``CheckpointError: /ckpt/global_step10/mp_rank_00_model_states.pt is truncated or corrupt (...)``."""


class CheckpointAssertionError(CheckpointError, AssertionError):
    """A `CheckpointError` for a problem DeepSpeed reports with a failed `assert` (ranks saving different
    tags): code written against DeepSpeed that catches AssertionError catches it too."""
