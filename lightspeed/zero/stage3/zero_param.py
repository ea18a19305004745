"""`ZeroParameter`: the class of a stage-3 partitioned parameter, whose DeepSpeed attributes (`ds_id`,
`ds_numel`, `ds_shape`, `ds_status`, `ds_tensor`, `ds_persist`, `ds_active_sub_modules`) are read from
its `ParamState`.

Owns: that class, `ZeroParamStatus` (DeepSpeed's enum) and `as_zero_parameter`, which gives an existing
parameter the class. Must not: hold any state of its own (the per-parameter state object is the one
source of truth; see `param_group.param_state`).

Note (why a subclass and not attributes): DeepSpeed sticks a dozen `ds_*` attributes on every
partitioned parameter, and code written for it reads them (transformers counts parameters with
`p.ds_numel`, TRL reads `ds_status` / `ds_id`). Here they are read-only properties of a
`torch.nn.Parameter` subclass that look the parameter's `ParamState` up, so nothing is stored on the
parameter and the answers follow the state (gathered or released, the group it moved to). A stage-3
group gives each plain `nn.Parameter` it manages this class in place (`torch.utils.swap_tensors`:
the same Python object, so optimizers, tied modules and hooks keep referring to it); `zero.Init`
creates its parameters with it. Parameter subclasses of other libraries are left as they are (their
`ds_*` attributes are then absent, as for a parameter no strategy manages: `hasattr` is False).
The class adds no behaviour to tensor operations: `nn.Parameter` disables `__torch_function__`, so
every op on it returns a plain tensor.

Note (active sub-modules): DeepSpeed's `ds_active_sub_modules` is the set of modules that gathered the
parameter for their forward and have not released it yet; TRL clears it on every parameter before
generation so that no stale claim keeps a parameter gathered. Here a module holds its unit's groups
from its forward pre-hook to its forward hook, which runs also when the forward raises
(`always_call`), so outside a running forward no module holds anything: the view is empty and
`clear()` has nothing to drop. Inside a forward, `clear()` is refused rather than letting go of
parameters that forward still reads.
"""

from __future__ import annotations

import collections.abc
import enum
import weakref

import torch

from lightspeed._utils.logging import get_logger, warn_once

logger = get_logger(__name__)


class ZeroParamStatus(enum.Enum):
    """DeepSpeed's names and values: where a partitioned parameter's full value is."""

    AVAILABLE = 1  # gathered: `param.data` is the full value
    NOT_AVAILABLE = 2  # released: `param.data` is an empty placeholder
    INFLIGHT = 3  # being gathered


def _state(param: "ZeroParameter"):
    from lightspeed.zero.stage3.param_group import param_state  # param_group imports this module

    st = param_state(param)
    if st is None:
        raise AttributeError("this parameter is not partitioned by ZeRO stage 3 (no stage-3 state)")
    return st


class ZeroParameter(torch.nn.Parameter):
    """A parameter partitioned by ZeRO stage 3 (see the Note of this module)."""

    @property
    def ds_id(self) -> int:
        return _state(self).ds_id

    @property
    def ds_numel(self) -> int:
        return _state(self).numel

    @property
    def ds_shape(self) -> torch.Size:
        return torch.Size(_state(self).shape)

    @property
    def ds_status(self) -> ZeroParamStatus:
        from lightspeed.zero.stage3.param_group import GATHERED, INFLIGHT

        state = _state(self).group.state
        if state == GATHERED:
            return ZeroParamStatus.AVAILABLE
        return ZeroParamStatus.INFLIGHT if state == INFLIGHT else ZeroParamStatus.NOT_AVAILABLE

    @property
    def ds_tensor(self) -> torch.Tensor:
        """This rank's elements of the parameter (1-D, a view of the group's lp shard; may be empty)."""
        st = _state(self)
        own = st.group.local(st.range)
        return st.group.lp_shard[own.start:own.end]

    @property
    def ds_persist(self) -> bool:
        return bool(_state(self).group.persistent)

    @property
    def ds_active_sub_modules(self) -> "ActiveSubModules":
        """The modules whose forward is running now and holds this parameter gathered (Note: active
        sub-modules)."""
        return ActiveSubModules(_state(self).group)


class ActiveSubModules(collections.abc.Set):
    """DeepSpeed's `param.ds_active_sub_modules`, read from the coordinator: the `id()` of each module
    whose forward is running now and holds the parameter's group gathered (DeepSpeed keeps its modules'
    `ds_id`; lightspeed numbers no modules). A live view, not a copy: it follows the forwards."""

    def __init__(self, group):
        self._group = group

    def _ids(self) -> list[int]:
        return [id(m) for m in self._group.coordinator.holders(self._group)]

    def __contains__(self, item) -> bool:
        return item in self._ids()

    def __iter__(self):
        return iter(self._ids())

    def __len__(self) -> int:
        return len(self._ids())

    def clear(self) -> None:
        """Drop the modules' holds: there is nothing to drop outside a running forward (see the Note);
        refused inside one, whose parameters must stay gathered until its forward hook lets them go."""
        held = self._group.coordinator.holders(self._group)
        if held:
            raise RuntimeError(f"ZeRO-3: the parameters of group {self._group.name} are held by the running "
                               f"forward of {', '.join(type(m).__name__ for m in held)}; they cannot be let go "
                               "before it returns")


def as_zero_parameter(param: torch.nn.Parameter) -> None:
    """Give `param` (a plain `nn.Parameter`) the `ZeroParameter` class in place; other classes are kept."""
    if type(param) is not torch.nn.Parameter:
        return
    if weakref.getweakrefcount(param):  # swap_tensors refuses tensors with weak references
        warn_once("ZeRO-3: a parameter with weak references to it keeps its class; its ds_* attributes are "
                  "unavailable", logger)
        return
    torch.utils.swap_tensors(param, ZeroParameter(param.data, requires_grad=param.requires_grad))
