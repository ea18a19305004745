"""The stage-3 coordinator: decides when each ParamGroup is gathered and released, and owns every hook.

Hooks (all registered through public torch APIs; nothing on nn.Module or nn.Parameter is patched):
    forward pre-hook (unit modules)     gather the groups the unit uses; prefetch what comes next
    forward hook (unit modules)         release them (persistence, reuse distance, live limit permitting);
                                        register the pre-backward hook on the outputs that need grad
    pre-backward (multi-grad hook, any) re-gather the unit's groups before its backward runs
    post-accumulate-grad (each param)   when all of a group's grads are in: reduce-scatter, release
    torch-function mode (forward)       a released managed parameter reaching any torch op is gathered
                                        on the spot and registered as used by the innermost running
                                        unit (DeepSpeed's "external parameters", found automatically)
Only unit modules (see `units.py`) have hooks: the modules inside a unit run with its groups gathered.
Below, "module" means a unit module.

Must not: know the optimizer, the precision policy or the loss scale (the strategy does).

Note (the trace): the modules whose hooks fire (every forward; backward where there are groups to
gather) are recorded in order during the first forward+backward; later iterations follow it with a
cursor, and an iteration that departs from it has the next one recorded again. With
a complete trace the coordinator prefetches the groups of upcoming modules (up to
`stage3_prefetch_bucket_size` elements, and never past `stage3_max_live_parameters` gathered
elements), and keeps a group gathered after a module's forward when the trace uses it again within
`stage3_max_reuse_distance` elements (DeepSpeed's rule; its default, 1e9, keeps every group of a
small model gathered from its first use until its backward). Each forward follows the trace from
its start and each backward (`backward_start`) from its backward part, so the recorded last forward
and backward also serve a pipeline stage, which runs several micro-batches' forwards before their
backwards, each backward bracketed on its own. If a forward or backward departs from the trace
(control flow changed), prefetching and reuse-keeping stop until the next one starts, and the
iteration after records the trace again; correctness never depends on the trace.

Note (recomputation): activation checkpointing reruns a forward inside backward (lightspeed.checkpointing,
torch.utils.checkpoint, Hugging Face's gradient checkpointing). The units of that rerun need their
groups gathered like any forward, but the rerun is no new module order: its hooks are not recorded in
the trace, do not move the trace position, prefetch nothing and leave the external-use detection
off. The rerun's groups stay gathered after it: the backward of those very units follows at once
(torch's non-reentrant checkpoint reads the rerun's saved views of the parameters right away, with no
pre-backward hook in between), and their gradients' arrival or `backward_end` releases them as in any
backward. A forward is a rerun when it starts while the autograd engine is running a backward on this
thread, also one outside `backward_start` / `backward_end`: a zero-bubble pipeline schedule's input-
gradient half (torch's `stage_backward_input`, which writes no parameter gradient, so the driver does
not bracket it) recomputes checkpointed layers too; their groups then stay gathered until the weight
half's bracket ends. Where torch does not expose the running backward, the bracket alone decides.

Note (other forward methods): the root's hooks run when the root module is called; a model method that
is a forward by another name (DeepSpeed-Chat's `RewardModel.forward_value`, which calls the base model and
the value head, never `forward`) would run its own code with the root unit's groups released, where
DeepSpeed, whose hooks are on every module, gathers them. `call_as_forward` runs such a method between
the root's forward hooks, as FSDP2's `register_fsdp_forward_method` does; the engine routes its module's
`forward_*` methods through it (runtime/module_passthrough.py).

Note (external parameters): a parameter read outside its owner's forward (e.g. `self.wte.weight` in
the top-level forward) is found by a TorchFunctionMode active during forward: the op that receives
the released parameter triggers its gather, and the innermost running module gathers that group
around its forward and backward from then on. The mode costs a Python call per torch op, so by
default (`external_detection="trace"`) it is active only until the first forward+backward has been
traced; a use that first appears later needs `register_external_parameter` (or "always").
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch.autograd.graph import register_multi_grad_hook
from torch.overrides import TorchFunctionMode

from lightspeed._utils.logging import get_logger, warn_once
from lightspeed.zero.stage3.param_group import GATHERED, RELEASED, ParamGroup, param_state

logger = get_logger(__name__)

MAX_INFLIGHT_REDUCES = 2  # bounds the full-size gradient buffers alive at once

# -1 outside a backward; torch.utils.checkpoint asks the same. Where it is missing, the engine's backward
# window alone decides (a backward that raised would then leave the window open until the next one).
_graph_task_id = getattr(torch._C, "_current_graph_task_id", None)


@dataclass(frozen=True)
class Schedule:
    """The knobs of gathering and releasing (DeepSpeed's stage-3 keys, in elements)."""

    prefetch_numel: int = 50_000_000
    max_live_numel: int = 1_000_000_000
    max_reuse_distance: int = 1_000_000_000
    prescale_gradients: bool = False
    gradient_predivide_factor: float = 1.0
    reduce_dtype: torch.dtype | None = None
    external_detection: str = "trace"  # "trace": forwards until the trace is complete; "always"; "off"


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Tensors inside a module's output: tensors, lists/tuples, mappings, dataclass-like objects."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item)
    elif hasattr(obj, "__dataclass_fields__"):
        for name in obj.__dataclass_fields__:
            yield from _tensors(getattr(obj, name, None))


class _ExternalUseMode(TorchFunctionMode):
    """Active during forward: gathers a released managed parameter when a torch op receives it."""

    def __init__(self, coordinator: "Coordinator"):
        super().__init__()
        self.coordinator = coordinator

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        on_use = self.coordinator.on_use
        for a in args:
            if isinstance(a, torch.nn.Parameter):
                on_use(a)
            elif type(a) in (list, tuple):
                for b in a:
                    if isinstance(b, torch.nn.Parameter):
                        on_use(b)
        for a in kwargs.values():
            if isinstance(a, torch.nn.Parameter):
                on_use(a)
        return func(*args, **kwargs)


class Coordinator:
    """Schedules the gathers and releases of `groups` for `root`; `uses[id(m)]` lists the groups
    module `m` needs gathered while its own forward/backward code runs."""

    def __init__(self, root: torch.nn.Module, groups: list[ParamGroup], uses: dict[int, list[ParamGroup]],
                 schedule: Schedule, units: list[torch.nn.Module] | None = None,
                 unit_of: dict[int, torch.nn.Module] | None = None):
        """`units`: the modules that get hooks (default: every module of `root`); `unit_of[id(m)]`:
        the unit module that gathers for module `m` (default: `m` itself)."""
        self.root, self.groups, self.uses, self.schedule = root, groups, uses, schedule
        self.unit_of = unit_of or {}
        for g in groups:
            g.coordinator = self
        self.live_numel = 0
        self._stack: list[torch.nn.Module] = []
        self._mode: _ExternalUseMode | None = None
        self._busy = False
        self._in_backward = False
        self._rerun_depth = 0  # unit forwards of a recomputation now running
        # trace
        self._trace: list[torch.nn.Module] = []
        self._trace_done = False
        self._trace_ok = True
        self._pos = 0
        self._cursor = 0
        self._backward_at = 0  # where the trace's backward part begins
        self._departed = False  # this iteration departed from the trace somewhere
        self._occurrences: dict[int, list[int]] = {}
        self._cum_numel: list[int] = [0]
        # backward
        self._ready: dict[int, int] = {}
        self._reduced: set[int] = set()
        self._pending: deque = deque()
        self._handles = []
        # torch.compiler.disable: a compiled unit (engine.compile) runs its hooks from inside its
        # compiled frame, and torch.compile would otherwise trace them (gathers, collectives, the
        # trace's Python state); disabled, they run eagerly before and after the unit's graph
        pre, post = torch.compiler.disable(self._pre_forward), torch.compiler.disable(self._post_forward)
        # groups that never leave (one rank, param_group.py's Note) need no gathering: no forward hooks,
        # so nothing stands between a compiled whole module and its graph
        self.hooks_forward = not all(g.always_gathered for g in groups)
        for m in (units if units is not None else root.modules()) if self.hooks_forward else ():
            self._handles.append(m.register_forward_pre_hook(pre))
            self._handles.append(m.register_forward_hook(post, always_call=True))
        for g in groups:
            if g.trainable:
                for p in g.params:
                    self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad))

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # ------------------------------------------------------------------ gather / release
    def fetch(self, g: ParamGroup) -> None:
        """Start gathering `g` (no-op when gathered or in flight)."""
        if g.state == RELEASED:
            self.live_numel += g.numel
            g.gather()

    def fetch_now(self, groups) -> None:
        for g in groups:
            self.fetch(g)
        for g in groups:
            g.wait()

    def gather_persistent(self) -> None:
        """DeepSpeed's persistent parameters (`stage3_param_persistence_threshold`) are whole again after a
        step or a load, as after its `_post_step` / `checkpoint_event_epilogue`: their groups are gathered
        (every rank in the same order) and stay so until the next forced release."""
        self.fetch_now([g for g in self.groups if g.persistent and g.state == RELEASED])

    def release(self, g: ParamGroup, force: bool = False, hand_over: bool = False) -> None:
        if g.state == RELEASED or g.always_gathered or (not force and (g.pins > 0 or g.persistent)):
            return
        g.release(hand_over=hand_over)
        self.live_numel -= g.numel

    def release_all(self, force: bool = False) -> None:
        """Release every group not held (also persistent ones with `force`); a held group that must
        stay gathered is refreshed instead, since `force` means its shard changed."""
        for g in self.groups:
            if force and g.pins > 0:
                g.refresh()
            else:
                self.release(g, force=force)

    def release_unheld(self) -> None:
        """Release every gathered group that nothing holds now (no forward, `GatheredParameters` or
        `unshard`), persistent ones included."""
        for g in self.groups:
            if g.pins == 0:
                self.release(g, force=True)

    # ------------------------------------------------------------------ trace
    def _record(self, module: torch.nn.Module) -> None:
        if not self._trace_done:
            self._trace.append(module)
        elif self._trace_ok and (self._pos >= len(self._trace) or self._trace[self._pos] is not module):
            self._trace_ok, self._departed = False, True
            warn_once("ZeRO-3: the module order differs from the first step's; prefetching is off for the rest "
                      "of this forward or backward", logger)
        self._pos += 1

    def _finish_trace(self) -> None:
        if self._trace_done or not self._trace:
            return
        self._occurrences = {}
        self._cum_numel = [0]
        for i, m in enumerate(self._trace):
            groups = self.uses.get(id(m), [])
            for g in groups:
                self._occurrences.setdefault(id(g), []).append(i)
            self._cum_numel.append(self._cum_numel[-1] + sum(g.numel for g in groups))
        self._trace_done = True

    @property
    def trace_complete(self) -> bool:
        """True once a forward+backward has been recorded and later iterations follow it."""
        return self._trace_done

    def restart_trace(self) -> None:
        """Forget the recorded order: the next forward and backward record it again (with the external-use
        detection of a first forward, `detects_external`)."""
        if self._stack or self._in_backward:
            raise RuntimeError("ZeRO-3: the module-order trace cannot be restarted during a forward or backward")
        self._trace, self._trace_done, self._trace_ok, self._departed = [], False, True, False
        self._occurrences, self._cum_numel = {}, [0]

    def holders(self, g: ParamGroup) -> list[torch.nn.Module]:
        """The modules whose forward is running now and holds `g` gathered (innermost last)."""
        return [m for m in self._stack if g in self.uses.get(id(m), ())]

    def gathered_for(self, module: torch.nn.Module) -> tuple[torch.nn.Module, list[ParamGroup]]:
        """The unit that gathers for `module` (itself, or the unit it is inside) and the groups that unit
        gathers around its forward and backward."""
        unit = self.unit_of.get(id(module), module)
        return unit, list(self.uses.get(id(unit), ()))

    def _following(self) -> bool:
        return self._trace_done and self._trace_ok

    def _prefetch(self) -> None:
        if not self._following() or self.schedule.prefetch_numel <= 0:
            return
        budget = min(self.schedule.prefetch_numel, self.schedule.max_live_numel - self.live_numel)
        issued, i = 0, max(self._pos, self._cursor)
        while i < len(self._trace) and issued < budget:
            for g in self.uses.get(id(self._trace[i]), []):
                if g.state == RELEASED:
                    self.fetch(g)
                    issued += g.numel
            i += 1
        self._cursor = i
        # one more prefetch budget ahead, groups only get a read-ahead hint (a parameter shard offloaded
        # to NVMe starts its read, so the gather that follows finds it in host memory)
        hinted = 0
        while i < len(self._trace) and hinted < self.schedule.prefetch_numel:
            for g in self.uses.get(id(self._trace[i]), []):
                g.read_ahead()
                hinted += g.numel
            i += 1

    def _reused_soon(self, g: ParamGroup) -> bool:
        """True when the trace uses `g` again within `max_reuse_distance` elements from here."""
        if not self._following() or self.live_numel > self.schedule.max_live_numel:
            return False
        occ = self._occurrences.get(id(g), [])
        k = bisect.bisect_left(occ, self._pos)
        if k == len(occ):
            return False
        return self._cum_numel[occ[k]] - self._cum_numel[self._pos] < self.schedule.max_reuse_distance

    # ------------------------------------------------------------------ forward hooks
    def recomputing(self) -> bool:
        """True while a forward runs inside a backward (activation checkpointing: the Note on recomputation)."""
        return self._in_backward if _graph_task_id is None else _graph_task_id() != -1

    def _pre_forward(self, module: torch.nn.Module, args) -> None:
        if self._rerun_depth or self.recomputing():
            self._rerun_depth += 1
            groups = self.uses.get(id(module))
            for g in groups or ():
                g.pins += 1
            if groups:
                self.fetch_now(groups)
            return
        if not self._stack:
            self._begin_forward()
        self._stack.append(module)
        self._record(module)  # every module: one may use groups only from its first forward on
        groups = self.uses.get(id(module))
        if groups:
            self._busy = True
            try:
                for g in groups:
                    g.pins += 1
                self.fetch_now(groups)
                self._prefetch()
            finally:
                self._busy = False

    def _post_forward(self, module: torch.nn.Module, args, output) -> None:
        if self._rerun_depth:
            self._rerun_depth -= 1
            self._after_forward(module, output, release=False)
            return
        if self._stack and self._stack[-1] is module:
            self._stack.pop()
        self._after_forward(module, output)
        if not self._stack:
            self._end_forward()

    def _after_forward(self, module: torch.nn.Module, output, release: bool = True) -> None:
        """Unpin the unit's groups, hook its backward, release what the schedule does not keep."""
        groups = self.uses.get(id(module))
        if groups:
            self._busy = True
            try:
                for g in groups:
                    g.pins -= 1
                if torch.is_grad_enabled() and not all(g.always_gathered for g in groups):
                    # (nothing to re-gather before the backward of a unit whose groups never leave)
                    # leaves (a module returning a parameter) would keep the hook across iterations
                    needs_grad = [t for t in _tensors(output) if t.requires_grad and t.grad_fn is not None]
                    if needs_grad:
                        register_multi_grad_hook(needs_grad, lambda _grad, m=module: self._pre_backward(m), mode="any")
                for g in groups if release else ():
                    if g.pins == 0 and not g.persistent and not self._reused_soon(g):
                        self.release(g)
            finally:
                self._busy = False

    def call_as_forward(self, fn, args: tuple, kwargs: dict) -> Any:
        """`fn(*args, **kwargs)` run as a forward of the root (Note: other forward methods): the root's
        forward hooks run around it unless a forward of the root is running already."""
        if not self.hooks_forward or self.root in self._stack:
            return fn(*args, **kwargs)
        self._pre_forward(self.root, args)
        out = None
        try:
            out = fn(*args, **kwargs)
        finally:
            self._post_forward(self.root, args, out)
        return out

    def detects_external(self) -> bool:
        """Whether the next forward runs under the external-use mode (its ops must then run eagerly
        for the mode to see them: torch.compile would trace the mode's Python into the graph)."""
        detect = self.schedule.external_detection
        return self.hooks_forward and (detect == "always" or (detect == "trace" and not self._trace_done))

    def _begin_forward(self) -> None:
        self._pos, self._cursor, self._trace_ok = 0, 0, True
        if not self._trace_done:
            self._trace = []
        if self.detects_external():
            self._mode = _ExternalUseMode(self)
            self._mode.__enter__()

    def _end_forward(self) -> None:
        if self._mode is not None:
            mode, self._mode = self._mode, None
            mode.__exit__(None, None, None)
        if not torch.is_grad_enabled():  # no backward follows: nothing is worth keeping
            self.release_all()

    def on_use(self, param: torch.nn.Parameter) -> None:
        """A parameter reached a torch op during forward: make sure its group is gathered."""
        if self._busy:
            return
        st = param_state(param)
        if st is None or st.group.state == GATHERED:
            return
        g = st.group
        self._busy = True
        try:
            if self._stack:
                user = self._stack[-1]
                used = self.uses.setdefault(id(user), [])
                if g not in used:
                    logger.debug("ZeRO-3: %s uses parameter %s of another module; gathering it with %s from now on",
                                 type(user).__name__, st.name, type(user).__name__)
                    used.append(g)
                    g.pins += 1  # the module's forward hook unpins every group it uses
            self.fetch_now([g])
        finally:
            self._busy = False

    def groups_used_under(self, module: torch.nn.Module) -> list[ParamGroup]:
        """The groups the units in `module`'s subtree gather around their forward and backward (their
        own, tied and external ones), each once."""
        out: list[ParamGroup] = []
        for m in module.modules():
            for g in self.uses.get(id(m), ()):
                if g not in out:
                    out.append(g)
        return out

    def register_external(self, module: torch.nn.Module, groups) -> None:
        module = self.unit_of.get(id(module), module)  # a module inside a unit: its unit gathers
        used = self.uses.setdefault(id(module), [])
        for g in groups:
            if g not in used:
                used.append(g)

    # ------------------------------------------------------------------ backward hooks
    def _pre_backward(self, module: torch.nn.Module) -> None:
        groups = self.uses.get(id(module))
        if groups:
            self._record(module)
            self.fetch_now(groups)
            self._prefetch()

    def _on_grad(self, param: torch.nn.Parameter) -> None:
        st = param_state(param)
        g = st.group
        key = id(g)
        if key in self._reduced:
            # its reduce-scatter has gone: this gradient would be lost. Reentrant activation checkpointing
            # runs one backward per checkpoint, so a parameter used in two checkpoints gets here
            raise RuntimeError(f"ZeRO-3: parameter {st.name} received a gradient after its group was reduced in this "
                               "backward (a parameter used in two reentrant activation checkpoints, or a second "
                               "backward?); use non_reentrant_checkpoint or torch.utils.checkpoint(use_reentrant=False)"
                               " for such layers, and call engine.backward once per micro-step")
        self._ready[key] = self._ready.get(key, 0) + 1
        if self._ready[key] == len(g.params):
            self._reduce(g)
            self.release(g)

    def _reduce(self, g: ParamGroup) -> None:
        s = self.schedule
        self._pending.append(g.reduce_grads(s.prescale_gradients, s.gradient_predivide_factor,
                                            g.comm_dtype or s.reduce_dtype))
        self._reduced.add(id(g))
        while len(self._pending) > MAX_INFLIGHT_REDUCES:
            self._pending.popleft().wait()

    def backward_start(self) -> None:
        self._in_backward = True
        self._rerun_depth = 0
        if self._trace_done:  # a backward follows the trace's backward part, whatever forwards came before
            self._pos = self._cursor = self._backward_at
            self._trace_ok = True
        else:
            self._backward_at = len(self._trace)
        self._ready.clear()
        self._reduced.clear()

    def backward_end(self) -> None:
        """Reduce the groups whose gradients did not all arrive (unused params: zeros), in a fixed
        order so every rank issues the same collectives; wait; release everything not persistent."""
        self._in_backward = False
        for g in self.groups:
            if g.trainable and id(g) not in self._reduced:
                self._reduce(g)
        self.wait_reduces()
        self.release_all()
        self._ready.clear()
        self._reduced.clear()
        if self._trace_done and self._departed:  # the order changed: record it again next iteration
            self._trace_done = False
        else:
            self._finish_trace()
        self._departed = False

    def wait_reduces(self) -> None:
        while self._pending:
            self._pending.popleft().wait()
