"""`deepspeed.runtime.zero.parameter_offload`: `DeepSpeedZeRoOffload`, the object that owns ZeRO-3's
module hooks in DeepSpeed, as a view over a lightspeed stage-3 engine; `deepspeed.initialize` puts one
at `engine.optimizer.parameter_offload` (where DeepSpeed's stage-3 optimizer keeps its own) and gives
every module of the model `ds_external_parameters()`.

Owns: answering, through the engine's public stage-3 seam (`unsharded()`, and the strategy's
`trace_complete` / `restart_trace` / `external_parameters`), the internals that code written for
DeepSpeed touches around generation: TRL's `unwrap_model_for_generation` removes the hooks inside a
`GatheredParameters` of the whole model, generates, then re-registers them and invalidates the trace.
Must not: hold hooks of its own, or reach into the strategy's coordinator.

Note (hooks removed): DeepSpeed removes its module hooks so that the many forwards of generation run
no gather, release or trace bookkeeping. lightspeed's hooks live in the stage-3 coordinator, which has
no hook to take out for a while; what DeepSpeed gets from the removal, lightspeed's `engine.unshard()`
gives (gathered.py's Note: unshard): every group stays gathered, and forwards run with no collective and
release nothing. So `forward_hooks` and `backward_hooks` each hold one handle standing for the
coordinator's hooks, and removing a handle enters `engine.unsharded()` (once, however many handles are
removed); `_register_deepspeed_module(model)` leaves that block (resharding only what it unsharded, so
an enclosing `GatheredParameters` or `unshard()` keeps its groups) and puts fresh handles in the lists.
While the hooks are "removed" the optimizer step is refused, as `engine.unsharded()` refuses it.

Note (trace): DeepSpeed's coordinator has three trace modes (record, complete, invalid). lightspeed's
records the module order of a forward+backward and follows it afterwards; restarting it records again
from the next forward, which is what DeepSpeed's invalid mode leads to. So `is_invalid_trace()` is True
while no recorded order is being followed (lightspeed will record one), `is_complete_trace()` its
opposite, and `_invalidate_trace()` restarts the recording (refused, as DeepSpeed refuses it, when the
trace is already invalid).
"""

from __future__ import annotations

import contextlib
import types
import weakref

import torch


class PartitionedParameterCoordinator:
    """The trace queries of DeepSpeed's `PartitionedParameterCoordinator` (Note: trace), over `engine`."""

    def __init__(self, engine):
        self._engine = weakref.ref(engine)

    def _strategy(self):
        engine = self._engine()
        if engine is None:
            raise RuntimeError("the engine of this ZeRO-3 coordinator view no longer exists")
        return engine.strategy

    def is_complete_trace(self) -> bool:
        return self._strategy().trace_complete()

    def is_invalid_trace(self) -> bool:
        return not self._strategy().trace_complete()

    def _invalidate_trace(self) -> None:
        if self.is_invalid_trace():
            raise RuntimeError("attempted to invalidate an already invalid ZeRO-3 trace")
        self._strategy().restart_trace()


class _ModuleHooksHandle:
    """Stands for the coordinator's module hooks in `forward_hooks` / `backward_hooks` (Note: hooks
    removed): `remove()` unshards the model through the offload view; a second call does nothing."""

    def __init__(self, offload: "DeepSpeedZeRoOffload"):
        self._offload = offload
        self._removed = False

    def remove(self) -> None:
        if not self._removed:
            self._removed = True
            self._offload._hooks_removed()


class DeepSpeedZeRoOffload:
    """DeepSpeed's ZeRO-3 parameter-offload object, as code written for DeepSpeed uses it: `module`,
    `param_coordinator` (`get_param_coordinator()`), `forward_hooks` / `backward_hooks` (lists of handles
    with `remove()`), `_remove_module_hooks()` and `_register_deepspeed_module(module)` (see the Notes)."""

    def __init__(self, engine):
        self._engine = weakref.ref(engine)
        self.module = engine.module
        self.param_coordinator = PartitionedParameterCoordinator(engine)
        self._unsharded: contextlib.ExitStack | None = None  # the engine.unsharded() block of removed hooks
        self.forward_hooks = [_ModuleHooksHandle(self)]
        self.backward_hooks = [_ModuleHooksHandle(self)]
        for m in self.module.modules():
            m.ds_external_parameters = types.MethodType(_external_parameters_of(engine), m)

    def get_param_coordinator(self) -> PartitionedParameterCoordinator:
        return self.param_coordinator

    def _live_engine(self):
        engine = self._engine()
        if engine is None:
            raise RuntimeError("the engine of this ZeRO-3 parameter-offload view no longer exists")
        return engine

    def _hooks_removed(self) -> None:
        if self._unsharded is None:
            stack = contextlib.ExitStack()
            stack.enter_context(self._live_engine().unsharded())
            self._unsharded = stack

    def _remove_module_hooks(self) -> None:
        """DeepSpeed's: remove every module hook (here: unshard the model, Note: hooks removed)."""
        for handle in (*self.forward_hooks, *self.backward_hooks):
            handle.remove()
        self.forward_hooks, self.backward_hooks = [], []

    def _register_deepspeed_module(self, module: torch.nn.Module, count=None) -> None:
        """DeepSpeed's: put the module hooks back on `module`, the root model (lightspeed's coordinator
        hooks the whole model at once), invalidating the trace; the model is resharded to what it was
        before the hooks were removed."""
        if module is not self.module:
            raise ValueError(f"ZeRO-3: hooks are registered for the whole model at once; pass the engine's model "
                             f"({type(self.module).__name__}), not a {type(module).__name__}")
        if self._unsharded is None:
            raise RuntimeError("ZeRO-3: the module hooks are in place already (remove them first)")
        if not self.param_coordinator.is_invalid_trace():
            self.param_coordinator._invalidate_trace()
        stack, self._unsharded = self._unsharded, None
        stack.close()
        self.forward_hooks = [_ModuleHooksHandle(self)]
        self.backward_hooks = [_ModuleHooksHandle(self)]


def _external_parameters_of(engine):
    """DeepSpeed's `module.ds_external_parameters()` for the modules of `engine`'s model: (id, parameter)
    pairs, as DeepSpeed's dictionary of registered parameters gives them."""
    ref = weakref.ref(engine)

    def ds_external_parameters(self):
        live = ref()
        if live is None:
            raise RuntimeError("the engine that partitioned this module no longer exists")
        return [(id(p), p) for p in live.strategy.external_parameters(self)]

    return ds_external_parameters


def attach(engine) -> None:
    """Give a stage-3 `engine` with an optimizer DeepSpeed's `engine.optimizer.parameter_offload`."""
    if engine.zero_optimization_stage() == 3 and engine.optimizer is not None:
        engine.optimizer.parameter_offload = DeepSpeedZeRoOffload(engine)


__all__ = ["DeepSpeedZeRoOffload", "PartitionedParameterCoordinator"]
