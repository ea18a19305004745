"""User-facing access to partitioned parameters outside the hooks: `GatheredParameters` (read, or
modify on one rank and write back into every rank's shards) and `register_external_parameter`.

Owns: those two entry points. Must not: schedule anything itself (it asks the groups' coordinator: a
strategy's, or `init.StandaloneScheduler` for a model partitioned by `zero.Init` and not yet handed to
`initialize()`). Parameters that are not partitioned are ignored by `GatheredParameters`, as DeepSpeed
ignores them; `register_external_parameter` keeps them until a strategy takes their module.
"""

from __future__ import annotations

import weakref
from typing import Iterable

import torch

from lightspeed.zero.stage3.init import StandaloneScheduler
from lightspeed.zero.stage3.param_group import ParamGroup, param_state

# module -> parameters registered as external before a strategy managed them (e.g. inside Init)
_PENDING: "weakref.WeakKeyDictionary[torch.nn.Module, list[torch.nn.Parameter]]" = weakref.WeakKeyDictionary()


def take_pending_external(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    return _PENDING.pop(module, [])


def _as_list(params) -> list[torch.Tensor]:
    if params is None:
        return []
    if isinstance(params, torch.Tensor):
        return [params]
    return list(params)


def _groups_of(params: Iterable[torch.Tensor]) -> list[ParamGroup]:
    groups: list[ParamGroup] = []
    for p in params:
        st = param_state(p)
        if st is not None and st.group not in groups:
            groups.append(st.group)
    return groups


def register_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """Gather `parameter`'s group around `module`'s forward and backward (DeepSpeed's API). Rarely
    needed: uses outside the owning module are found automatically during forward."""
    st = param_state(parameter)
    if st is None or isinstance(st.group.coordinator, StandaloneScheduler):  # no strategy yet (e.g. inside Init)
        _PENDING.setdefault(module, []).append(parameter)
    else:
        st.group.coordinator.register_external(module, [st.group])


class GatheredParameters:
    """Context manager: inside, `params` (a parameter or an iterable of them) hold their full values.

    With `modifier_rank` set, on exit the values of that rank (as modified in place inside the block)
    are broadcast and written into every rank's lp and fp32 master shards. `fwd_module` additionally
    registers the parameters as external parameters of that module. A collective: every rank of the
    data-parallel group must enter it with the same parameters.
    """

    def __init__(self, params, modifier_rank: int | None = None, fwd_module: torch.nn.Module | None = None,
                 enabled: bool = True):
        self.params = _as_list(params)
        self.modifier_rank, self.fwd_module, self.enabled = modifier_rank, fwd_module, enabled
        self.groups = _groups_of(self.params) if enabled else []

    def __enter__(self):
        if self.enabled and self.fwd_module is not None:
            for p in self.params:
                if param_state(p) is not None:
                    register_external_parameter(self.fwd_module, p)
        for g in self.groups:
            g.pins += 1
        for g in self.groups:
            g.coordinator.fetch(g)
        for g in self.groups:
            g.wait()
        return self.params if len(self.params) != 1 else self.params[0]

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if self.modifier_rank is not None and exc_type is None:
                for g in self.groups:
                    self._write_back(g)
        finally:
            for g in self.groups:
                g.pins -= 1
                g.coordinator.release(g)

    def _write_back(self, g: ParamGroup) -> None:
        with torch.no_grad():
            for p, view in zip(g.params, g.views):
                if p.data.data_ptr() != view.data_ptr():  # `.data` was replaced rather than modified
                    view.copy_(p.data)
                    p.data = view
            g.comm.broadcast(g.full_flat, src=self.modifier_rank)
            g.lp_shard.copy_(g.full_flat[g.shard.start:g.shard.end])
            g.shard_changed()
            g.copy_lp_to_master()
