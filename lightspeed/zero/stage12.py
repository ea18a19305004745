"""ZeRO stages 1 and 2: the fp32 master parameters and the optimizer state exist only as each rank's
shard; stage 2 also keeps only the shard of the gradients.

Owns: the per-(optimizer group, dtype) flat buffers with their owned shards, gradient
reduce-scatter bucket by bucket, the sharded step (overflow flag and grad norm agreed across ranks),
and the all-gather of the updated low-precision parameters. Must not: touch the loss scaler or the
LR schedule.

Note (what lives where): a rank owns the r-th chunk of every bucket of a flat buffer
(`partition.plan_flat`); its shard is those chunks end to end. Stage 1 accumulates whole gradients in
`grad_flat` (like stage 0) and reduce-scatters them at the accumulation boundary; stage 2 has no
`grad_flat`: each micro-step's gradients are copied into a per-bucket staging buffer that is
reduce-scattered as soon as the bucket is complete and freed, the result accumulating in the shard.
The optimizer steps one fp32 tensor per flat buffer (the master shard), so optimizers that treat each
element independently (Adam, AdamW, Adagrad, Lion, SGD) give the unsharded results exactly.

Note (one rank): with a data-parallel world of one the shard is the whole flat buffer, so there is
nothing to reduce and nowhere else for gradients to go: both stages let autograd accumulate into
`grad_flat` (the parameters' `.grad` are its views, as stage 1's), which is the shard's `grad`, and
skip the reduce-scatter, the stage-2 staging and the copy into the shard. What a single-GPU ZeRO-2
run then holds is one gradient buffer, as DeepSpeed's, without a staging bucket. Where the master is
in the parameters' own dtype (fp32 training, or bf16 params with `bf16_master_weights_and_grads`) and
in device memory, the master shard is the flat parameter buffer itself (`Shard.aliased`), as stage 3's
low-precision shard is: the optimizer steps the parameters in place and no copy of them is kept (2
bytes a parameter less with bf16 masters; DeepSpeed keeps the copy). The values are those a separate
master would hold, bit for bit.

DeepSpeed's keys: `reduce_bucket_size` and `allgather_bucket_size` both bound the layout bucket (the
unit of reduce-scatter and all-gather); `overlap_comm` false waits on each reduction as soon as it
is launched (true lets it run under the rest of backward: NCCL runs it on its own stream);
`contiguous_gradients` is always the case (gradients live in flat buffers); `round_robin_gradients`
only reorders gradient copies for CPU offload in DeepSpeed and changes nothing here.

Note (optimizer offload, `OffloadPolicy`): the master shard and the optimizer state live in host
memory (pinned with `pin_memory` on CUDA), `master_grad` is a host fp32 buffer, and the optimizer is a
CPU one (the config's Adam becomes CPUAdam, as DeepSpeed's DeepSpeedCPUAdam). At the accumulation
boundary each bucket's reduced chunk is finished and copied to `master_grad` on a copy stream as soon
as its reduce-scatter is launched (the copy stream, not the compute stream, waits for the collective,
so backward goes on). The step's overflow check and norm read the device-side reduced shard; the CPU
optimizer takes the fused call (zero/optimizers.py): it applies the unscale/clip coefficient in its
kernel and copies each stepped piece into the device's lp chunks while it steps the next, before the
all-gather. With `overlap_step` the CPU step runs in the background (see `offload/overlap.py`). On
NVMe each stepped master shard (with its optimizer state) is a sub-group swapped out between steps
and stepped one at a time (`offload/swapped_step.py`); its update is all-gathered before it goes out.

Note (low-precision masters): with ``bf16.bf16_master_weights_and_grads`` and
``bf16.bf16_optimizer_states`` the master shard, the gradients the optimizer reads and the optimizer
state are bf16 (DeepSpeed's DeepSpeedZeroOptimizer keeps its master partition in
``master_weights_and_grads_dtype``): 2 bytes of master and 4 of Adam state per parameter instead of
4 and 8. The master shard stays a tensor of its own (as DeepSpeed's), so the step is unchanged: the
fused kernels compute in fp32 and round the master, the state and the lp chunks once each.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from lightspeed._utils.device import Stream
from lightspeed.comm.codecs import Collectives
from lightspeed.comm.collectives import Communicator
from lightspeed.offload.nvme import NvmeSwapper
from lightspeed.ops.lowp_writer import LowpWriter
from lightspeed.offload.policy import OffloadPolicy
from lightspeed.offload.swapped_step import SubGroup, SwappedOptimizerState
from lightspeed.zero import param_access
from lightspeed.precision.policy import PrecisionPolicy
from lightspeed.zero.buckets import Bucket, GradBuckets
from lightspeed.zero.flat_params import FlatParams
from lightspeed.zero.grad_buffers import GradBuffers
from lightspeed.zero.fragments import Fragment, module_shapes, first_names, fragments_state_dict, range_fragments
from lightspeed.zero.partition import Range, owned_chunks
from lightspeed.zero.reduce import PendingReduce, PendingToHost, ReduceOptions
from lightspeed.zero.memory import MemoryTally
from lightspeed.zero.optimizers import check_optimizer, fused_step, low_precision_masters
from lightspeed.comm.topology import dims_of
from lightspeed.zero.norm import NormPlan, device_side
from lightspeed.zero.reduce_groups import ReduceGroups
from lightspeed.zero.graphed_step import GraphedStep
from lightspeed.zero.sharded_step import ShardViews, StepResult
from lightspeed.zero.step_runner import StepRunner
from lightspeed.zero.zenflow import ZenFlowShard, ZenFlowStep
from lightspeed.zero.stage0 import WholeParameters, broadcast_unflattened

MAX_INFLIGHT_REDUCES = 2  # stage 2: reductions in flight at once (each holds a bucket-sized staging buffer)
# optimizer offload: the largest layout bucket. The bucket sizes are upper bounds (DeepSpeed: they limit
# the memory of a reduction); DeepSpeed's default of 5e8 elements makes a GPT-2-medium one bucket, so
# its copy to the host could only start when backward ends (the offloaded forward + backward took
# 75.1 ms against 48.1 without offload, 355M on one H200, 2026-12-02, benchmarks/offload.py --phases)
OFFLOAD_BUCKET_NUMEL = 1 << 25
ONE_RANK_MASTER_ALIAS = True  # Note: one rank (a module constant so tests can compare with a separate master)

@dataclass
class Shard:
    """One flat buffer and this rank's part of it."""

    flat: FlatParams
    chunks: list[tuple[Range, int]]  # (flat-buffer range, start in the shard) per bucket
    master: torch.Tensor  # fp32 (or the low-precision master dtype) [shard_numel]: the tensor the optimizer steps
    grad: torch.Tensor  # grad_accum dtype [shard_numel]: reduced gradients
    master_grad: torch.Tensor  # `grad` in the master dtype for the optimizer (a copy when the dtypes differ)
    stepped: bool  # False for trainable params outside every optimizer group
    collectives: Collectives  # the group its gradients are reduced and its state partitioned over
    reduce: ReduceOptions  # how its gradients are reduced (the reduce dtype is the shard's, with torch_autocast)
    aliased: bool = False  # `master` is the lp buffer itself (Note: one rank), nothing to copy between them

    def chunk_pairs(self):
        """(flat-buffer slice, shard slice) per bucket."""
        for r, pos in self.chunks:
            yield slice(r.start, r.end), slice(pos, pos + r.numel)


class ShardedStrategy(WholeParameters):
    """ZeRO stage 1 (`stage=1`) or 2 (`stage=2`) over `comm`'s data-parallel group."""

    state_is_replicated = False
    gather_16bit_weights_on_model_save = True  # whole low-precision parameters on every rank: nothing to gather

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer | None, policy: PrecisionPolicy,
                 comm: Communicator, reduce: ReduceOptions, *, stage: int, allow_untested_optimizer: bool = False,
                 offload: OffloadPolicy | None = None, collectives: Collectives | None = None,
                 reduce_groups: ReduceGroups | None = None, comm_dtypes: dict[int, torch.dtype] | None = None,
                 graphed_step: bool = False):
        """`comm_dtypes` (torch_autocast, precision/autocast.py): id(param) -> the dtype its gradient is
        reduced in; when given, every parameter not in it is reduced in its own dtype. `graphed_step`:
        optimizer.cuda_graph (zero/graphed_step.py)."""
        assert stage in (1, 2)
        check_optimizer(optimizer, allow_untested_optimizer, stage)
        self.offload = offload if offload is not None else OffloadPolicy()
        host = self.offload.offloads_optimizer
        if self.offload.offloads_params:
            raise ValueError("offload_param needs ZeRO stage 3")
        # fused ZeRO step: the optimizer applies the unscale/clip coefficient and writes the lp chunks
        # itself; on the device it reads the reduced (low-precision) gradient shard (no fp32 gradient
        # copy), in host memory the host copies (zero/optimizers.py)
        self._fused = fused_step(optimizer, self.offload)
        master_dtype = low_precision_masters(policy, optimizer, self.offload, comm.rank)
        self.stage, self.module, self.optimizer, self.policy, self.comm, self.reduce = (
            stage, module, optimizer, policy, comm, reduce)
        self.collectives = collectives or Collectives.default(comm)
        # each shard holds parameters of one reduce group (zero/reduce_groups.py), over its own collectives
        self.reduce_groups = reduce_groups or ReduceGroups.single(self.collectives)
        self._lowp_writer = LowpWriter()  # host masters -> device parameters, outside the fused step
        # one rank (Note: one rank): gradients accumulate in the flat buffer, which is the shard
        self._solo = comm.world_size == 1 and all(c.world_size == 1 for c in self.reduce_groups.by_key.values())
        self._in_flat = stage == 1 or self._solo
        names = {id(p): n for n, p in module.named_parameters()}
        self.shards: list[Shard] = []
        self._shard_of: dict[int, Shard] = {}
        for group_index, params in self._param_groups(module, optimizer):
            by_dtype: dict[tuple, list[torch.nn.Parameter]] = {}  # (dtype, reduce dtype) -> params
            for p in params:
                comm_dtype = comm_dtypes.get(id(p), p.dtype) if comm_dtypes is not None else None
                by_dtype.setdefault((p.dtype, comm_dtype), []).append(p)
            for comm_dtype, key, dtype_params in [(cd, k, kp) for (_, cd), ps in by_dtype.items()
                                                  for k, kp in self.reduce_groups.split(ps)]:
                shard_reduce = reduce if comm_dtype is None else dataclasses.replace(reduce, reduce_dtype=comm_dtype)
                shard_collectives = self.reduce_groups.for_key(key)
                world, rank = shard_collectives.world_size, shard_collectives.rank
                # a layout bucket is both the reduce-scatter and the all-gather unit: bound it by both sizes
                bucket_numel = min(reduce.bucket_numel, reduce.allgather_bucket_numel) or max(
                    reduce.bucket_numel, reduce.allgather_bucket_numel)
                if host:  # the copies to the host go bucket by bucket: small enough to run under backward
                    bucket_numel = min(bucket_numel or OFFLOAD_BUCKET_NUMEL, OFFLOAD_BUCKET_NUMEL)
                flat = FlatParams(dtype_params, policy.grad_accum_dtype, keep_master=False,
                                  bucket_numel=bucket_numel, world_size=world,
                                  names=[names[id(p)] for p in dtype_params], full_grads=self._in_flat)
                chunks = owned_chunks(flat.buckets, world, rank)
                numel = flat.layout.padded_numel // world
                grad = flat.grad_flat if self._solo else torch.zeros(numel, dtype=policy.grad_accum_dtype,
                                                                     device=flat.device)
                aliased = False
                if host:
                    pin = self.offload.optimizer_pin_memory
                    # a swapped master frees and re-allocates its storage: never pinned
                    master = self.offload.host_empty(numel, master_dtype, flat.device,
                                                     pin=pin and self.offload.optimizer != "nvme")
                    master_grad = self.offload.host_empty(numel, master_dtype, flat.device, pin=pin).zero_()
                else:  # fp32, or the master dtype of bf16/fp16_master_weights_and_grads (Note: low-precision masters)
                    aliased = (ONE_RANK_MASTER_ALIAS and world == 1 and master_dtype == flat.lp_flat.dtype
                               and flat.lp_flat.numel() == numel
                               and all(pos == r.start for r, pos in chunks))
                    master = flat.lp_flat if aliased else torch.empty(numel, dtype=master_dtype, device=flat.device)
                    copy = grad.dtype != master_dtype and not self._fused
                    master_grad = torch.zeros_like(grad, dtype=master_dtype) if copy else grad
                shard = Shard(flat, chunks, master, grad, master_grad, stepped=group_index is not None,
                              collectives=shard_collectives, reduce=shard_reduce, aliased=aliased)
                self._copy_params_to_master(shard)
                self.shards.append(shard)
                for p in dtype_params:
                    self._shard_of[id(p)] = shard
                if group_index is not None:
                    optimizer.param_groups[group_index].setdefault("_shards", []).append(master)
        if optimizer is not None:
            for group in optimizer.param_groups:
                frozen = [p for p in group["params"] if id(p) not in self._shard_of]
                group["params"] = group.pop("_shards", []) + frozen
        self._staging: dict[int, torch.Tensor] = {}  # stage 2: bucket index -> staged gradients
        # stage 2: at most MAX_INFLIGHT_REDUCES staging buffers alive (not every bucket's until the step)
        self.buckets = GradBuckets([s.flat for s in self.shards], self._launch,
                                   max_inflight=None if self._in_flat else MAX_INFLIGHT_REDUCES)
        # GradBuckets numbers the buckets flat by flat, plan by plan: the same order as the chunks
        self._targets = [(s, r, pos) for s in self.shards for r, pos in s.chunks]
        self._boundary = True
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for s in self.shards for p in s.flat.params]
        # fused step: what the optimizer reads and writes besides the master shards, built once
        stepped = [s for s in self.shards if s.stepped]
        self._views = ShardViews(
            optimizer, self._fused, grads=[s.grad for s in self.shards],
            master_grads=[s.master_grad for s in self.shards],
            opt_grads={s.master: s.master_grad for s in stepped},
            lowp_out={s.master: [(sh.start, s.flat.lp_flat[fl]) for fl, sh in s.chunk_pairs()]
                      for s in stepped if not s.aliased},
            device=self.shards[0].grad.device if self.shards else torch.device("cpu"),
            norm_grads=[s.grad for s in self.shards] if host else None,
            graphed=GraphedStep(optimizer) if graphed_step else None,
            host_copies=self.offload.zenflow is None)  # ZenFlow accumulates on the device (zero/zenflow.py)
        swap: SwappedOptimizerState | None = None
        if self.offload.optimizer == "nvme":
            swapper = NvmeSwapper(self.offload.optimizer_nvme_path, self.offload.aio,
                                  key="zero_optimization.offload_optimizer.nvme_path", name="optimizer")
            swapper.require_space(sum(s.master.numel() * 4 * 3 for s in stepped))  # master + two Adam moments
            swap = SwappedOptimizerState(
                swapper, optimizer, [SubGroup(f"shard{i}", [s.master], [s.master]) for i, s in enumerate(stepped)],
                buffer_count=self.offload.optimizer_buffer_count)
            swap.all_out()
        # early device-to-host gradient copies; not with overlap_step, whose background step still
        # reads `master_grad` while the next backward runs, nor with ZenFlow
        to_host = (Stream(self._views.device) if host and not self.offload.overlap_step and self.offload.zenflow is None
                   else None)
        zenflow = self._zenflow(stepped) if self.offload.zenflow is not None else None
        self._runner = StepRunner(self._views, self.collectives.all_reduce, write_back=self._write_back,
                                  to_host=to_host, swap=swap, overlap=self.offload.overlap_step,
                                  overlap_warmup=self.offload.overlap_step_warmup,
                                  write_sub_group=lambda i: self._all_gather_params(stepped[i]),
                                  copied_early=[s.master_grad for s in self.shards], early_ranges=zenflow is None,
                                  zenflow=zenflow,
                                  speculative=self.offload.super_offload, rollback=self.offload.super_offload_rollback)
        param_access.register(self, self._shard_of_params())
        # device gradient buffers hold memory from a backward's first gradient to the step (zero/grad_buffers.py)
        self._grads = GradBuffers([t for s in self.shards for t in (s.flat.grad_flat, s.grad)
                                   + (() if host else (s.master_grad,))], on_release=self._unset_param_grads)
        self._grads.kept = graphed_step  # the captured step reads fixed addresses
        self._grads.release()

    def _zenflow(self, stepped: list[Shard]) -> ZenFlowStep:
        """ZenFlow's view of the stepped shards: each parameter's pieces in them (zero/zenflow.py)."""
        group_of = {id(t): g for g in self.optimizer.param_groups for t in g["params"]}
        shards = []
        for s in stepped:
            pieces = []
            for i, p in enumerate(s.flat.params):
                r = s.flat.param_range(i)
                for chunk, pos in s.chunks:
                    part = r.intersect(chunk)
                    if part.numel:
                        pieces.append((i, tuple(p.shape), part.start - r.start, part.end - r.start,
                                       pos + part.start - chunk.start))
            shards.append(ZenFlowShard(s.master, s.master_grad, s.grad, s.flat.lp_flat, list(s.chunks), pieces,
                                       s.collectives.all_reduce if s.collectives.world_size > 1 else None,
                                       weights=[(i, tuple(p.shape)) for i, p in enumerate(s.flat.params)],
                                       group=group_of[id(s.master)]))
        return ZenFlowStep(self.offload.zenflow, self._views, shards, self.collectives.all_reduce, self._write_back)

    def set_steps_per_epoch(self, n: int) -> None:
        """The training dataloader's length (ZenFlow's "epoch" selection counts in it)."""
        if self._runner.zenflow is not None:
            self._runner.zenflow.set_steps_per_epoch(n)

    def _unset_param_grads(self) -> None:
        """`param.grad` are views of `grad_flat`: unset them before its storage goes (the next
        backward's first gradient sets them again, `_on_grad`)."""
        for s in self.shards:
            for p in s.flat.params:
                p.grad = None

    def _shard_of_params(self):
        return [p for s in self.shards for p in s.flat.params]

    def fragment(self, param: torch.nn.Parameter) -> param_access.ParamFragment | None:
        """Where `param`'s values live: this rank's chunk of its bucket (see `zero/param_access.py`)."""
        shard = self._shard_of.get(id(param))
        i = shard.flat.index.get(id(param)) if shard is not None else None
        if i is None or shard.flat.params[i] is not param:
            return None
        r = shard.flat.param_range(i)
        owned, start = Range(0, 0), 0
        for chunk, pos in shard.chunks:
            inter = r.intersect(chunk)
            if inter.numel:
                owned, start = inter.shift(-r.start), pos + inter.start - chunk.start
                break
        end = start + owned.numel
        return param_access.ParamFragment(shape=param.shape, owned=owned, master=shard.master[start:end],
                                  grad=None if self._grads.released else shard.grad[start:end],
                                  grad_released=self._grads.released,
                                  optimizer_tensor=shard.master, state_offset=start,
                                  comm=shard.collectives.comm, lp_full=shard.flat.lp_views[i])

    @staticmethod
    def _param_groups(module: torch.nn.Module, optimizer):
        """(optimizer group index or None, trainable params) in a deterministic order."""
        trainable = [p for p in module.parameters() if p.requires_grad]
        seen: set[int] = set()
        groups = []
        if optimizer is not None:
            if optimizer.state:
                raise ValueError("the optimizer already has state; pass a freshly constructed optimizer to initialize()")
            wanted = {id(p) for p in trainable}
            for i, group in enumerate(optimizer.param_groups):
                params = [p for p in group["params"] if id(p) in wanted and id(p) not in seen]
                seen.update(id(p) for p in params)
                if params:
                    groups.append((i, params))
        rest = [p for p in trainable if id(p) not in seen]
        if rest:
            groups.append((None, rest))
        return groups

    # ---------------------------------------------------------------- parameters
    def _copy_params_to_master(self, shard: Shard) -> None:
        if shard.aliased:
            return
        for flat_slice, shard_slice in shard.chunk_pairs():
            shard.master[shard_slice].copy_(shard.flat.lp_flat[flat_slice])

    def _all_gather_params(self, shard: Shard, copy: bool = True) -> None:
        """Write the master shard into this rank's chunks of the lp buffer (unless the fused step has
        written them: `copy=False`), then all-gather each bucket."""
        flat = shard.flat
        if copy and not shard.aliased:
            for flat_slice, shard_slice in shard.chunk_pairs():
                if shard.master.device == flat.lp_flat.device:
                    flat.lp_flat[flat_slice].copy_(shard.master[shard_slice])
                else:  # a host master (offload): staged copies, cast on the device (ops/lowp_writer.py)
                    self._lowp_writer.write(shard.master, shard_slice.start, shard_slice.stop,
                                            [(shard_slice.start, flat.lp_flat[flat_slice])])
            self._lowp_writer.finish()
        for (flat_slice, shard_slice), bucket in zip(shard.chunk_pairs(), flat.buckets):
            out = flat.lp_flat[bucket.start:bucket.start + bucket.padded_numel]
            # gloo may not accept an input that aliases the output; NCCL handles in-place all-gather
            chunk = flat.lp_flat[flat_slice]
            shard.collectives.all_gather(out, chunk if chunk.is_cuda else chunk.clone())

    def broadcast_from_rank0(self, module: torch.nn.Module) -> None:
        self._masters_in()
        for s in self.shards:
            s.collectives.comm.broadcast(s.flat.lp_flat, src=0)
            self._copy_params_to_master(s)
        self._masters_out()
        broadcast_unflattened(self.comm, module, self.reduce_groups)

    def _masters_in(self) -> None:
        self._runner.masters_in()

    def _masters_out(self) -> None:
        self._runner.masters_out()

    # ---------------------------------------------------------------- backward
    def backward_start(self, is_boundary: bool) -> None:
        self._boundary = is_boundary
        self._runner.backward_start(is_boundary)
        if is_boundary or not self._in_flat:
            self.buckets.reset()

    def _on_grad(self, param: torch.nn.Parameter) -> None:
        self._grads.ensure()  # the first gradient of this backward: the buffers come back, zeroed
        shard = self._shard_of[id(param)]
        flat, i = shard.flat, shard.flat.index[id(param)]
        grad = param.grad
        if self._in_flat:
            view = flat.grad_views[i]
            if grad is None or grad.data_ptr() != view.data_ptr():
                if grad is not None:
                    view.add_(grad)
                param.grad = view if flat.grads_alias_autograd else None
            if self._boundary:
                self.buckets.mark_ready(param)
            return
        bucket, _ = self.buckets.where[id(param)]
        staging = self._staging.get(bucket.index)
        if staging is None:  # zeros: parameters without a gradient this step contribute nothing
            dtype = shard.reduce.reduce_dtype or self.policy.grad_accum_dtype
            staging = self._staging[bucket.index] = torch.zeros(bucket.numel, dtype=dtype, device=flat.device)
        start = flat.layout.offsets[i] - bucket.start
        staging[start:start + param.numel()].view(param.shape).copy_(grad)
        param.grad = None
        self.buckets.mark_ready(param)

    def _launch(self, bucket: Bucket) -> PendingReduce:
        shard, chunk, pos = self._targets[bucket.index]
        world = shard.collectives.world_size
        if self._solo:  # nothing to reduce: the bucket's gradients are already this rank's shard
            pending = PendingReduce(None, bucket.grad, bucket.grad, 1.0)
            if self._boundary and self._runner.to_host is not None:
                pending = PendingToHost(pending, bucket.grad, shard.master_grad[pos:pos + chunk.numel],
                                        self._runner.to_host)
                pending.wait()  # queued on the copy stream: the compute stream goes on
                self._runner.host_copy_queued(shard.master, pos, pos + chunk.numel)
            return pending
        if self.stage == 1:
            send, post = shard.reduce.prepare(bucket.grad, world)
        else:
            staged = self._staging.pop(bucket.index, None)
            if staged is None:
                staged = torch.zeros(bucket.numel, dtype=shard.reduce.reduce_dtype or self.policy.grad_accum_dtype,
                                     device=bucket.flat.device)
            send, post = shard.reduce.prepare(staged, world)
        offset = chunk.start - bucket.start
        if self.stage == 2 and send.is_cuda and offset == shard.collectives.rank * chunk.numel:
            # NCCL's in-place reduce-scatter (output = this rank's chunk of the input): the staging
            # buffer is temporary, so no second bucket-sized buffer is needed
            out = send.narrow(0, offset, chunk.numel)
        else:  # gloo may not accept an output aliasing the input; stage 1 sends grad_flat itself
            out = torch.empty(chunk.numel, dtype=send.dtype, device=send.device)
        handle = shard.collectives.reduce_scatter(out, send, async_op=True)
        pending = PendingReduce(handle, out, shard.grad[pos:pos + chunk.numel], post, accumulate=True)
        if self._boundary and self._runner.to_host is not None:
            dev = shard.grad[pos:pos + chunk.numel]
            pending = PendingToHost(pending, dev, shard.master_grad[pos:pos + chunk.numel], self._runner.to_host)
            pending.wait()  # queued on the copy stream: the compute stream goes on
            self._runner.host_copy_queued(shard.master, pos, pos + chunk.numel)
            return pending
        if not self.reduce.overlap_comm:
            pending.wait()
        return pending

    def backward_end(self) -> None:
        self._grads.ensure()  # a backward that reached no parameter still has (zero) gradients to reduce
        if self._boundary or not self._in_flat:
            self.buckets.flush()
        if not self._in_flat and not self._boundary:
            self.buckets.wait()  # gradients of this micro-step are in the shard; staging is freed

    def wait_gradients(self) -> None:
        self.buckets.wait()

    def gradients_unreduced(self) -> bool:
        """Stage 1 after a backward that was not an accumulation boundary (gradient accumulation, or
        inside `no_sync()`): the parameters' `.grad` hold this rank's accumulated gradients, which the
        shards do not have yet (stage 2 reduces every micro-step)."""
        return self._in_flat and not self._boundary

    # ---------------------------------------------------------------- step
    def step(self, loss_scale: float | None, max_norm: float, check_overflow: bool | None = None) -> StepResult:
        self.buckets.wait()
        self._grads.ensure()  # a step without a backward reads zero gradients
        return self._runner.step(loss_scale, max_norm, check_overflow)

    def _write_back(self) -> None:
        for s in self.shards:
            if s.stepped:
                self._all_gather_params(s, copy=not self._views.optimizer_writes_lowp)

    def note_loss_scale(self, loss_scale: float | None) -> None:
        """The loss scale of the coming backward (the speculative offloaded step unscales with it)."""
        self._runner.note_loss_scale(loss_scale)

    def flush(self) -> None:
        """Finish an overlapped step still running and write its update into the parameters."""
        self._runner.flush()

    def zero_grad(self) -> None:
        self._runner.zero_grad()
        self._grads.release()  # zero until the next backward's first gradient brings them back

    def use_placements(self, placements, topology) -> None:
        """Count the gradient norm over the mesh as `placements` say (zero/norm.py); this rank's
        fragments are disjoint over the group the strategy partitions over (dp x sp)."""
        v = self._views
        with self._grads.allocated():  # the norm's views are cut from the gradient buffers
            grads = device_side(v.opt_grads, v.master_grads, v.norm_grads)
            v.norm = NormPlan.build(self.fragments(), grads, placements, topology, self._partition_dims())

    def _partition_dims(self):
        """The mesh dims each parameter's fragments are disjoint over: its reduce group's (by name)."""
        keyed = {name: self.reduce_groups.key(p) for name, p in self.module.named_parameters()}
        return lambda name: keyed.get(name) or dims_of("dp_sp")

    # ---------------------------------------------------------------- state
    def fragments(self) -> list[Fragment]:
        """The parts of each parameter inside this rank's chunks, owned by the flat master shard."""
        self.flush()
        self._masters_in()  # NVMe: the fragments' owners are read (saved) or written (loaded) next
        names = first_names(self.module)
        out: list[Fragment] = []
        for s in self.shards:
            pieces = [(r, s.master, pos) for r, pos in s.chunks]
            for i, p in enumerate(s.flat.params):
                out.extend(range_fragments(names[id(p)], tuple(p.shape), s.flat.param_range(i), pieces))
        return out

    def state_dict(self) -> dict[str, Any]:
        state = fragments_state_dict(self.fragments(), self.optimizer, stage=self.stage,
                                     dp_world_size=self.comm.world_size, dp_rank=self.comm.rank)
        return self._runner.merge_state(state)

    def masters_loaded(self) -> None:
        self._runner.masters_replaced()  # before the flush: the loaded masters replace the device part too
        self.flush()
        self._masters_in()
        for s in self.shards:
            self._all_gather_params(s)
        self._masters_out()

    def masters_from_params(self) -> None:
        self.flush()
        self._masters_in()
        for s in self.shards:
            self._copy_params_to_master(s)
        self._runner.masters_replaced()
        self._masters_out()

    def module_shapes(self) -> dict[str, tuple[int, ...]]:
        return module_shapes(self.module)

    def module_state_dict(self) -> dict[str, Any]:
        self.flush()
        return self.module.state_dict()

    def load_module_state_dict(self, state: dict[str, Any], strict: bool = True) -> None:
        self.module.load_state_dict(state, strict=strict)

    def compile_regions(self) -> list[torch.nn.Module]:
        """The modules `engine.compile()` compiles in place: the whole module (the gradient hooks sit on
        the parameters and run from autograd, outside any compiled graph)."""
        return [self.module]

    def after_compile(self, regions: list[torch.nn.Module]) -> None:
        pass  # the whole module is one region: nothing to join

    def needs_eager_forward(self) -> bool:
        return False

    def remove_hooks(self) -> None:
        """Finish the reductions and an overlapped step in flight, then remove the gradient hooks
        (engine.destroy). Buckets not launched stay so: without a backward there is nothing to reduce
        (and the gradient buffers may be released)."""
        self.buckets.wait_launched()
        self.flush()
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def memory_breakdown(self) -> dict[str, dict[str, int]]:
        tally = MemoryTally(self._runner.swap_location)
        for s in self.shards:
            tally.add_tensor("lp_params", s.flat.lp_flat)
            if not s.aliased:
                tally.add_tensor("master_params", s.master)
            tally.add_tensor("grads", s.grad)
            if s.master_grad is not s.grad:
                tally.add_tensor("grads", s.master_grad)
            if s.flat.grad_flat is not None and s.flat.grad_flat is not s.grad:
                tally.add_tensor("grads", s.flat.grad_flat)
        if self._runner.zenflow is not None:
            self._runner.zenflow.tally(tally)
        tally.add_optimizer_state(self.optimizer)
        return tally.bytes
