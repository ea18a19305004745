"""`deepspeed.runtime.zero.stage3`'s public helper `unwrap_model_for_generation` (TRL and other
generation loops call it), over the engine's FSDP2-style `unsharded()` (runtime/engine.py)."""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def unwrap_model_for_generation(model):
    """For the `with` block, `model` (a `deepspeed.initialize` engine) with its parameters gathered once
    (ZeRO stage 3), so repeated forwards (token-by-token generation) run no gather; resharded on exit.
    At stages 0-2 the parameters are whole already and nothing is gathered. Yields `model`, as DeepSpeed's.
    A collective at stage 3: every rank enters the block."""
    with model.unsharded():
        yield model


__all__ = ["unwrap_model_for_generation"]
