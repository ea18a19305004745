"""Where a parameter's fp32 value, gradient and optimizer state live on this rank, whatever the ZeRO
stage, and DeepSpeed's `safe_get_*` / `safe_set_*` functions built on it (`deepspeed.utils` re-exports
them).

Owns: `ParamFragment` (a parameter's elements on this rank, as views into a strategy's buffers), the
registry that finds the strategy managing a parameter, and DeepSpeed's `safe_*` functions. Must not: know how a
stage lays its buffers out (each strategy's `fragment(param)` answers that) or step anything.

Note (semantics, DeepSpeed's): the "full" functions are collectives over the data-parallel group
(every rank must call them with the same parameter) and work at every stage; they return fp32
tensors of the parameter's shape on its device, or None for a parameter no strategy manages. The
fp32 value is the master copy (the parameter itself when training in fp32 without one); a write goes
to the master and to the low-precision parameter. `safe_get_full_grad` assembles the reduced gradient
from the shards at stages 1-3 (stage 1's `param.grad` holds this rank's gradient before the
reduce-scatter, so unlike DeepSpeed it is not returned first, except after a backward that was not an
accumulation boundary, inside `no_sync()` or between micro-steps, where the shards are not current and
this rank's accumulated `param.grad` is returned as DeepSpeed does) and returns `param.grad` at stage 0
(all-reduced in place there at a boundary); like DeepSpeed's it is meaningful between the backward of an accumulation boundary
and `engine.step()`, after which stages 1-3 hold no gradient memory until the next backward (the
gradient functions raise ValueError there, as DeepSpeed's at stages 1-2; zero/grad_buffers.py) and
stage 0 zeroes its gradients; it holds what the strategy holds: averaged over
ranks, and for fp16 still multiplied by the loss scale. The "local" functions are DeepSpeed's ZeRO-3
API: they return views (1-D) of this rank's elements of a stage-3 partitioned parameter (possibly
none: lightspeed partitions a group's flat buffer, not each parameter) and raise for any other
parameter. Optimizer state that does not exist yet (before the first step) or a key the optimizer
does not keep raises ValueError naming the key.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from lightspeed.comm.collectives import Communicator
from lightspeed.zero.partition import Range


@dataclass
class ParamFragment:
    """One parameter's elements on this rank (all tensors 1-D views into the strategy's buffers)."""

    shape: torch.Size
    owned: Range  # this rank's elements of the flattened parameter
    master: torch.Tensor  # the optimizer's (fp32) values of `owned`
    grad: torch.Tensor | None  # the reduced, accumulated gradient of `owned` (None: frozen)
    optimizer_tensor: torch.Tensor | None  # the tensor the optimizer keeps state for
    state_offset: int  # where `owned` starts in `optimizer_tensor` (flattened)
    comm: Communicator | None  # the group over which fragments are spread (None: every rank holds it all)
    lp_full: torch.Tensor | None = None  # the whole low-precision parameter, replicated on every rank
    lp_owned: torch.Tensor | None = None  # the low-precision values of `owned`, when only those are here
    after_write: Callable[[], None] | None = None  # e.g. re-gather a gathered stage-3 group
    local: bool = False  # True for a stage-3 partitioned parameter (the "local" API applies)
    grad_released: bool = False  # between steps: the gradient buffers hold no memory (zero/grad_buffers.py)

    @property
    def numel(self) -> int:
        return self.shape.numel()

    def optimizer_state(self, optimizer, key: str) -> torch.Tensor:
        """The view of `key`'s state for `owned`."""
        state = optimizer.state.get(self.optimizer_tensor) if optimizer is not None else None
        value = state.get(key) if state else None
        if not torch.is_tensor(value) or value.numel() != self.optimizer_tensor.numel():
            known = sorted(k for k, v in (state or {}).items() if torch.is_tensor(v) and v.numel() > 1)
            raise ValueError(f"optimizer state {key!r} not found for this parameter (the optimizer keeps "
                             f"{known or 'no state yet'})")
        return value.view(-1)[self.state_offset:self.state_offset + self.owned.numel]


# id(param) -> the strategy managing it, held weakly (a parameter's id is checked against the
# strategy's own records by its `fragment()`, since an id can be reused after the parameter dies)
_OWNERS: dict[int, "weakref.ref"] = {}


def register(strategy, params: Iterable[torch.nn.Parameter]) -> None:
    """Record that `strategy` (which has `fragment(param)` and `optimizer`) manages `params`."""
    for key in [k for k, ref in _OWNERS.items() if ref() is None]:
        del _OWNERS[key]
    ref = weakref.ref(strategy)
    for p in params:
        _OWNERS[id(p)] = ref


def _locate(param: torch.Tensor):
    ref = _OWNERS.get(id(param))
    strategy = ref() if ref is not None else None
    if strategy is None:
        return None, None
    frag = strategy.fragment(param)  # None when another object now has this id
    return (strategy, frag) if frag is not None else (None, None)


def _locate_trainable(param: torch.Tensor):
    """`_locate`, with a frozen parameter (stage 3 keeps frozen groups; stages 0-2 manage none) answered as
    unmanaged: DeepSpeed's getters return None for it."""
    return _locate(param) if param.requires_grad else (None, None)


def _assemble(frag: ParamFragment, piece: torch.Tensor, device) -> torch.Tensor:
    if frag.comm is None:
        return piece.detach().to(torch.float32, copy=True).view(frag.shape)
    full = torch.zeros(frag.numel, dtype=torch.float32, device=device)
    full[frag.owned.start:frag.owned.end].copy_(piece)
    frag.comm.all_reduce(full)  # the owned ranges of the ranks are disjoint and cover the parameter
    return full.view(frag.shape)


def _device(frag: ParamFragment) -> torch.device:
    return frag.master.device


def safe_get_full_fp32_param(param: torch.nn.Parameter) -> torch.Tensor | None:
    """The parameter's full fp32 value (a collective), or None when no strategy trains it (unmanaged or
    frozen, as DeepSpeed's)."""
    _, frag = _locate_trainable(param)
    return None if frag is None else _assemble(frag, frag.master, _device(frag))


def safe_set_full_fp32_param(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Write `value` (the full parameter) into this rank's fp32 and low-precision copies."""
    _, frag = _locate(param)
    if frag is None:
        return
    flat = value.detach().reshape(-1)
    if flat.numel() != frag.numel:
        raise ValueError(f"safe_set_full_fp32_param: value has {flat.numel()} elements, the parameter "
                         f"{tuple(frag.shape)} has {frag.numel}")
    with torch.no_grad():
        frag.master.copy_(flat[frag.owned.start:frag.owned.end])
        if frag.lp_full is not None:
            frag.lp_full.copy_(value.reshape(frag.lp_full.shape))
        if frag.lp_owned is not None:
            frag.lp_owned.copy_(flat[frag.owned.start:frag.owned.end])
    if frag.after_write is not None:
        frag.after_write()


def safe_get_full_optimizer_state(param: torch.nn.Parameter, optim_state_key: str) -> torch.Tensor | None:
    """The full fp32 optimizer state `optim_state_key` (e.g. "exp_avg") of the parameter (a collective);
    None for a parameter no strategy trains."""
    strategy, frag = _locate_trainable(param)
    if frag is None:
        return None
    return _assemble(frag, frag.optimizer_state(strategy.optimizer, optim_state_key), _device(frag))


def safe_set_full_optimizer_state(param: torch.nn.Parameter, value: torch.Tensor, optim_state_key: str) -> None:
    """Write `value` (the full state of the parameter) into this rank's part of `optim_state_key`."""
    strategy, frag = _locate(param)
    if frag is None:
        return
    flat = value.detach().reshape(-1)
    with torch.no_grad():
        frag.optimizer_state(strategy.optimizer, optim_state_key).copy_(flat[frag.owned.start:frag.owned.end])


def _require_grads(frag: ParamFragment | None, name: str) -> None:
    if frag is not None and frag.grad_released:
        raise ValueError(f"{name}: gradients exist only between the backward of an accumulation boundary and "
                         "engine.step() (ZeRO stages 1-3 release them at the step, as DeepSpeed does)")


def safe_get_full_grad(param: torch.nn.Parameter) -> torch.Tensor | None:
    """`param.grad` when set, else the reduced gradient assembled from the shards (a collective)."""
    strategy, frag = _locate(param)
    _require_grads(frag, "safe_get_full_grad")
    if strategy is not None:
        strategy.wait_gradients()  # a reduction of the boundary may still be in flight
    if frag is not None and frag.comm is not None and frag.grad is not None and \
            not strategy.gradients_unreduced():
        return _assemble(frag, frag.grad, _device(frag))  # partitioned: `.grad` (stage 1) is not reduced yet
    if param.grad is not None:
        return param.grad
    if frag is None or frag.grad is None:
        return None
    return _assemble(frag, frag.grad, _device(frag))


def safe_set_full_grad(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Write `value` (the full reduced gradient, as `safe_get_full_grad` gives it) into this rank's part of
    the gradient the step will read; between the boundary backward and `engine.step()`."""
    strategy, frag = _locate(param)
    _require_grads(frag, "safe_set_full_grad")
    if frag is None or frag.grad is None:
        return
    strategy.wait_gradients()  # an in-flight reduction would land on top of the value
    flat = value.detach().reshape(-1)
    if flat.numel() != frag.numel:
        raise ValueError(f"safe_set_full_grad: value has {flat.numel()} elements, the parameter "
                         f"{tuple(frag.shape)} has {frag.numel}")
    with torch.no_grad():
        frag.grad.copy_(flat[frag.owned.start:frag.owned.end])


def safe_update_full_grad_vectorized(param_list: Iterable[torch.nn.Parameter], update_func: Callable) -> None:
    """DeepSpeed's: replace the full gradient `g` of each parameter `p` of `param_list` by `update_func(g, p)`
    (`g` as `safe_get_full_grad` gives it; the result written as `safe_set_full_grad` writes). A parameter
    no strategy manages has its `.grad` updated in place; one without a gradient is left alone. A
    collective, as the two functions: every rank passes the same parameters in the same order."""
    for p in param_list:
        _, frag = _locate(p)
        if frag is None:  # not an engine's parameter: its .grad is its gradient (DeepSpeed's first case)
            if p.grad is not None:
                with torch.no_grad():
                    p.grad.copy_(update_func(p.grad, p))
            continue
        grad = safe_get_full_grad(p)
        if grad is not None:
            safe_set_full_grad(p, update_func(grad, p))


def _local(param, name: str) -> tuple[Any, ParamFragment]:
    strategy, frag = _locate(param)
    if frag is None or not frag.local:
        raise ValueError(f"{name}: only defined for ZeRO-3 partitioned parameters (as in DeepSpeed)")
    return strategy, frag


def safe_get_local_fp32_param(param: torch.nn.Parameter) -> torch.Tensor | None:
    """This rank's elements of a ZeRO-3 parameter's fp32 value (1-D view; may be empty); None when frozen."""
    frag = _local(param, "safe_get_local_fp32_param")[1]
    return frag.master if param.requires_grad else None


def safe_get_local_grad(param: torch.nn.Parameter) -> torch.Tensor | None:
    """This rank's elements of a ZeRO-3 parameter's reduced gradient (1-D view; may be empty)."""
    strategy, frag = _local(param, "safe_get_local_grad")
    _require_grads(frag, "safe_get_local_grad")
    strategy.wait_gradients()
    return frag.grad


def safe_get_local_optimizer_state(param: torch.nn.Parameter, optim_state_key: str) -> torch.Tensor:
    """This rank's elements of a ZeRO-3 parameter's optimizer state `optim_state_key` (1-D view); None when
    frozen."""
    strategy, frag = _local(param, "safe_get_local_optimizer_state")
    return frag.optimizer_state(strategy.optimizer, optim_state_key) if param.requires_grad else None


def safe_set_local_fp32_param(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Write this rank's elements of a ZeRO-3 parameter's fp32 value (and its low-precision copy)."""
    _, frag = _local(param, "safe_set_local_fp32_param")
    with torch.no_grad():
        frag.master.copy_(value.detach().reshape(-1))
        if frag.lp_owned is not None:
            frag.lp_owned.copy_(value.detach().reshape(-1))
    if frag.after_write is not None:
        frag.after_write()


def safe_set_local_grad(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Write this rank's elements of a ZeRO-3 parameter's reduced gradient."""
    strategy, frag = _local(param, "safe_set_local_grad")
    strategy.wait_gradients()
    if frag.grad is not None:
        with torch.no_grad():
            frag.grad.copy_(value.detach().reshape(-1))


def safe_set_local_optimizer_state(param: torch.nn.Parameter, value: torch.Tensor, optim_state_key: str) -> None:
    """Write this rank's elements of a ZeRO-3 parameter's optimizer state `optim_state_key`."""
    strategy, frag = _local(param, "safe_set_local_optimizer_state")
    with torch.no_grad():
        frag.optimizer_state(strategy.optimizer, optim_state_key).copy_(value.detach().reshape(-1))


__all__ = ["ParamFragment", "register", "safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
           "safe_get_local_fp32_param", "safe_get_local_grad", "safe_get_local_optimizer_state",
           "safe_set_full_fp32_param", "safe_set_full_grad", "safe_set_full_optimizer_state",
           "safe_set_local_fp32_param", "safe_set_local_grad", "safe_set_local_optimizer_state",
           "safe_update_full_grad_vectorized"]
