"""`deepspeed.runtime.zero.stage3`'s public helper `unwrap_model_for_generation` (TRL and other
generation loops call it), over the engine's FSDP2-style `unsharded()` (runtime/engine.py), and the name
of DeepSpeed's stage-3 optimizer wrapper."""

from __future__ import annotations

import contextlib

from lightspeed.compat.deepspeed._missing import optimizer_wrapper_class

DeepSpeedZeroOptimizer_Stage3 = optimizer_wrapper_class("deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3",
                                                        "ZeRO stage 3")


@contextlib.contextmanager
def unwrap_model_for_generation(model):
    """For the `with` block, `model` (a `deepspeed.initialize` engine) with its parameters gathered once
    (ZeRO stage 3), so repeated forwards (token-by-token generation) run no gather; resharded on exit.
    At stages 0-2 the parameters are whole already and nothing is gathered. Yields `model`, as DeepSpeed's.
    A collective at stage 3: every rank enters the block.

    As DeepSpeed's, a stage-3 engine with an optimizer has its module hooks taken out of
    `engine.optimizer.parameter_offload` for the block (its `forward_hooks` / `backward_hooks` lists are
    empty inside; removing them keeps the groups gathered, parameter_offload.py's Note: hooks removed)
    and registered again after it."""
    offload = getattr(model.optimizer, "parameter_offload", None) if model.optimizer is not None else None
    if offload is None:
        with model.unsharded():
            yield model
        return
    with model.unsharded():  # DeepSpeed's GatheredParameters(model.parameters()) around the hook removal
        for hook in [*offload.forward_hooks, *offload.backward_hooks]:
            hook.remove()
        offload.forward_hooks, offload.backward_hooks = [], []
        try:
            yield model
        finally:
            offload._register_deepspeed_module(offload.module)


__all__ = ["DeepSpeedZeroOptimizer_Stage3", "unwrap_model_for_generation"]
