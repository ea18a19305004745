"""ParamGroup, the unit of communication of ZeRO stage 3, and ParamState, one parameter's place in it.

A group is the parameters of one unit (a module's subtree, see `units.py`) that share
`requires_grad` (see the Note in `strategy.py` for the granularity). They are laid end to end in one
flat buffer padded to a multiple of the data-parallel world size; rank r keeps only its range of it:

    lp_shard          [padded/W] param dtype     this rank's low-precision params (always allocated)
    master_shard      [padded/W] fp32 or None    fp32 master (trainable groups with lp params only)
    grad_shard        [padded/W] grad_accum      reduced, accumulated gradients (trainable groups)
    master_grad_shard [padded/W] fp32            what the optimizer reads (is grad_shard when fp32 or fused)
    full_flat         [padded]   param dtype     the gathered buffer; its storage exists only while
                                                 the group is gathered

Owns: gathering (all-gather into `full_flat`, pointing each `param.data` at its view), releasing
(`param.data` back to an empty placeholder and the storage of `full_flat` freed), the gradient
reduce-scatter into `grad_shard`, and copying values in and out of shards. Must not: decide *when*
to gather or release (the coordinator does), or know about the optimizer.

Note (why the storage is freed, not just `param.data` swapped): autograd saves views of parameters
(`F.linear` saves `weight.t()`), which keep the buffer they view alive. Swapping `param.data` alone
would leave every gathered buffer alive until its backward, i.e. the whole model gathered at the peak.
Freeing the storage of `full_flat` (resize to 0) releases the memory under those saved views; the
backward re-gathers into the same storage object, so the saved views read the right values again.
Consequence: a tensor derived from a parameter in forward (e.g. `p.detach()`) must not be read after
the group is released; the pre-backward hooks re-gather before any module's backward.
"""

from __future__ import annotations

import weakref
from typing import Any, Sequence

import torch

from lightspeed._utils.flat import FlatLayout, flat_views
from lightspeed.comm.codecs import Collectives
from lightspeed.comm.collectives import Communicator
from lightspeed.zero.partition import Range, shard_range

RELEASED, INFLIGHT, GATHERED = "released", "inflight", "gathered"

# id(param) -> ParamState. Values are weak: an entry lives exactly as long as its strategy's groups.
# ParamState holds its parameter strongly, so the id cannot be reused while the entry exists.
_REGISTRY: "weakref.WeakValueDictionary[int, ParamState]" = weakref.WeakValueDictionary()


def param_state(param: torch.Tensor) -> "ParamState | None":
    """The stage-3 state of `param`, or None when no stage-3 strategy manages it."""
    state = _REGISTRY.get(id(param))
    return state if state is not None and state.param is param else None


class ParamState:
    """Where one parameter lives: its logical shape, its group and its element range in the group."""

    __slots__ = ("param", "name", "shape", "group", "index", "__weakref__")

    def __init__(self, param: torch.nn.Parameter, name: str, group: "ParamGroup", index: int):
        self.param, self.name, self.group, self.index = param, name, group, index
        self.shape = group.layout.shapes[index]

    @property
    def range(self) -> Range:
        """Elements of the group's flat buffer holding this parameter."""
        return Range(*self.group.layout.range_of(self.index))

    @property
    def numel(self) -> int:
        return self.range.numel


def reduce_scaling(prescale: bool, predivide: float, world_size: int) -> tuple[float, float]:
    """DeepSpeed's averaging: factors applied to gradients before and after the sum over ranks."""
    if prescale:
        return (1.0 / world_size if world_size > 1 else 1.0), 1.0
    return 1.0 / predivide, (predivide / world_size if predivide != world_size else 1.0)


class PendingGrad:
    """An in-flight reduce-scatter of one group's gradients; `wait()` adds the result to the shard."""

    def __init__(self, handle, out: torch.Tensor, send: torch.Tensor, post_scale: float, dest: torch.Tensor):
        self.handle, self.out, self.send, self.post_scale, self.dest = handle, out, send, post_scale, dest

    def wait(self) -> None:
        self.handle.wait()
        if self.post_scale != 1.0:
            self.out.mul_(self.post_scale)
        self.dest.add_(self.out)
        self.send = self.out = None


class ParamGroup:
    """The parameters of one unit (one `requires_grad` value), sharded over the data-parallel group."""

    def __init__(self, name: str, params: Sequence[torch.nn.Parameter], names: Sequence[str],
                 values: Sequence[torch.Tensor], comm: Communicator, *, dtype: torch.dtype, device: torch.device,
                 grad_dtype: torch.dtype, keep_master: bool, stream: Any = None, fp32_grad_copy: bool = True,
                 collectives: Collectives | None = None):
        """`values[i]` holds the full value of `params[i]` (any dtype/device). Every rank passes its own
        values and rank 0's win (broadcast), so all ranks start identical. `fp32_grad_copy=False` (the
        fused optimizer step reads low-precision gradients itself) skips the fp32 gradient shard."""
        self.name, self.comm, self.dtype, self.device, self.stream = name, comm, dtype, device, stream
        self.collectives = collectives or Collectives.default(comm)
        self.params = list(params)
        self.trainable = self.params[0].requires_grad
        assert all(p.requires_grad == self.trainable for p in self.params)
        self.layout = FlatLayout.build([tuple(v.shape) for v in values], comm.world_size)
        self.shard = shard_range(self.layout.padded_numel, comm.world_size, comm.rank)
        full = torch.zeros(self.layout.padded_numel, dtype=dtype, device=device)
        for view, value in zip(flat_views(full, self.layout), values):
            view.copy_(value.detach())
        comm.broadcast(full, src=0)
        self.lp_shard = full[self.shard.start:self.shard.end].clone()
        self.full_flat = full  # from now on the gather buffer; its storage is freed below
        self.views = flat_views(full, self.layout)
        self._nbytes = full.untyped_storage().nbytes()
        self.placeholder = torch.empty(0, dtype=dtype, device=device)
        self.states = [ParamState(p, n, self, i) for i, (p, n) in enumerate(zip(self.params, names))]
        for st in self.states:
            _REGISTRY[id(st.param)] = st
        self.state = GATHERED
        self._handle = None
        self.pins = 0  # holders that need the group gathered now (active forwards, GatheredParameters)
        self.persistent = False
        self.coordinator: Any = None  # set by the coordinator that schedules this group
        self.release()
        self.master_shard = self.lp_shard.float() if keep_master and self.trainable and dtype != torch.float32 else None
        self.grad_shard = torch.zeros_like(self.lp_shard, dtype=grad_dtype) if self.trainable else None
        if self.grad_shard is not None and self.master_shard is not None and grad_dtype != torch.float32 \
                and fp32_grad_copy:
            self.master_grad_shard = torch.zeros_like(self.lp_shard, dtype=torch.float32)
        else:
            self.master_grad_shard = self.grad_shard

    # ------------------------------------------------------------------ sizes
    @property
    def numel(self) -> int:
        """Elements of the gathered (padded) buffer."""
        return self.layout.padded_numel

    @property
    def shard_numel(self) -> int:
        return self.shard.numel

    @property
    def optimizer_shard(self) -> torch.Tensor:
        """The shard the optimizer steps: the fp32 master, or the lp shard when params are fp32."""
        return self.master_shard if self.master_shard is not None else self.lp_shard

    def local(self, r: Range) -> Range:
        """The part of flat range `r` this rank owns, in shard coordinates."""
        return r.intersect(self.shard).shift(-self.shard.start)

    # ------------------------------------------------------------------ gather / release
    def gather(self) -> None:
        """Start the all-gather (asynchronous where the backend allows); `wait()` finishes it."""
        if self.state != RELEASED:
            return
        self.full_flat.untyped_storage().resize_(self._nbytes)  # allocated on the current stream
        if self.stream is not None:
            self.stream.wait_current()  # outside the context: the side stream waits for the compute stream
            with self.stream.context():
                self._handle = self.collectives.all_gather(self.full_flat, self.lp_shard, async_op=True)
        else:
            self._handle = self.collectives.all_gather(self.full_flat, self.lp_shard, async_op=True)
        self.state = INFLIGHT

    def wait(self) -> None:
        if self.state == RELEASED:
            self.gather()
        if self.state == INFLIGHT:
            self._handle.wait()
            self._handle = None
            if self.stream is not None:
                self.stream.make_current_wait()
            self.state = GATHERED  # before touching .data: a torch-function mode may look at it
            for p, view in zip(self.params, self.views):
                p.data = view

    def release(self) -> None:
        if self.state == RELEASED:
            return
        if self.state == INFLIGHT:
            self.wait()
        for p in self.params:
            p.data = self.placeholder
        self.full_flat.untyped_storage().resize_(0)
        self.state = RELEASED

    def refresh(self) -> None:
        """Re-gather a gathered group after its lp shard changed (no-op when released)."""
        if self.state != RELEASED:
            self.wait()
            self.collectives.all_gather(self.full_flat, self.lp_shard)

    # ------------------------------------------------------------------ gradients
    def reduce_grads(self, prescale: bool, predivide: float, reduce_dtype: torch.dtype | None) -> PendingGrad:
        """Move the parameters' `.grad` into a padded flat buffer, average it over ranks by
        reduce-scatter, and (on `wait()`) add this rank's part to `grad_shard`. Params without a
        gradient contribute zeros; every `.grad` is set to None."""
        dtype = reduce_dtype or self.grad_shard.dtype
        send = torch.zeros(self.layout.padded_numel, dtype=dtype, device=self.device)
        for p, view in zip(self.params, flat_views(send, self.layout)):
            if p.grad is not None:
                view.copy_(p.grad)
                p.grad = None
        pre, post = reduce_scaling(prescale, predivide, self.comm.world_size)
        if pre != 1.0:
            send.mul_(pre)
        out = send.new_empty(self.shard_numel)
        handle = self.collectives.reduce_scatter(out, send, async_op=True)
        return PendingGrad(handle, out, send, post, self.grad_shard)

    # ------------------------------------------------------------------ values in and out
    def load_param(self, index: int, value: torch.Tensor) -> None:
        """Write this rank's part of parameter `index` (full value `value`) into the lp shard."""
        r = Range(*self.layout.range_of(index))
        own = self.local(r)
        if own.numel:
            src_start = own.start + self.shard.start - r.start
            flat = value.detach().reshape(-1)
            self.lp_shard[own.start:own.end].copy_(flat[src_start:src_start + own.numel])

    def copy_master_to_lp(self) -> None:
        if self.master_shard is not None:
            self.lp_shard.copy_(self.master_shard)

    def copy_lp_to_master(self) -> None:
        if self.master_shard is not None:
            self.master_shard.copy_(self.lp_shard)

    def nbytes(self) -> dict[str, int]:
        """This rank's bytes of this group, by memory_breakdown category."""
        def size(t):
            return t.numel() * t.element_size() if t is not None else 0

        out = {"lp_params": size(self.lp_shard) + (self._nbytes if self.state != RELEASED else 0)}
        if self.master_shard is not None:
            out["master_params"] = size(self.master_shard)
        if self.grad_shard is not None:
            extra = size(self.master_grad_shard) if self.master_grad_shard is not self.grad_shard else 0
            out["grads"] = size(self.grad_shard) + extra
        return out
