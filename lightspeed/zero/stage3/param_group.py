"""ParamGroup, the unit of communication of ZeRO stage 3, and ParamState, one parameter's place in it.

A group is the parameters of one unit (a module's subtree, see `units.py`) that share
`requires_grad` (see the Note in `strategy.py` for the granularity). They are laid end to end in one
flat buffer padded to a multiple of the data-parallel world size; rank r keeps only its range of it:

    lp_shard          [padded/W] param dtype     this rank's low-precision params (always allocated)
    master_shard      [padded/W] fp32 or None    fp32 master (trainable groups with lp params only)
    grad_shard        [padded/W] grad_accum      reduced, accumulated gradients (trainable groups)
    master_grad_shard [padded/W] optimizer dtype what the optimizer reads (is grad_shard when of its dtype, or fused)
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

Note (values taken inside GatheredParameters): DeepSpeed releases a parameter by pointing `param.data`
at an empty tensor, so a tensor taken from it inside `GatheredParameters` (`v = p.data`, and on the CPU
`p.data.cpu()`, which is `p.data` itself) keeps its values after the block; DeepSpeed-Chat's
`save_zero_three_model` saves such tensors. A group that the end of a `GatheredParameters` block
releases therefore hands its gathered storage over (`release(hand_over=True)`): the storage lives on
while something references it, and the group gathers into a new one next time. Releases in forward
and backward free the storage in place (the Note above).

Note (one rank): with a data-parallel world of one the shard is the whole buffer, so `full_flat` is
`lp_shard` itself: the parameters view it from set-up on (`always_gathered`), gathering and releasing
do nothing and an update of the shard is already what the module computes with. When every group
is so, the coordinator registers no forward hooks and `engine.compile()` takes the whole module. Not
with the parameters offloaded (the shard is in host memory) or a shard stored in another form (ZeRO++).

Note (ZeRO++): what goes on the wire is not decided here. Each group gathers through its own
`ParamGather` (`comm/codecs.py`), made by the strategy's `Collectives` (int8 payloads for qwZ, hpZ's
secondary shard kept inside it), reduce-scatters through `collectives.reduce_scatter` (qgZ's
hierarchical int4 one), and keeps its lp shard in the form `collectives.store_shard` gives (a frozen
group's `QuantizedShard` under `zero_quantized_nontrainable_weights`). Whatever writes the lp shard
calls `shard_changed()`, so the hpZ secondary shard is made afresh by the next gather.

Note (offload, `OffloadPolicy`): with the optimizer offloaded, `master_shard` and `master_grad_shard`
are host fp32 buffers (for fp32 parameters too: the device keeps `lp_shard`, the host the master).
With the parameters offloaded, `lp_shard` is a host buffer: a gather copies it to the device (on the
side stream, so a prefetched group's copy runs under compute) and all-gathers that copy; without an
offloaded optimizer the master then stays on the device (for fp32 parameters too), where the optimizer
steps it. On NVMe the host `lp_shard` may be swapped out between steps (`swapper`): a gather reads it
back first.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any, Sequence

import torch

from lightspeed._utils.flat import FlatLayout, flat_views
from lightspeed.comm.codecs import Collectives
from lightspeed.comm.collectives import Communicator
from lightspeed.offload.policy import OffloadPolicy
from lightspeed.ops.lowp_writer import LowpWriter
from lightspeed.zero.grad_buffers import GradBuffers
from lightspeed.zero.partition import Range, shard_range
from lightspeed.zero.reduce import mean_scaling
from lightspeed.zero.stage3.zero_param import as_zero_parameter

RELEASED, INFLIGHT, GATHERED = "released", "inflight", "gathered"

# id(param) -> ParamState. Values are weak: an entry lives exactly as long as its strategy's groups.
# ParamState holds its parameter strongly, so the id cannot be reused while the entry exists.
_REGISTRY: "weakref.WeakValueDictionary[int, ParamState]" = weakref.WeakValueDictionary()
_DS_IDS = itertools.count()  # DeepSpeed's ds_id: a number per partitioned parameter, kept when it changes group


def param_state(param: torch.Tensor) -> "ParamState | None":
    """The stage-3 state of `param`, or None when no stage-3 strategy manages it."""
    state = _REGISTRY.get(id(param))
    return state if state is not None and state.param is param else None


class ParamState:
    """Where one parameter lives: its logical shape, its group and its element range in the group."""

    __slots__ = ("param", "name", "shape", "group", "index", "ds_id", "__weakref__")

    def __init__(self, param: torch.nn.Parameter, name: str, group: "ParamGroup", index: int):
        previous = param_state(param)
        self.param, self.name, self.group, self.index = param, name, group, index
        self.shape = group.layout.shapes[index]
        self.ds_id = previous.ds_id if previous is not None else next(_DS_IDS)

    @property
    def range(self) -> Range:
        """Elements of the group's flat buffer holding this parameter."""
        return Range(*self.group.layout.range_of(self.index))

    @property
    def numel(self) -> int:
        return self.range.numel


class PendingGrad:
    """An in-flight reduce-scatter of one group's gradients; `wait()` adds the result to the shard
    and, with `to_host` = (copy stream, host buffer, callback or None), copies the shard there on that
    stream, then calls the callback (the copy is queued, not done)."""

    def __init__(self, handle, out: torch.Tensor, send: torch.Tensor, post_scale: float, dest: torch.Tensor,
                 to_host: tuple[Any, torch.Tensor, Any] | None = None):
        self.handle, self.out, self.send, self.post_scale, self.dest = handle, out, send, post_scale, dest
        self.to_host = to_host

    def wait(self) -> None:
        if self.handle is not None:  # None: one rank, the gradients were added to `dest` already
            self.handle.wait()
            if self.post_scale != 1.0:
                self.out.mul_(self.post_scale)
            self.dest.add_(self.out)
        self.send = self.out = None
        if self.to_host is not None:
            stream, host, queued = self.to_host
            stream.wait_current()
            with stream.context():
                host.copy_(self.dest, non_blocking=True)
            if queued is not None:
                queued()


class ParamGroup:
    """The parameters of one unit (one `requires_grad` value), sharded over the data-parallel group."""

    def __init__(self, name: str, params: Sequence[torch.nn.Parameter], names: Sequence[str],
                 values: Sequence[torch.Tensor], comm: Communicator, *, dtype: torch.dtype, device: torch.device,
                 grad_dtype: torch.dtype, keep_master: bool, stream: Any = None, fp32_grad_copy: bool = True,
                 offload: OffloadPolicy | None = None, with_grads: bool = True,
                 collectives: Collectives | None = None, one_rank_views: bool = False,
                 master_dtype: torch.dtype = torch.float32):
        """`values[i]` holds the full value of `params[i]` (any dtype/device). Every rank passes its own
        values and rank 0's win (broadcast), so all ranks start identical. `fp32_grad_copy=False` (the
        fused optimizer step reads low-precision gradients itself) skips the fp32 gradient shard;
        `with_grads=False` (a group that only stores values, as `zero.Init`'s) has no gradient shard.
        `one_rank_views`: at a data-parallel world of one, the parameters view the shard (Note: one rank).
        `master_dtype`: of a host master (optimizer offload; bf16/fp16 with low-precision masters)."""
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
        self.offload = offload = offload if offload is not None else OffloadPolicy()
        if offload.offloads_params:  # a swapped shard frees and re-allocates its storage: never pinned
            self.lp_shard = offload.host_copy(full[self.shard.start:self.shard.end], dtype, device,
                                              pin=offload.param_pin_memory and offload.param != "nvme")
        else:  # the collectives say in what form the shard is kept (ZeRO++ keeps frozen weights int8)
            self.lp_shard = self.collectives.store_shard(full[self.shard.start:self.shard.end].clone(), self.trainable)
        self._gather = self.collectives.param_gather(self.trainable)  # this group's all-gathers (hpZ state)
        self.swapper: Any = None  # NVMe parameter offload: reads `lp_shard` back before a gather
        # optimizer offload, at the accumulation boundary: the copy stream on which each completed
        # reduction of this group is copied to `master_grad_shard` (set by the strategy)
        self.grads_to_host: Any = None
        self.comm_dtype: torch.dtype | None = None  # torch_autocast: the dtype its gradients are reduced in
        self.on_host_queued: Any = None  # called once this step's copy of the gradients to the host is queued
        # one rank (Note: one rank): the shard is the whole buffer and the parameters view it
        self.always_gathered = (one_rank_views and comm.world_size == 1 and not offload.offloads_params
                                and type(self.lp_shard) is torch.Tensor and self.lp_shard.device == full.device)
        if self.always_gathered:
            full = self.lp_shard
        self.full_flat = full  # from now on the gather buffer; its storage is freed below
        self.views = flat_views(full, self.layout)
        self._nbytes = full.untyped_storage().nbytes()
        self.placeholder = torch.empty(0, dtype=dtype, device=device)
        for p in self.params:
            as_zero_parameter(p)
        self.states = [ParamState(p, n, self, i) for i, (p, n) in enumerate(zip(self.params, names))]
        for st in self.states:
            _REGISTRY[id(st.param)] = st
        self.state = GATHERED
        self._handle = None
        self.pins = 0  # holders that need the group gathered now (active forwards, GatheredParameters)
        self.persistent = False
        self.coordinator: Any = None  # set by the coordinator that schedules this group
        self.release()
        if self.always_gathered:
            for p, view in zip(self.params, self.views):
                p.data = view
        n = self.shard_numel
        host_master = offload.offloads_optimizer and self.trainable
        if host_master:
            pin = offload.optimizer_pin_memory and offload.optimizer != "nvme"
            self.master_shard = offload.host_copy(self.lp_shard, master_dtype, device, pin=pin)
        elif self.trainable and ((keep_master and dtype != torch.float32) or (offload.offloads_params and with_grads)):
            self.master_shard = self.lp_shard.to(device=device, dtype=torch.float32, copy=True)
        else:
            self.master_shard = None
        self.grad_shard = torch.zeros(n, dtype=grad_dtype, device=device) if self.trainable and with_grads else None
        if host_master:
            self.master_grad_shard = offload.host_empty(n, master_dtype, device, pin=offload.optimizer_pin_memory)
            self.master_grad_shard.zero_()
        elif self.grad_shard is not None and grad_dtype != self.optimizer_shard.dtype and fp32_grad_copy:
            # the optimizer reads gradients in its tensor's dtype: fp32 for an fp32 master or fp32
            # parameters (with another data_types.grad_accum_dtype), bf16 for bf16 masters
            self.master_grad_shard = torch.zeros(n, dtype=self.optimizer_shard.dtype, device=device)
        else:
            self.master_grad_shard = self.grad_shard
        # the device gradients hold memory from this group's first reduction of a step to the step's
        # end (zero/grad_buffers.py; the strategy releases them); host gradients stay
        self.grad_buffers = GradBuffers([self.grad_shard] + ([] if host_master else [self.master_grad_shard]))

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
                self._handle = self._gather(self.full_flat, self._device_shard(), async_op=True)
        else:
            self._handle = self._gather(self.full_flat, self._device_shard(), async_op=True)
        self.state = INFLIGHT

    def _device_shard(self) -> torch.Tensor:
        """The lp shard on the device, for the all-gather: itself, or (parameter offload) a copy of
        the host shard, read from NVMe first when it is swapped out."""
        if not self.offload.offloads_params:
            return self.lp_shard
        self.lp_in()
        if self.device.type == "cpu":  # the host is the device: a separate buffer, the same mover
            return self.lp_shard.clone()
        return self.lp_shard.to(self.device, non_blocking=True)

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

    def release(self, hand_over: bool = False) -> None:
        """Point the parameters at the placeholder and free the gathered storage; with `hand_over`
        (Note: values taken inside GatheredParameters) the gathered storage is left to whatever still
        references it and the next gather fills a new one."""
        if self.state == RELEASED or self.always_gathered:
            return
        if self.state == INFLIGHT:
            self.wait()
        for p in self.params:
            p.data = self.placeholder
        if hand_over:
            fresh = torch.empty(0, dtype=self.full_flat.dtype, device=self.full_flat.device)
            fresh.set_(torch.UntypedStorage(0, device=self.full_flat.device), 0, self.full_flat.shape)
            self.full_flat, self.views = fresh, flat_views(fresh, self.layout)
        else:
            self.full_flat.untyped_storage().resize_(0)
        self.state = RELEASED
        self.lp_out()

    def lp_in(self) -> None:
        """NVMe parameter offload: make sure the host lp shard holds its values."""
        if self.swapper is not None:
            self.swapper.ensure_in(self.lp_shard)

    def read_ahead(self) -> None:
        """A hint that the group will be gathered soon: NVMe parameter offload starts reading its shard."""
        if self.swapper is not None and self.state == RELEASED:
            self.swapper.prefetch(self.lp_shard)

    def lp_out(self) -> None:
        """NVMe parameter offload: free the host lp shard of a released group (written when changed)."""
        if self.swapper is not None and self.state == RELEASED:
            self.swapper.swap_out(self.lp_shard, dirty=False)

    def _lp_written(self) -> None:
        if self.swapper is not None:
            self.swapper.mark_dirty(self.lp_shard)
            self.lp_out()

    def discard(self) -> None:
        """Free this group's storage; parameters another group now manages (a stage-3 strategy taking
        over `zero.Init`'s groups) are left alone, the others get the empty placeholder."""
        for p, st in zip(self.params, self.states):
            if param_state(p) is st:
                p.data = self.placeholder
        self.full_flat.untyped_storage().resize_(0)
        self.lp_shard = torch.empty(0, dtype=self.dtype, device=self.lp_shard.device)
        self._gather.shard_changed()
        self.state = RELEASED
        self._handle = None

    def refresh(self) -> None:
        """Re-gather a gathered group after its lp shard changed (released: the next gather reads it)."""
        self.shard_changed()
        if self.state != RELEASED and not self.always_gathered:  # the parameters view the shard itself
            self.wait()
            self._gather(self.full_flat, self._device_shard()).wait()

    def shard_changed(self) -> None:
        """The lp shard was written: copies made from it (hpZ's secondary shard) are stale."""
        self._gather.shard_changed()

    # ------------------------------------------------------------------ gradients
    def reduce_grads(self, prescale: bool, predivide: float, reduce_dtype: torch.dtype | None) -> PendingGrad:
        """Move the parameters' `.grad` into a padded flat buffer, average it over ranks by
        reduce-scatter, and (on `wait()`) add this rank's part to `grad_shard`. Params without a
        gradient contribute zeros; every `.grad` is set to None. With one rank the shard is the whole
        buffer: the gradients are added to it directly (no buffer to send, no collective)."""
        self.grad_buffers.ensure()
        to_host = (self.grads_to_host, self.master_grad_shard, self.on_host_queued) \
            if self.grads_to_host is not None else None
        if self.comm.world_size == 1:
            for p, view in zip(self.params, flat_views(self.grad_shard, self.layout)):
                if p.grad is not None:
                    view.add_(p.grad)
                    p.grad = None
            return PendingGrad(None, None, None, 1.0, self.grad_shard, to_host)
        dtype = reduce_dtype or self.grad_shard.dtype
        send = torch.zeros(self.layout.padded_numel, dtype=dtype, device=self.device)
        for p, view in zip(self.params, flat_views(send, self.layout)):
            if p.grad is not None:
                view.copy_(p.grad)
                p.grad = None
        # the mean over the whole group, sp ranks included: `sp_summed(3, sp)` is 1 (zero/reduce.py's Note)
        pre, post = mean_scaling(prescale, predivide, self.comm.world_size)
        if pre != 1.0:
            send.mul_(pre)
        out = send.new_empty(self.shard_numel)
        handle = self.collectives.reduce_scatter(out, send, async_op=True)
        return PendingGrad(handle, out, send, post, self.grad_shard, to_host)

    # ------------------------------------------------------------------ values in and out
    def load_param(self, index: int, value: torch.Tensor) -> None:
        """Write this rank's part of parameter `index` (full value `value`) into the lp shard."""
        r = Range(*self.layout.range_of(index))
        own = self.local(r)
        if own.numel:
            src_start = own.start + self.shard.start - r.start
            flat = value.detach().reshape(-1)
            self.lp_in()
            self.lp_shard[own.start:own.end] = flat[src_start:src_start + own.numel]  # a quantized shard re-quantizes
            self._lp_written()
            self.shard_changed()

    def copy_master_to_lp(self, writer: LowpWriter | None = None) -> None:
        """The lp shard from the master (a fp32 run without masters stepped or loaded the lp shard itself:
        either way it may have changed). A master in host memory with the lp shard on the device goes
        through `writer`'s staged copies when given (ops/lowp_writer.py)."""
        self.shard_changed()
        if self.master_shard is not None:
            self.lp_in()
            if writer is not None and self.master_shard.device != self.lp_shard.device:
                writer.write(self.master_shard, 0, self.master_shard.numel(), [(0, self.lp_shard)])
                writer.finish()
            else:
                self.lp_shard.copy_(self.master_shard)
            self._lp_written()

    def copy_lp_to_master(self) -> None:
        if self.master_shard is not None:
            self.lp_in()
            self.master_shard.copy_(self.lp_shard)
            self.lp_out()

    def add_to(self, tally) -> None:
        """Count this group's bytes into a `MemoryTally`, each tensor where it lives (the tally's
        `locate` places swapped tensors on "nvme"); the gathered buffer counts while it is held."""
        if isinstance(self.lp_shard, torch.Tensor):
            tally.add_tensor("lp_params", self.lp_shard)
        else:  # a stored quantized shard
            tally.add(self.device, "lp_params", self.lp_shard.nbytes)
        tally.add(self.device, "lp_params", self._gather.secondary_bytes)
        if self.state != RELEASED and not self.always_gathered:  # one rank: the shard is the gathered buffer
            tally.add(self.device, "lp_params", self._nbytes)
        if self.master_shard is not None:
            tally.add_tensor("master_params", self.master_shard)
        if self.grad_shard is not None:
            tally.add_tensor("grads", self.grad_shard)
            if self.master_grad_shard is not self.grad_shard:
                tally.add_tensor("grads", self.master_grad_shard)
