"""ZeRO stage 3: parameters, gradients, fp32 master weights and optimizer state all partitioned.

Owns: building the ParamGroups (materializing an `Init`-built model one module at a time), pointing
the optimizer at flat fp32 shards, the step (overflow check agreed across ranks, global norm, clip,
optimizer, lp write-back), checkpoint state, the gathered module state_dict and which groups
`unshard()` covers (`gathered.Unsharding` holds them; the methods that serve code outside the step,
unshard and the trace among them, are seam.py's mixin). Gathering, releasing and gradient reduction
are scheduled by `coordinator.Coordinator`. Must not: touch the loss scaler or LR schedule (the engine does).

Note (granularity): the unit of communication is a *unit* (rule in `units.py`: the root, each
child of a ModuleList/Sequential/ModuleDict holding parameters, DeepSpeed's leaf modules): a
ParamGroup is the parameters of one unit's region with one `requires_grad` value, so a GPT has one
group per block plus one for the embeddings, final norm and head, as FSDP2's `fully_shard` per
block. Coarse groups keep the per-group Python work (hooks, gathers, reduce-scatters, optimizer
pieces) a few dozen per step instead of one per parameter-owning module, at the price of a unit's
parameters gathered at once (plus prefetch); frozen parameters form their own groups so the
optimizer never sees them. Within a group, parameters are laid out by optimizer param group
(stable), so that each (optimizer param group x ParamGroup) is one contiguous range of the shard and
the optimizer gets one flat tensor for it: elementwise optimizers (Adam, AdamW, SGD, Adagrad, Lion,
...) then compute exactly what they compute on whole parameters; `sub_group_size` has no effect here.

Note (initial values): without Init, each group of every rank's model is flattened in turn, rank 0's
values broadcast, each rank keeps its slice and `param.data` becomes an empty placeholder. With Init
(`init.py`) a unit's modules are materialized one at a time (each by its own seed), then its groups
built: at most one unit's parameters (and their flat buffer) are whole at once.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import torch

from lightspeed._utils.device import Stream
from lightspeed._utils.logging import get_logger
from lightspeed._utils.progress import progress
from lightspeed.comm.codecs import Collectives
from lightspeed.comm.collectives import Communicator
from lightspeed.offload.nvme import NvmeSwapper
from lightspeed.offload.policy import OffloadPolicy
from lightspeed.offload.swapped_step import SubGroup, SwappedOptimizerState
from lightspeed.precision.policy import PrecisionPolicy
from lightspeed.zero import param_access
from lightspeed.zero.partition import Range, uncovered
from lightspeed.comm.topology import dims_of
from lightspeed.zero.norm import NormPlan, device_side
from lightspeed.zero.reduce_groups import ReduceGroups
from lightspeed.zero.graphed_step import GraphedStep
from lightspeed.zero.sharded_step import ShardViews, StepResult
from lightspeed.zero.step_runner import StepRunner
from lightspeed.zero.zenflow import ZenFlowStep
from lightspeed.zero.stage3.zenflow_shards import zenflow_shards
from lightspeed.zero.stage3.coordinator import Coordinator
from lightspeed.zero.stage3.options import Stage3Options
from lightspeed.zero.stage3.seam import ModelSeam
from lightspeed.zero.stage3.gathered import Unsharding, take_pending_external
from lightspeed.zero.stage3.init import (StandaloneScheduler, init_record, materialize_module, seed_from_global_rng,
                                         take_init_groups)
from lightspeed.zero.stage3.param_group import RELEASED, ParamGroup, param_state
from lightspeed.zero.stage3.units import choose_units, mark_named_leaves
from lightspeed.zero.fragments import Fragment, module_shapes, fragments_state_dict, range_fragments
from lightspeed.zero.memory import MemoryTally
from lightspeed.ops.lowp_writer import LowpWriter
from lightspeed.zero.optimizers import check_optimizer, fused_step, low_precision_masters

logger = get_logger(__name__)

class Stage3Strategy(ModelSeam):
    stage = 3
    state_is_replicated = False  # each rank holds its own slices: every rank writes its file

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer | None, policy: PrecisionPolicy,
                 comm: Communicator, options: Stage3Options | None = None, device: torch.device | None = None,
                 offload: OffloadPolicy | None = None, *, collectives: Collectives | None = None,
                 reduce_groups: ReduceGroups | None = None, comm_dtypes: dict[int, torch.dtype] | None = None,
                 graphed_step: bool = False):
        """`comm_dtypes` (torch_autocast): id(param) -> the dtype its gradient is reduced in (the others:
        their own; each group one reduce dtype). `graphed_step`: optimizer.cuda_graph (zero/graphed_step.py)."""
        self.options = options or Stage3Options()
        self._comm_dtypes = comm_dtypes
        self.offload = offload if offload is not None else OffloadPolicy()
        check_optimizer(optimizer, self.options.allow_untested_optimizer, stage=3)
        # the optimizer unscales, clips and writes the lp shards (zero/optimizers.py says when)
        self._fused = fused_step(optimizer, self.offload)
        # bf16 masters (bf16_master_weights_and_grads): the bf16 lp shard is the master (DeepSpeed's stage 3
        # aliases a partition in the master dtype); with the optimizer offloaded, a host copy in that dtype
        self._lowp_master = low_precision_masters(policy, optimizer, self.offload, comm.rank) != torch.float32
        if self._lowp_master and self.offload.offloads_params:
            raise NotImplementedError("bf16.bf16_master_weights_and_grads at ZeRO stage 3 with "
                                      "zero_optimization.offload_param is not implemented yet")
        if optimizer is not None and optimizer.state:
            raise ValueError("the optimizer already has state; pass a freshly constructed optimizer to initialize()")
        self.module, self.optimizer, self.policy, self.comm = module, optimizer, policy, comm
        self.collectives = collectives or Collectives.default(comm)
        # each parameter group holds parameters of one reduce group (zero/reduce_groups.py)
        self.reduce_groups = reduce_groups or ReduceGroups.single(self.collectives)
        self._lowp_writer = LowpWriter()  # host masters -> device lp shards, outside the fused step
        self.device = torch.device(device) if device is not None else self._infer_device(module)
        self.gather_16bit_weights_on_model_save = self.options.gather_16bit_weights_on_model_save
        stream = Stream(self.device) if self.device.type == "cuda" else None
        opt_index = {}
        if optimizer is not None:
            opt_index = {id(p): gi for gi, group in enumerate(optimizer.param_groups) for p in group["params"]}
        self.setup_peak_numel = 0  # most full-size parameter elements alive at once while sharding
        mark_named_leaves(module, self.options.leaf_rule)
        self.units = choose_units(module, self.options.leaf_rule)
        self.groups = self._build_groups(opt_index, stream)
        self._group_set = set(self.groups)
        self._mark_persistent()
        self._opt_params: list[tuple[torch.Tensor, torch.Tensor]] = []  # (optimizer's tensor, its grad)
        self._opt_pieces: dict[int, list[tuple[Range, torch.Tensor, int]]] = {}  # id(group) -> its optimizer tensors
        self._lowp_out: dict[torch.Tensor, list[tuple[int, torch.Tensor]]] = {}  # fused: master -> lp piece
        if optimizer is not None:
            self._bind_optimizer(optimizer, opt_index)
        trainable = self._trainable()
        host = self.offload.offloads_optimizer
        self._views = ShardViews(optimizer, self._fused, grads=[g.grad_shard for g in trainable],
                                 master_grads=[g.master_grad_shard for g in trainable],
                                 opt_grads=dict(self._opt_params), lowp_out=self._lowp_out, device=self.device,
                                 norm_grads=[g.grad_shard for g in trainable] if host else None,
                                 graphed=GraphedStep(optimizer) if graphed_step else None,
                                 host_copies=self.offload.zenflow is None)  # ZenFlow: zero/zenflow.py
        for g in trainable:
            g.grad_buffers.kept = graphed_step  # the captured step reads fixed addresses
        # early device-to-host gradient copies (not with overlap_step: its background step reads them later)
        to_host = Stream(self.device) if host and not self.offload.overlap_step and not self.offload.zenflow else None
        swap = self._optimizer_swap() if self.offload.optimizer == "nvme" else None
        swapped = [g for g in trainable if g.offload.offloads_optimizer]
        self._runner = StepRunner(self._views, self.collectives.all_reduce, write_back=self._write_back,
                                  to_host=to_host, swap=swap, overlap=self.offload.overlap_step,
                                  overlap_warmup=self.offload.overlap_step_warmup,
                                  write_sub_group=lambda i: swapped[i].copy_master_to_lp(self._lowp_writer),
                                  after_swapped=lambda: self.coordinator.release_all(force=True),
                                  copied_early=[g.master_grad_shard for g in swapped], early_ranges=True,
                                  speculative=self.offload.super_offload, rollback=self.offload.super_offload_rollback,
                                  zenflow=self.offload.zenflow and ZenFlowStep(
                                      self.offload.zenflow, self._views, zenflow_shards(
                                          trainable, optimizer, opt_index, self._opt_pieces),
                                      self.collectives.all_reduce, self._write_back))
        self._param_swapper = self._param_swap() if self.offload.param == "nvme" else None
        unit_of = {id(m): u.module for u in self.units for m in u.region}
        self.coordinator = Coordinator(module, self.groups, self._uses(), self.options.schedule,
                                       units=[u.module for u in self.units], unit_of=unit_of)
        self._unsharding = Unsharding(self._groups_under)
        param_access.register(self, [p for g in self.groups for p in g.params])
        for g in trainable:  # every view of them is made: no memory until the first backward
            g.grad_buffers.release()

    def fragment(self, param: torch.nn.Parameter) -> param_access.ParamFragment | None:
        """Where `param`'s values live: this rank's range of its group (see `zero/param_access.py`)."""
        st = param_state(param)
        if st is None or st.group not in self._group_set:
            return None
        g, r = st.group, st.range
        if not isinstance(g.lp_shard, torch.Tensor):
            raise NotImplementedError(f"zero_optimization.zero_quantized_nontrainable_weights: {st.name} is stored "
                                      f"quantized; its fragment cannot be read or written in place")
        inter = r.intersect(g.shard)
        own = g.local(r) if inter.numel else Range(0, 0)
        owned = inter.shift(-r.start) if inter.numel else Range(0, 0)
        tensor, offset = g.optimizer_shard, own.start
        for piece, _ in self._opt_params:  # the optimizer keeps state per piece of the shard
            start = piece.storage_offset() - g.optimizer_shard.storage_offset()
            if piece.untyped_storage().data_ptr() == g.optimizer_shard.untyped_storage().data_ptr() \
                    and start <= own.start and own.end <= start + piece.numel():
                tensor, offset = piece, own.start - start
                break
        grad = g.grad_shard[own.start:own.end] if g.grad_shard is not None and not g.grad_buffers.released else None
        return param_access.ParamFragment(shape=torch.Size(st.shape), owned=owned,
                                  master=g.optimizer_shard[own.start:own.end], grad=grad, optimizer_tensor=tensor,
                                  state_offset=offset, comm=g.comm, grad_released=g.grad_buffers.released,
                                  lp_owned=g.lp_shard[own.start:own.end] if g.master_shard is not None else None,
                                  after_write=g.refresh, local=True)

    # ---------------------------------------------------------------- set-up
    @staticmethod
    def _infer_device(module: torch.nn.Module) -> torch.device:
        for p in module.parameters():
            if not p.is_meta:
                return p.device
        return torch.device("cpu")

    def _init_seeds(self, plan) -> dict[int, int]:
        """Rank 0's initialization seed for each module with meta parameters (see init.py)."""
        deferred = [(index, m) for index, _, m, owned in plan if any(p.is_meta for _, p in owned)]
        if not deferred:
            return {}
        seeds = []
        for _, m in deferred:
            record = init_record(m)
            seeds.append(record.seed if record is not None else seed_from_global_rng())
        t = torch.tensor(seeds, dtype=torch.int64, device=self.device)
        self.comm.broadcast(t, src=0)
        return {index: int(s) for (index, _), s in zip(deferred, t.tolist())}

    def _unit_groups(self, owned):
        """A unit's parameters as (trainable, reduce key, [(name, param)]): one group per `requires_grad`
        value and reduce group (zero/reduce_groups.py; the default key first)."""
        out = []
        for trainable in (True, False):
            sel = [(n, p) for n, p in owned if p.requires_grad == trainable]
            for key, params in self.reduce_groups.split([p for _, p in sel]):
                ids = {id(p) for p in params}
                kept = [(n, p) for n, p in sel if id(p) in ids]
                if self._comm_dtypes is None or not trainable:
                    out.append((trainable, key, kept))
                    continue
                by_comm: dict[torch.dtype, list] = {}  # torch_autocast: one group per reduce dtype
                for n, p in kept:
                    by_comm.setdefault(self._comm_dtypes.get(id(p), self.policy.param_dtype), []).append((n, p))
                out.extend((trainable, key, members) for members in by_comm.values())
        return out

    def _build_groups(self, opt_index: dict[int, int], stream) -> list[ParamGroup]:
        seeds = self._init_seeds([entry for u in self.units for entry in u.members])
        last = len(self.optimizer.param_groups) if self.optimizer is not None else 0
        groups: list[ParamGroup] = []

        def shape_of(p):
            st = param_state(p)
            return st.shape if st is not None else p.shape

        # Offload++ (`offload_optimizer.ratio` < 1): groups past that fraction of the elements stay on the device
        total = sum(torch.Size(shape_of(p)).numel() for u in self.units for _, p in u.owned() if p.requires_grad)
        offloaded_numel = 0
        device_kept = dataclasses.replace(self.offload, optimizer="none", overlap_step=False, super_offload=False)

        unit_numels = [sum(math.prod(shape_of(p)) for _, _, _, owned in u.members for _, p in owned) for u in self.units]
        what = "materializing and partitioning" if seeds else "partitioning"
        bar = progress(total=sum(unit_numels), desc=f"ZeRO-3: {what} parameters", unit="param", unit_scale=True)
        init_groups: list[ParamGroup] = []  # zero.Init's groups, gathered as their values are taken over
        for unit, unit_numel in zip(self.units, unit_numels):
            for index, mname, m, owned in unit.members:
                for _, p in owned:
                    if not p.is_floating_point():
                        raise TypeError(f"ZeRO stage 3 shards floating-point parameters only ({mname} has {p.dtype})")
                    st = param_state(p)
                    if st is not None and isinstance(st.group.coordinator, StandaloneScheduler):
                        if st.group not in init_groups:
                            init_groups.append(st.group)
                        st.group.wait()  # gathered: `p.data` is the full value until the new group takes it
                if index in seeds:
                    materialize_module(self.module, m, index, owned, seeds[index], self.device, shape_of)
            owned = unit.owned()
            full_numel = sum(p.numel() for _, p in owned)
            for trainable, key, sel in self._unit_groups(owned):
                sel.sort(key=lambda item: opt_index.get(id(item[1]), last))
                comm_dtype = self._comm_dtypes.get(id(sel[0][1]), self.policy.param_dtype) \
                    if trainable and self._comm_dtypes is not None else None
                name = unit.name + ("" if trainable else " (frozen)") + (f" [{' x '.join(key)}]" if key else "") \
                    + (f" ({str(comm_dtype).removeprefix('torch.')} reduce)" if comm_dtype is not None else "")
                collectives = self.reduce_groups.for_key(key)
                numel = sum(p.numel() if not p.is_meta else torch.Size(shape_of(p)).numel() for _, p in sel)
                offload = self.offload
                if trainable and self.offload.offloads_optimizer and self.offload.ratio < 1.0:
                    if offloaded_numel + numel > self.offload.ratio * total:
                        offload = device_kept
                    else:
                        offloaded_numel += numel
                g = ParamGroup(name, [p for _, p in sel], [n for n, _ in sel], [p.detach() for _, p in sel],
                               collectives.comm, collectives=collectives, dtype=self.policy.param_dtype,
                               device=self.device,
                               grad_dtype=self.policy.grad_accum_dtype,
                               keep_master=self.policy.master_dtype is not None and not self._lowp_master,
                               stream=stream,
                               fp32_grad_copy=not self._fused, offload=offload,
                               one_rank_views=self.options.one_rank_views,
                               master_dtype=self.policy.shard_master_dtype())
                g.comm_dtype = comm_dtype
                self.setup_peak_numel = max(self.setup_peak_numel, full_numel + g.numel)
                groups.append(g)
                full_numel -= g.layout.numel  # the values now live in the group's shard only
            for ig in [ig for ig in init_groups if all(param_state(p) is not st for p, st in zip(ig.params, ig.states))]:
                ig.discard()  # every parameter it held belongs to a group of this strategy now
                init_groups.remove(ig)
            bar.update(unit_numel)
        bar.close()
        for m in self.module.modules():
            for ig in take_init_groups(m):  # also the groups of parameters no longer in the model
                if ig not in init_groups:
                    ig.discard()
        for ig in init_groups:
            ig.discard()
        return groups

    def _uses(self) -> dict[int, list[ParamGroup]]:
        """id(unit module) -> the groups of every parameter registered in its region (its own, tied
        ones owned by another unit, and external ones registered before the strategy existed)."""
        uses: dict[int, list[ParamGroup]] = {}
        for unit in self.units:
            gs: list[ParamGroup] = []
            for m in unit.region:
                params = list(m.parameters(recurse=False)) + take_pending_external(m)
                for p in params:
                    st = param_state(p)
                    if st is not None and st.group not in gs:
                        gs.append(st.group)
            if gs:
                uses[id(unit.module)] = gs
        return uses

    def _mark_persistent(self) -> None:
        """DeepSpeed's persistence: small groups stay gathered once gathered (until the next step),
        up to `stage3_model_persistence_threshold` elements in all."""
        total = 0
        for g in self.groups:
            if g.layout.numel <= self.options.param_persistence_threshold and \
                    total + g.layout.numel <= self.options.model_persistence_threshold:
                g.persistent = True
                total += g.layout.numel

    def _bind_optimizer(self, optimizer: torch.optim.Optimizer, opt_index: dict[int, int]) -> None:
        """Replace each optimizer group's params by this rank's flat pieces of it, one per ParamGroup."""
        for gi, pg in enumerate(optimizer.param_groups):
            tensors = []
            for g in self.groups:
                if not g.trainable:
                    continue
                idx = [st.index for st in g.states if opt_index.get(id(st.param)) == gi]
                if not idx:
                    continue
                assert idx == list(range(idx[0], idx[-1] + 1)), "optimizer groups are laid out contiguously"
                own = g.local(Range(g.layout.range_of(idx[0])[0], g.layout.range_of(idx[-1])[1]))
                if own.numel == 0:
                    continue
                tensor = g.optimizer_shard[own.start:own.end]
                self._opt_pieces.setdefault(id(g), []).append((own.shift(g.shard.start), tensor, 0))
                self._opt_params.append((tensor, g.master_grad_shard[own.start:own.end]))
                if g.master_shard is not None:
                    self._lowp_out[tensor] = [(0, g.lp_shard[own.start:own.end])]
                tensors.append(tensor)
            pg["params"] = tensors

    def _optimizer_swap(self) -> SwappedOptimizerState:
        """NVMe optimizer offload: each trainable group's master shard and the optimizer state of its
        pieces form one sub-group, swapped out between steps."""
        swapper = NvmeSwapper(self.offload.optimizer_nvme_path, self.offload.aio,
                              key="zero_optimization.offload_optimizer.nvme_path", name="optimizer")
        trainable = [g for g in self._trainable() if g.offload.offloads_optimizer]
        swapper.require_space(sum(g.master_shard.numel() * 4 * 3 for g in trainable))  # master + two Adam moments
        subgroups = [SubGroup(f"group{i}", [g.master_shard], [t for _, t, _ in self._opt_pieces.get(id(g), [])])
                     for i, g in enumerate(trainable)]
        swap = SwappedOptimizerState(swapper, self.optimizer, subgroups, buffer_count=self.offload.optimizer_buffer_count)
        swap.all_out()
        return swap

    def _param_swap(self) -> NvmeSwapper:
        """NVMe parameter offload: the lp shards past `max_in_cpu` elements live in swap files and are
        read back when their group is gathered."""
        swapper = NvmeSwapper(self.offload.param_nvme_path, self.offload.aio,
                              key="zero_optimization.offload_param.nvme_path", name="param")
        kept, swapped = 0, []
        for g in self.groups:
            if kept + g.shard_numel <= self.offload.max_in_cpu:
                kept += g.shard_numel
            else:
                swapped.append(g)
        swapper.require_space(sum(g.lp_shard.numel() * g.lp_shard.element_size() for g in swapped))
        for i, g in enumerate(swapped):
            swapper.register(g.lp_shard, f"{i}_{g.name}")
            g.swapper = swapper
            g.lp_out()
        return swapper

    def _locate(self, t: torch.Tensor) -> str | None:
        for swapper in (self._runner.swap.swapper if self._runner.swap is not None else None, self._param_swapper):
            where = swapper.location(t) if swapper is not None else None
            if where is not None:
                return where
        return None

    def _masters_in(self) -> None:
        self._runner.masters_in()

    def _masters_out(self) -> None:
        self._runner.masters_out()

    def broadcast_from_rank0(self, module: torch.nn.Module) -> None:
        """Parameters were broadcast group by group while sharding; buffers (kept whole) are here."""
        for b in module.buffers():
            self.comm.broadcast(b, src=0)

    # ---------------------------------------------------------------- backward
    def backward_start(self, is_boundary: bool) -> None:
        # reduce-scatter at every micro-step (DeepSpeed's stage 3); offloaded: each boundary reduction to the host
        to_host = self._runner.to_host
        if to_host is not None:
            for g in self._trainable():
                g.grads_to_host = to_host if is_boundary and g.offload.offloads_optimizer else None
                g.on_host_queued = functools.partial(self._host_queued, g)
        self._runner.backward_start(is_boundary)
        self.coordinator.backward_start()

    def _host_queued(self, g: ParamGroup) -> None:
        """`g`'s gradient shard is on its way to the host: its optimizer pieces may be stepped early."""
        for _, tensor, _ in self._opt_pieces.get(id(g), ()):
            self._runner.host_copy_queued(tensor, 0, tensor.numel())

    def backward_end(self) -> None:
        self.coordinator.backward_end()

    def wait_gradients(self) -> None:
        self.coordinator.wait_reduces()

    def _check_module(self, module: torch.nn.Module) -> None:
        if not any(m is module for m in self.module.modules()):
            raise ValueError(f"ZeRO-3: the {type(module).__name__} passed is not a module of the model")

    def remove_hooks(self) -> None:
        """Finish the reductions and an overlapped step in flight, reshard what is unsharded, then remove
        the coordinator's forward and gradient hooks (engine.destroy)."""
        self.coordinator.wait_reduces()
        self.flush()
        self._unsharding.reshard()
        self.coordinator.remove_hooks()

    def _groups_under(self, module: torch.nn.Module | None) -> list[ParamGroup]:
        if module is None:
            return list(self.groups)
        self._check_module(module)
        wanted = set(self.coordinator.groups_used_under(module))
        wanted.update(st.group for p in module.parameters() if (st := param_state(p)) is not None)
        return [g for g in self.groups if g in wanted]

    # ---------------------------------------------------------------- step
    def _trainable(self) -> list[ParamGroup]:
        return [g for g in self.groups if g.trainable]

    def step(self, loss_scale: float | None, max_norm: float, check_overflow: bool | None = None) -> StepResult:
        """Unless some rank's gradient slice holds inf/nan: unscale, clip by the global norm, step the
        optimizer on the fp32 shards and write the lp shards (gathered groups are then re-gathered on
        use)."""
        self._unsharding.check_step()
        self.coordinator.wait_reduces()
        for g in self._trainable():  # a group no backward reached this step has zero gradients
            g.grad_buffers.ensure()
        return self._runner.step(loss_scale, max_norm, check_overflow)

    def _write_back(self) -> None:
        for g in self._trainable():
            if self._views.optimizer_writes_lowp:
                g.shard_changed()  # the optimizer wrote the lp shard itself
            else:
                g.copy_master_to_lp(self._lowp_writer)
        self.coordinator.release_all(force=True)
        self.coordinator.gather_persistent()

    def note_loss_scale(self, loss_scale: float | None) -> None:
        """The loss scale of the coming backward (the speculative offloaded step unscales with it)."""
        self._runner.note_loss_scale(loss_scale)

    def set_steps_per_epoch(self, n: int) -> None:
        """The training dataloader's length (ZenFlow's "epoch" selection counts in it)."""
        if self._runner.zenflow is not None:
            self._runner.zenflow.set_steps_per_epoch(n)

    def flush(self) -> None:
        """Finish an overlapped step still running and write its update into the lp shards."""
        self._runner.flush()

    def zero_grad(self) -> None:
        self._runner.zero_grad()
        for g in self._trainable():
            g.grad_buffers.release()  # zero until this group's next reduction brings them back
            for p in g.params:
                p.grad = None

    def use_placements(self, placements, topology) -> None:
        """Count the gradient norm over the mesh as `placements` say (zero/norm.py); this rank's
        fragments are disjoint over the group the strategy partitions over (dp x sp)."""
        trainable = self._trainable()
        for g in trainable:
            g.grad_buffers.ensure()  # the norm's views are cut from the gradient buffers
        try:
            grads = dict(self._views.opt_grads)
            for g in trainable:  # elements no optimizer group steps: the shard itself owns them (fragments())
                grads.setdefault(g.optimizer_shard, g.master_grad_shard)
            v = self._views
            grads = device_side(grads, v.master_grads, v.norm_grads)
            keyed = {name: self.reduce_groups.key(p) for name, p in self.module.named_parameters()}
            v.norm = NormPlan.build(self.fragments(), grads, placements, topology,
                                    lambda name: keyed.get(name) or dims_of("dp_sp"))
        finally:
            for g in trainable:
                g.grad_buffers.release()

    # ---------------------------------------------------------------- state
    def fragments(self) -> list[Fragment]:
        """The parts of each trainable parameter in this rank's shard of its group, owned by the
        optimizer's piece of that shard (the whole shard for parameters outside every optimizer group)."""
        self.flush()
        self._masters_in()  # NVMe: the fragments' owners are read (saved) or written (loaded) next
        out: list[Fragment] = []
        for g in self._trainable():
            pieces = list(self._opt_pieces.get(id(g), []))
            covered = sum(r.numel for r, _, _ in pieces)
            if covered < g.shard.numel:  # elements no optimizer group steps: the shard itself owns them
                stepped = [(r.start, r.end) for r, _, _ in pieces]
                pieces = [(r, t, o) for r, t, o in pieces] + [
                    (Range(a, b), g.optimizer_shard, a - g.shard.start)
                    for a, b in uncovered(g.shard, stepped)]
            for st in g.states:
                out.extend(range_fragments(st.name, tuple(st.shape), st.range, pieces))
        return out

    def state_dict(self) -> dict[str, Any]:
        """This rank's fp32 master slices and optimizer state, as fragments."""
        return self._runner.merge_state(fragments_state_dict(self.fragments(), self.optimizer, stage=3,
                                                             dp_world_size=self.comm.world_size, dp_rank=self.comm.rank))

    def masters_loaded(self) -> None:
        self._runner.masters_replaced()  # before the flush: the loaded masters replace the device part too
        self.flush()
        self._masters_in()
        for g in self.groups:
            g.copy_master_to_lp(self._lowp_writer)
        self.coordinator.release_all(force=True)
        self.coordinator.gather_persistent()
        self._masters_out()

    def masters_from_params(self) -> None:
        self.flush()
        self._masters_in()
        for g in self.groups:
            g.copy_lp_to_master()
        self._runner.masters_replaced()
        self.coordinator.release_all(force=True)
        self.coordinator.gather_persistent()
        self._masters_out()

    def _gathered_values(self) -> dict[int, torch.Tensor]:
        """id(param) -> its full value on the CPU, gathered one group at a time."""
        values: dict[int, torch.Tensor] = {}
        for g in self.groups:
            was_released = g.state == RELEASED
            g.pins += 1
            try:
                self.coordinator.fetch_now([g])
                for st in g.states:
                    values[id(st.param)] = g.views[st.index].to("cpu", copy=True)
            finally:
                g.pins -= 1
            if was_released:
                self.coordinator.release(g)
        return values

    def module_shapes(self) -> dict[str, tuple[int, ...]]:
        return module_shapes(self.module, lambda p: st.shape if (st := param_state(p)) is not None else None)

    def module_state_dict(self) -> dict[str, Any]:
        """The module's full state_dict on every rank (parameters gathered, as CPU tensors in the
        training dtype; tied names share one tensor). A collective: every rank must call it."""
        self.flush()
        state = self.module.state_dict()
        values = self._gathered_values()
        for name, p in self.module.named_parameters(remove_duplicate=False):
            if name in state and id(p) in values:
                state[name] = values[id(p)]
        return state

    def load_module_state_dict(self, state: dict[str, Any], strict: bool = True) -> None:
        """Scatter a full state_dict into the shards (each rank copies its slices; no communication)."""
        self.flush()
        self._masters_in()
        names: dict[int, list[str]] = {}
        for name, p in self.module.named_parameters(remove_duplicate=False):
            if param_state(p) is not None:
                names.setdefault(id(p), []).append(name)
        param_keys = {n for ns in names.values() for n in ns}
        result = self.module.load_state_dict({k: v for k, v in state.items() if k not in param_keys}, strict=False)
        missing = [k for k in result.missing_keys if k not in param_keys] + sorted(k for k in param_keys if k not in state)
        if strict and (missing or result.unexpected_keys):
            raise RuntimeError(f"Error(s) in loading state_dict for {type(self.module).__name__}: missing keys "
                               f"{missing}, unexpected keys {list(result.unexpected_keys)}")
        for g in self.groups:
            for st in g.states:
                value = next((state[n] for n in names.get(id(st.param), []) if n in state), None)
                if value is None:
                    continue
                if tuple(value.shape) != tuple(st.shape):
                    raise RuntimeError(f"size mismatch for {st.name}: copying a param with shape {tuple(value.shape)}"
                                       f", the shape in the current model is {tuple(st.shape)}")
                g.load_param(st.index, value)
            g.copy_lp_to_master()
        self.coordinator.release_all(force=True)
        self.coordinator.gather_persistent()
        self._masters_out()

    def memory_breakdown(self) -> dict[str, dict[str, int]]:
        """This rank's bytes by device and category (gathered buffers count while they are held)."""
        tally = MemoryTally(self._locate)
        for g in self.groups:
            g.add_to(tally)
        if self._runner.zenflow is not None:
            self._runner.zenflow.tally(tally)
        tally.add_optimizer_state(self.optimizer)
        return tally.bytes
