"""`ZeroParameter`: the class of a stage-3 partitioned parameter, whose DeepSpeed attributes (`ds_id`,
`ds_numel`, `ds_shape`, `ds_status`, `ds_tensor`, `ds_persist`) are read from its `ParamState`.

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
"""

from __future__ import annotations

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


def as_zero_parameter(param: torch.nn.Parameter) -> None:
    """Give `param` (a plain `nn.Parameter`) the `ZeroParameter` class in place; other classes are kept."""
    if type(param) is not torch.nn.Parameter:
        return
    if weakref.getweakrefcount(param):  # swap_tensors refuses tensors with weak references
        warn_once("ZeRO-3: a parameter with weak references to it keeps its class; its ds_* attributes are "
                  "unavailable", logger)
        return
    torch.utils.swap_tensors(param, ZeroParameter(param.data, requires_grad=param.requires_grad))
