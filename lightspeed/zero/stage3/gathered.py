"""User-facing access to partitioned parameters outside the hooks: `GatheredParameters` (read, or
modify on one rank and write back into every rank's shards), `register_external_parameter`, and
`Unsharding` (the groups a strategy's `unshard()` keeps gathered across many forwards).

Owns: those entry points and the one way they hold groups (`hold` / `let_go`: a pin per holder, every
all-gather issued before the first wait). Must not: schedule anything itself (it asks the groups'
coordinator: a strategy's, or `init.StandaloneScheduler` for a model partitioned by `zero.Init` and not
yet handed to `initialize()`). Parameters that are not partitioned are ignored by `GatheredParameters`,
as DeepSpeed ignores them; `register_external_parameter` keeps them until a strategy takes their module.

Note (unshard): FSDP2's `unshard()` / `reshard()`. `Stage3Strategy.unshard(module)` holds every group
the units under `module` use (their own parameters, tied and external ones) with one pin each, gathered
together (one all-gather per group, all in flight at once, regardless of `stage3_max_live_parameters`).
A pinned group is what the coordinator's hooks already know: the forward pre-hook finds it gathered
(no collective), the post-hook and the end of a no-grad forward do not release it, so any number of
forwards run with no collective for those groups. A backward works as usual: the pre-backward hooks
find the groups gathered, the gradients are reduce-scattered as in any backward and the groups stay
gathered after it. The optimizer step is refused while anything is unsharded: generation and
training interleave by resharding between them, so a step never has to keep gathered copies current.
Rules: unsharding a group already unsharded is a no-op (FSDP2's rule), so is resharding one that is
not; `unsharded()` reshards on exit only what it unsharded itself, so it nests inside an outer
`unshard()`. `reshard` releases as a normal release does (storage freed, `param.data` the empty
placeholder); persistent groups (`stage3_param_persistence_threshold`) stay gathered, as after any
forward, until the next step. At a data-parallel world of one with the parameters viewing their
shards (param_group.py's Note: one rank) there is nothing to gather or free. With `offload_param` the
gather copies the host (or NVMe) shard to the device as any gather does.
A use of a parameter outside its unit is detected only while its group is released (coordinator.py's
Note: external parameters): a model whose first traced forward and backward run entirely while
unsharded has none detected, and needs `register_external_parameter` for such uses.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Callable, Iterable, Iterator

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


def hold(groups: list[ParamGroup]) -> None:
    """Pin `groups` and gather them: every all-gather is issued before the first wait."""
    for g in groups:
        g.pins += 1
    for g in groups:
        g.coordinator.fetch(g)
    for g in groups:
        g.wait()


def let_go(groups: list[ParamGroup], hand_over: bool = False) -> None:
    """Unpin `groups`; each is released unless another holder (or its persistence) keeps it. `hand_over`:
    what was gathered stays valid where referenced (param_group.py's Note: values taken inside
    GatheredParameters)."""
    for g in groups:
        g.pins -= 1
        g.coordinator.release(g, hand_over=hand_over)


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
        hold(self.groups)
        return self.params if len(self.params) != 1 else self.params[0]

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if self.modifier_rank is not None and exc_type is None:
                for g in self.groups:
                    self._write_back(g)
        finally:
            let_go(self.groups, hand_over=True)

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


class Unsharding:
    """The groups a strategy's `unshard()` holds gathered (Note: unshard). `groups_under(module)` gives
    the groups the units under `module` (None: the whole model) use, in the strategy's order, which is
    the same on every rank: the all-gathers are collectives."""

    def __init__(self, groups_under: Callable[[torch.nn.Module | None], list[ParamGroup]]):
        self._groups_under = groups_under
        self._held: list[ParamGroup] = []  # in the order they were unsharded

    @property
    def active(self) -> bool:
        return bool(self._held)

    def unshard(self, module: torch.nn.Module | None = None) -> list[ParamGroup]:
        """Gather the groups under `module` not unsharded yet and keep them gathered; returns them."""
        new = [g for g in self._groups_under(module) if g not in self._held]
        hold(new)
        self._held.extend(new)
        return new

    def reshard(self, module: torch.nn.Module | None = None, groups: list[ParamGroup] | None = None) -> None:
        """Release the unsharded groups under `module` (or exactly `groups`, where unsharded)."""
        under = self._groups_under(module) if groups is None else groups
        gone = [g for g in self._held if g in under]
        self._held = [g for g in self._held if g not in gone]
        let_go(gone)

    @contextlib.contextmanager
    def unsharded(self, module: torch.nn.Module | None, yields=None) -> Iterator:
        """Unshard `module` for the block (yielding `yields`), then reshard what this call unsharded,
        also when the block raises."""
        new = self.unshard(module)
        try:
            yield yields
        finally:
            self.reshard(groups=new)

    def check_step(self) -> None:
        if self._held:
            names = ", ".join(g.name for g in self._held[:4]) + (", ..." if len(self._held) > 4 else "")
            raise RuntimeError(f"ZeRO-3: step() while parameters are unsharded (groups {names}) is not supported; "
                               "call engine.reshard() (or leave engine.unsharded()) before the step")
