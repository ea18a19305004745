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

DeepSpeed's keys: `reduce_bucket_size` and `allgather_bucket_size` both bound the layout bucket (the
unit of reduce-scatter and all-gather); `overlap_comm` false waits on each reduction as soon as it
is launched (true lets it run under the rest of backward: NCCL runs it on its own stream);
`contiguous_gradients` is always the case (gradients live in flat buffers); `round_robin_gradients`
only reorders gradient copies for CPU offload in DeepSpeed and changes nothing here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from lightspeed.comm.codecs import Collectives
from lightspeed.comm.collectives import Communicator
from lightspeed.precision.policy import PrecisionPolicy
from lightspeed.zero.buckets import Bucket, GradBuckets
from lightspeed.zero.flat_params import FlatParams
from lightspeed.zero.fragments import Fragment, module_shapes, first_names, fragments_state_dict, range_fragments
from lightspeed.zero.partition import Range, owned_chunks
from lightspeed.zero.reduce import PendingReduce, ReduceOptions
from lightspeed.zero.memory import MemoryTally
from lightspeed.zero.optimizers import check_optimizer, fused_step
from lightspeed.zero.sharded_step import ShardViews, StepResult, sharded_step
from lightspeed.zero.stage0 import broadcast_unflattened

@dataclass
class Shard:
    """One flat buffer and this rank's part of it."""

    flat: FlatParams
    chunks: list[tuple[Range, int]]  # (flat-buffer range, start in the shard) per bucket
    master: torch.Tensor  # fp32 [shard_numel]: the tensor the optimizer steps
    grad: torch.Tensor  # grad_accum dtype [shard_numel]: reduced gradients
    master_grad: torch.Tensor  # fp32 view of `grad` for the optimizer (a copy when grad is not fp32)
    stepped: bool  # False for trainable params outside every optimizer group

    def chunk_pairs(self):
        """(flat-buffer slice, shard slice) per bucket."""
        for r, pos in self.chunks:
            yield slice(r.start, r.end), slice(pos, pos + r.numel)


class ShardedStrategy:
    """ZeRO stage 1 (`stage=1`) or 2 (`stage=2`) over `comm`'s data-parallel group."""

    state_is_replicated = False

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer | None, policy: PrecisionPolicy,
                 comm: Communicator, reduce: ReduceOptions, *, stage: int, allow_untested_optimizer: bool = False,
                 collectives: Collectives | None = None):
        assert stage in (1, 2)
        check_optimizer(optimizer, allow_untested_optimizer, stage)
        # fused ZeRO step: the optimizer reads the reduced (low-precision) gradient shard itself,
        # applies the unscale/clip coefficient and writes the lp chunks (no fp32 gradient copy)
        self._fused = fused_step(optimizer)
        self.stage, self.module, self.optimizer, self.policy, self.comm, self.reduce = (
            stage, module, optimizer, policy, comm, reduce)
        self.collectives = collectives or Collectives.default(comm)
        world, rank = comm.world_size, comm.rank
        names = {id(p): n for n, p in module.named_parameters()}
        self.shards: list[Shard] = []
        self._shard_of: dict[int, Shard] = {}
        for group_index, params in self._param_groups(module, optimizer):
            by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
            for p in params:
                by_dtype.setdefault(p.dtype, []).append(p)
            for dtype_params in by_dtype.values():
                # a layout bucket is both the reduce-scatter and the all-gather unit: bound it by both sizes
                bucket_numel = min(reduce.bucket_numel, reduce.allgather_bucket_numel) or max(
                    reduce.bucket_numel, reduce.allgather_bucket_numel)
                flat = FlatParams(dtype_params, policy.grad_accum_dtype, keep_master=False,
                                  bucket_numel=bucket_numel, world_size=world,
                                  names=[names[id(p)] for p in dtype_params], full_grads=stage == 1)
                chunks = owned_chunks(flat.buckets, world, rank)
                numel = flat.layout.padded_numel // world
                master = torch.empty(numel, dtype=torch.float32, device=flat.device)
                grad = torch.zeros(numel, dtype=policy.grad_accum_dtype, device=flat.device)
                fp32_copy = grad.dtype != torch.float32 and not self._fused
                master_grad = torch.zeros_like(grad, dtype=torch.float32) if fp32_copy else grad
                shard = Shard(flat, chunks, master, grad, master_grad, stepped=group_index is not None)
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
        self.buckets = GradBuckets([s.flat for s in self.shards], self._launch)
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
            lowp_out={s.master: [(sh.start, s.flat.lp_flat[fl]) for fl, sh in s.chunk_pairs()] for s in stepped},
            device=self.shards[0].master.device if self.shards else torch.device("cpu"))
        for s in self.shards:
            if s.flat.grad_flat is not None and s.flat.grads_alias_autograd:
                for p, g in zip(s.flat.params, s.flat.grad_views):
                    p.grad = g

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
        for flat_slice, shard_slice in shard.chunk_pairs():
            shard.master[shard_slice].copy_(shard.flat.lp_flat[flat_slice])

    def _all_gather_params(self, shard: Shard, copy: bool = True) -> None:
        """Write the master shard into this rank's chunks of the lp buffer (unless the fused step has
        written them: `copy=False`), then all-gather each bucket."""
        flat = shard.flat
        for (flat_slice, shard_slice), bucket in zip(shard.chunk_pairs(), flat.buckets):
            if copy:
                flat.lp_flat[flat_slice].copy_(shard.master[shard_slice])
            out = flat.lp_flat[bucket.start:bucket.start + bucket.padded_numel]
            # gloo may not accept an input that aliases the output; NCCL handles in-place all-gather
            chunk = flat.lp_flat[flat_slice]
            self.collectives.all_gather(out, chunk if chunk.is_cuda else chunk.clone())

    def broadcast_from_rank0(self, module: torch.nn.Module) -> None:
        for s in self.shards:
            self.comm.broadcast(s.flat.lp_flat, src=0)
            self._copy_params_to_master(s)
        broadcast_unflattened(self.comm, module)

    # ---------------------------------------------------------------- backward
    def backward_start(self, is_boundary: bool) -> None:
        self._boundary = is_boundary
        if is_boundary or self.stage == 2:
            self.buckets.reset()

    def _on_grad(self, param: torch.nn.Parameter) -> None:
        shard = self._shard_of[id(param)]
        flat, i = shard.flat, shard.flat.index[id(param)]
        grad = param.grad
        if self.stage == 1:
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
            dtype = self.reduce.reduce_dtype or self.policy.grad_accum_dtype
            staging = self._staging[bucket.index] = torch.zeros(bucket.numel, dtype=dtype, device=flat.device)
        start = flat.layout.offsets[i] - bucket.start
        staging[start:start + param.numel()].view(param.shape).copy_(grad)
        param.grad = None
        self.buckets.mark_ready(param)

    def _launch(self, bucket: Bucket) -> PendingReduce:
        shard, chunk, pos = self._targets[bucket.index]
        world = self.comm.world_size
        if self.stage == 1:
            send, post = self.reduce.prepare(bucket.grad, world)
        else:
            staged = self._staging.pop(bucket.index, None)
            if staged is None:
                staged = torch.zeros(bucket.numel, dtype=self.reduce.reduce_dtype or self.policy.grad_accum_dtype,
                                     device=bucket.flat.device)
            send, post = self.reduce.prepare(staged, world)
        out = torch.empty(chunk.numel, dtype=send.dtype, device=send.device)
        handle = self.collectives.reduce_scatter(out, send, async_op=True)
        pending = PendingReduce(handle, out, shard.grad[pos:pos + chunk.numel], post, accumulate=True)
        if not self.reduce.overlap_comm:
            pending.wait()
        return pending

    def backward_end(self) -> None:
        if self._boundary or self.stage == 2:
            self.buckets.flush()
        if self.stage == 2 and not self._boundary:
            self.buckets.wait()  # gradients of this micro-step are in the shard; staging is freed

    def wait_gradients(self) -> None:
        self.buckets.wait()

    # ---------------------------------------------------------------- step
    def step(self, loss_scale: float | None, max_norm: float, check_overflow: bool | None = None) -> StepResult:
        self.buckets.wait()
        check = check_overflow if check_overflow is not None else loss_scale is not None
        result = sharded_step(self._views, loss_scale, max_norm, check_overflow=check,
                               agree=self.collectives.all_reduce)
        if result.applied:
            for s in self.shards:
                if s.stepped:
                    self._all_gather_params(s, copy=not self._views.optimizer_writes_lowp)
        return result

    def zero_grad(self) -> None:
        for s in self.shards:
            s.grad.zero_()
            if s.flat.grad_flat is not None:
                s.flat.grad_flat.zero_()

    # ---------------------------------------------------------------- state
    def fragments(self) -> list[Fragment]:
        """The parts of each parameter inside this rank's chunks, owned by the flat master shard."""
        names = first_names(self.module)
        out: list[Fragment] = []
        for s in self.shards:
            pieces = [(r, s.master, pos) for r, pos in s.chunks]
            for i, p in enumerate(s.flat.params):
                out.extend(range_fragments(names[id(p)], tuple(p.shape), s.flat.param_range(i), pieces))
        return out

    def state_dict(self) -> dict[str, Any]:
        return fragments_state_dict(self.fragments(), self.optimizer, stage=self.stage,
                                    dp_world_size=self.comm.world_size, dp_rank=self.comm.rank)

    def masters_loaded(self) -> None:
        for s in self.shards:
            self._all_gather_params(s)

    def masters_from_params(self) -> None:
        for s in self.shards:
            self._copy_params_to_master(s)

    def module_shapes(self) -> dict[str, tuple[int, ...]]:
        return module_shapes(self.module)

    def module_state_dict(self) -> dict[str, Any]:
        return self.module.state_dict()

    def load_module_state_dict(self, state: dict[str, Any], strict: bool = True) -> None:
        self.module.load_state_dict(state, strict=strict)

    def memory_breakdown(self) -> dict[str, dict[str, int]]:
        tally = MemoryTally()
        for s in self.shards:
            tally.add_tensor("lp_params", s.flat.lp_flat)
            tally.add_tensor("master_params", s.master)
            tally.add_tensor("grads", s.grad)
            if s.master_grad is not s.grad:
                tally.add_tensor("grads", s.master_grad)
            if s.flat.grad_flat is not None:
                tally.add_tensor("grads", s.flat.grad_flat)
        tally.add_optimizer_state(self.optimizer)
        return tally.bytes
