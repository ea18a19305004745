"""ZeRO stage 0: plain data parallelism on flat buffers.

Every rank holds whole parameters, gradients, fp32 master parameters and optimizer state. Gradients
are all-reduced bucket by bucket from backward hooks, at gradient-accumulation boundaries only, and
overlap with the rest of backward (asynchronous collectives). This is the reference the sharded
stages are tested against.

Owns: flattening the module's trainable parameters, the gradient hooks, bucketed all-reduce with
DeepSpeed's prescale / predivide semantics, the fp16 overflow check, clipping and the optimizer step
on master weights. Must not: touch the loss scaler's state or the LR schedule (the engine does).

Note (one-bit optimizers): an optimizer that `ReducesOwnGradients` is asked at each boundary backward
whether it wants the gradients left local; then no bucket is all-reduced, the inf/nan decision is
agreed across ranks and each rank clips by its own norm. Its per-rank state (error feedback, 0/1
Adam's local steps) is gathered into the state rank 0 writes.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

from lightspeed.comm.codecs import Collectives
from lightspeed.comm.collectives import Communicator
from lightspeed.optim.onebit.base import ReducesOwnGradients
from lightspeed.precision.policy import PrecisionPolicy
from lightspeed.zero.buckets import Bucket, GradBuckets
from lightspeed.zero import param_access
from lightspeed.zero.flat_params import FlatParams
from lightspeed.zero.fragments import Fragment, module_shapes, first_names, fragments_state_dict
from lightspeed.zero.memory import MemoryTally
from lightspeed.zero.optimizers import fused_step
from lightspeed.zero.partition import Range
from lightspeed.zero.reduce import PendingReduce, ReduceOptions
from lightspeed.zero.norm import NormPlan
from lightspeed.zero.reduce_groups import ReduceGroups
from lightspeed.zero.graphed_step import GraphedStep
from lightspeed.zero.sharded_step import ShardViews, StepResult, sharded_step
from lightspeed.zero.sparse import all_gather_rows

__all__ = ["Stage0Strategy", "StepResult", "WholeParameters", "broadcast_unflattened", "group_trainable_params"]


def broadcast_unflattened(comm: Communicator, module: torch.nn.Module, reduce_groups: ReduceGroups | None = None) -> None:
    """Broadcast from rank 0 what the flat buffers do not hold: frozen parameters (each over its reduce
    group: zero/reduce_groups.py) and buffers."""
    for p in module.parameters():
        if not p.requires_grad:
            (reduce_groups.of(p).comm if reduce_groups is not None else comm).broadcast(p.data, src=0)
    for b in module.buffers():
        comm.broadcast(b, src=0)


def group_trainable_params(module: torch.nn.Module) -> dict[torch.dtype, list[torch.nn.Parameter]]:
    """The module's trainable parameters (each once, tied ones too) grouped by dtype, in order."""
    groups: dict[torch.dtype, list[torch.nn.Parameter]] = {}
    for p in module.parameters():
        if p.requires_grad:
            groups.setdefault(p.dtype, []).append(p)
    return groups


class WholeParameters:
    """The stage-3 seam of a strategy whose ranks hold whole parameters (stages 0-2): nothing to gather,
    release or empty."""

    module: torch.nn.Module

    def unshard(self, module: torch.nn.Module | None = None) -> None:
        """Nothing to gather: parameters are whole at this stage (ZeRO-3's `unshard`, for the engine)."""

    def reshard(self, module: torch.nn.Module | None = None) -> None:
        """Nothing to release: parameters are whole at this stage."""

    def unsharded(self, module: torch.nn.Module | None = None) -> contextlib.AbstractContextManager:
        """A `with` block yielding the module (None: the whole model), which is whole already."""
        return contextlib.nullcontext(module if module is not None else self.module)

    def empty_partition_cache(self) -> None:
        """Nothing is cached: every rank holds whole parameters."""

    def trace_complete(self) -> bool:
        """No module order is followed: nothing is gathered ahead of a module."""
        return False

    def restart_trace(self) -> None:
        """No module order is recorded at this stage."""

    def note_loss_scale(self, loss_scale: float | None) -> None:
        """Nothing is stepped during backward at this stage."""

    def set_steps_per_epoch(self, n: int) -> None:
        """No epoch-based selection at this stage (ZenFlow runs at stages 1-3)."""

    def external_parameters(self, module: torch.nn.Module) -> list[torch.nn.Parameter]:
        """Nothing is gathered around a module's forward at this stage."""
        return []

    def forward_method(self, method: Callable[..., Any]) -> Callable[..., Any]:
        """`method` as it is: nothing is gathered around a forward at this stage."""
        return method


class Stage0Strategy(WholeParameters):
    stage = 0
    state_is_replicated = True  # every rank holds the same state: rank 0 alone writes it
    gather_16bit_weights_on_model_save = True  # whole parameters on every rank: nothing to gather

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer | None, policy: PrecisionPolicy,
                 comm: Communicator, reduce: ReduceOptions, *, collectives: Collectives | None = None,
                 reduce_groups: ReduceGroups | None = None, sparse_params: set[int] = frozenset(),
                 graphed_step: bool = False):
        """`sparse_params`: ids of the embedding weights whose gradients are reduced by all-gathering the
        rows each rank touched (zero/sparse.py), each in a flat buffer of its own. `graphed_step`:
        optimizer.cuda_graph (zero/graphed_step.py)."""
        self.module, self.optimizer, self.policy, self.comm, self.reduce = module, optimizer, policy, comm, reduce
        self.collectives = collectives or Collectives.default(comm)
        # each flat buffer holds parameters of one reduce group (zero/reduce_groups.py)
        self.reduce_groups = reduce_groups or ReduceGroups.single(self.collectives)
        # an optimizer that reduces for itself (one-bit) says, per step, whether gradients stay local
        self._owner = optimizer if isinstance(optimizer, ReducesOwnGradients) else None
        self._reduce_here = True
        grad_dtype = policy.grad_accum_dtype
        self.flats, self._flat_collectives = [], []
        for params in group_trainable_params(module).values():
            for key, keyed in self.reduce_groups.split(params):
                dense = [p for p in keyed if id(p) not in sparse_params]
                for members in ([dense] if dense else []) + [[p] for p in keyed if id(p) in sparse_params]:
                    self.flats.append(FlatParams(members, grad_dtype, keep_master=policy.master_dtype is not None,
                                                 bucket_numel=reduce.bucket_numel))
                    self._flat_collectives.append(self.reduce_groups.for_key(key))
        self._sparse_flats = {id(f) for f in self.flats if id(f.params[0]) in sparse_params}
        self._collectives_of = {id(flat): c for flat, c in zip(self.flats, self._flat_collectives)}
        self._flat_of = {id(p): flat for flat in self.flats for p in flat.params}
        # fused step (lightspeed.ops optimizers): the optimizer reads the low-precision gradients,
        # applies the unscale/clip coefficient and writes the parameters: no fp32 gradient copy
        self._fused = fused_step(optimizer)
        self._master_grad_flats = [self._master_grad_flat(flat) for flat in self.flats]
        self.buckets = GradBuckets(self.flats, self._launch)
        self._boundary = True
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for flat in self.flats for p in flat.params]
        for flat in self.flats:
            if flat.grads_alias_autograd:
                for p, g in zip(flat.params, flat.grad_views):
                    p.grad = g
        self._opt_params: list[tuple[torch.Tensor, torch.Tensor]] = []  # (optimizer's tensor, its grad)
        self._lowp_out: dict[torch.Tensor, list[tuple[int, torch.Tensor]]] = {}  # fused: master view -> lp view
        if optimizer is not None:
            self._bind_optimizer(optimizer)
        self._views = ShardViews(optimizer, self._fused, grads=[f.grad_flat for f in self.flats],
                                 master_grads=self._master_grad_flats, opt_grads=dict(self._opt_params),
                                 lowp_out=self._lowp_out,
                                 device=self.flats[0].device if self.flats else torch.device("cpu"),
                                 graphed=GraphedStep(optimizer) if graphed_step else None)
        param_access.register(self, self._flat_of_params())

    def _flat_of_params(self):
        return [p for flat in self.flats for p in flat.params]

    def fragment(self, param: torch.nn.Parameter) -> param_access.ParamFragment | None:
        """Where `param`'s values live (every rank holds all of them; see `zero/fragments.py`)."""
        flat = self._flat_of.get(id(param))
        if flat is None or flat.params[flat.index[id(param)]] is not param:
            return None
        i = flat.index[id(param)]
        target = flat.optimizer_view(param)
        return param_access.ParamFragment(shape=param.shape, owned=Range(0, param.numel()), master=target.detach().view(-1),
                                  grad=flat.grad_views[i].view(-1), optimizer_tensor=target, state_offset=0,
                                  comm=None, lp_full=flat.lp_views[i] if flat.has_master else None)

    # ---------------------------------------------------------------- set-up
    def _master_grad_flat(self, flat: FlatParams) -> torch.Tensor:
        """Gradients the optimizer reads: fp32 when there is a master copy (unless the step is fused)."""
        if flat.has_master and flat.grad_flat.dtype != torch.float32 and not self._fused:
            return torch.zeros_like(flat.grad_flat, dtype=torch.float32)
        return flat.grad_flat

    def _bind_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Point the optimizer at the fp32 master views (when there are masters) and remember which
        gradient view belongs to each of its tensors."""
        if optimizer.state and any(f.has_master for f in self.flats):
            raise ValueError("the optimizer already has state; pass a freshly constructed optimizer to initialize()")
        for group in optimizer.param_groups:
            new_params = []
            for p in group["params"]:
                flat = self._flat_of.get(id(p))
                if flat is None:  # frozen parameter: the optimizer keeps it and never sees a gradient
                    new_params.append(p)
                    continue
                i = flat.index[id(p)]
                target = flat.optimizer_view(p)
                grad_flat = self._master_grad_flats[self.flats.index(flat)]
                grad_view = grad_flat.narrow(0, flat.layout.offsets[i], p.numel()).view(p.shape)
                self._opt_params.append((target, grad_view))
                if flat.has_master:
                    self._lowp_out[target] = [(0, flat.lp_views[i].view(-1))]
                new_params.append(target)
            group["params"] = new_params

    def broadcast_from_rank0(self, module: torch.nn.Module) -> None:
        """Make every rank start from data-parallel rank 0's parameters and buffers."""
        for flat, collectives in zip(self.flats, self._flat_collectives):
            collectives.comm.broadcast(flat.lp_flat, src=0)
            flat.copy_params_to_master()
        broadcast_unflattened(self.comm, module, self.reduce_groups)

    # ---------------------------------------------------------------- backward
    def backward_start(self, is_boundary: bool) -> None:
        self._boundary = is_boundary
        if is_boundary:
            self.buckets.reset()
            self._reduce_here = self._owner is None or not self._owner.owns_gradient_reduction()

    def _on_grad(self, param: torch.nn.Parameter) -> None:
        flat = self._flat_of[id(param)]
        view = flat.grad_views[flat.index[id(param)]]
        grad = param.grad
        if grad is not None and grad.is_sparse:  # Embedding(sparse=True): added into the dense buffer
            view.add_(grad)
            param.grad = None  # never a dense .grad: autograd would add the next sparse one out of place
        elif grad is None or grad.data_ptr() != view.data_ptr():
            if grad is not None:  # autograd made a new tensor (other dtype, or .grad was reset)
                view.add_(grad)
            param.grad = view if flat.grads_alias_autograd else None
        if self._boundary:
            self.buckets.mark_ready(param)

    def _launch(self, bucket: Bucket) -> PendingReduce | None:
        if not self._reduce_here:  # the optimizer communicates (compressed) what these gradients feed
            return None
        collectives = self._collectives_of[id(bucket.flat)]
        if id(bucket.flat) in self._sparse_flats:  # one embedding weight: its touched rows, gathered
            flat = bucket.flat
            all_gather_rows(flat.grad_views[0].view(flat.params[0].shape), collectives, self.reduce)
            return None
        buf, post = self.reduce.prepare(bucket.grad, collectives.world_size)
        return PendingReduce(collectives.all_reduce(buf, async_op=True), buf, bucket.grad, post)

    def backward_end(self) -> None:
        if self._boundary:
            self.buckets.flush()

    # ---------------------------------------------------------------- step
    def wait_gradients(self) -> None:
        """Block until every bucket's reduction has finished (idempotent)."""
        self.buckets.wait()

    def step(self, loss_scale: float | None, max_norm: float, check_overflow: bool | None = None) -> StepResult:
        """Finish the reductions, then (unless a gradient is inf/nan) unscale, clip and step.
        `loss_scale` None means no loss scaling (fp32 / bf16). `check_overflow` (default: when there is
        a loss scale) skips the step on inf/nan gradients, as fp16 and bf16.check_grad_overflow do."""
        self.buckets.wait()
        self._adopt_assigned_grads()
        check = check_overflow if check_overflow is not None else loss_scale is not None
        # reduced gradients are identical on every rank, so every rank reaches the same decision alone;
        # local ones (the optimizer reduces) need the inf/nan decision agreed, and each rank clips by its
        # own norm, as DeepSpeed's one-bit optimizers do
        local = not self._reduce_here
        result = sharded_step(self._views, loss_scale, max_norm, check_overflow=check,
                              agree=self.collectives.all_reduce if local else None, agree_norm=False)
        if result.applied and not self._views.optimizer_writes_lowp:
            for flat in self.flats:
                flat.copy_master_to_params()
        return result

    def gradients_unreduced(self) -> bool:
        """False: every rank holds whole gradients (`param.grad`, reduced in place at a boundary)."""
        return False

    def _adopt_assigned_grads(self) -> None:
        """A `.grad` the user assigned after backward (a new tensor, not the buffer's view) is the gradient
        the step reads, as in DeepSpeed's stage 0, which steps `p.grad`: copied into the buffer (as it is:
        not reduced, already scaled like the loss) and the parameter pointed back at the buffer."""
        for flat in self.flats:
            if not flat.grads_alias_autograd:
                continue
            for p, view in zip(flat.params, flat.grad_views):
                grad = p.grad
                if grad is not None and not grad.is_sparse and grad.data_ptr() != view.data_ptr():
                    view.copy_(grad)
                    p.grad = view

    def zero_grad(self) -> None:
        for flat in self.flats:
            flat.grad_flat.zero_()

    def use_placements(self, placements, topology) -> None:
        """Count the gradient norm over the mesh as `placements` say (zero/norm.py). Every rank holds the
        whole reduced gradients: no dim is partitioned."""
        self._views.norm = NormPlan.build(self.fragments(), self._views.opt_grads, placements, topology, ())

    # ---------------------------------------------------------------- state
    def fragments(self) -> list[Fragment]:
        """Every trainable parameter whole, owned by its fp32 master view (or itself when fp32)."""
        names = first_names(self.module)
        return [Fragment(names[id(p)], tuple(p.shape), 0, p.numel(), flat.optimizer_view(p), 0)
                for flat in self.flats for p in flat.params]

    def state_dict(self) -> dict[str, Any]:
        # an optimizer with per-rank state (one-bit error feedback) gathers it into its param groups, which
        # rank 0 writes with the rest; every rank calls state_dict, so the gather is collective
        if self._owner is not None:
            self._owner.gather_error_feedback()
        try:
            return fragments_state_dict(self.fragments(), self.optimizer, stage=0,
                                        dp_world_size=self.comm.world_size, dp_rank=self.comm.rank)
        finally:
            if self._owner is not None:
                self._owner.drop_gathered_error_feedback()

    def masters_loaded(self) -> None:
        """The fp32 masters were overwritten (a checkpoint): make the parameters follow them."""
        for flat in self.flats:
            flat.copy_master_to_params()

    def masters_from_params(self) -> None:
        """The parameters were overwritten (a module-only load): make the masters follow them."""
        for flat in self.flats:
            flat.copy_params_to_master()

    def module_shapes(self) -> dict[str, tuple[int, ...]]:
        return module_shapes(self.module)

    def module_state_dict(self) -> dict[str, Any]:
        return self.module.state_dict()

    def load_module_state_dict(self, state: dict[str, Any], strict: bool = True) -> None:
        self.module.load_state_dict(state, strict=strict)  # copies into the lp_flat views in place

    def compile_regions(self) -> list[torch.nn.Module]:
        """The modules `engine.compile()` compiles in place: the whole module (the gradient hooks sit on
        the parameters and run from autograd, outside any compiled graph)."""
        return [self.module]

    def after_compile(self, regions: list[torch.nn.Module]) -> None:
        pass  # the whole module is one region: nothing to join

    def needs_eager_forward(self) -> bool:
        return False

    def remove_hooks(self) -> None:
        """Finish the reductions in flight and remove the gradient hooks (engine.destroy)."""
        self.wait_gradients()
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def memory_breakdown(self) -> dict[str, dict[str, int]]:
        """This rank's bytes by device and category."""
        tally = MemoryTally()
        for flat, mg in zip(self.flats, self._master_grad_flats):
            for key, nbytes in flat.nbytes().items():
                tally.add(flat.device, key, nbytes)
            if mg is not flat.grad_flat:
                tally.add_tensor("grads", mg)
        tally.add_optimizer_state(self.optimizer)
        return tally.bytes
