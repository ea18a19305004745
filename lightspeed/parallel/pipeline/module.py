"""DeepSpeed's `PipelineModule`: a model given as a sequence of layers, of which each pipeline rank
builds and runs only its own contiguous ranges (its stages).

Owns: the layer list and its partition over the stages (partition.py), building the local layers
(`LayerSpec`s are built only where they run), the tied modules, running a range of layers
(activation checkpointing every `activation_checkpoint_interval` layers, per-layer seeds), the
chunk modules a pipeline schedule drives (one per local stage), and the placements the split
writes. Must not: communicate (the schedule driver, schedule.py, and the engine do), or know ZeRO.

Note: [names] As in DeepSpeed, layer i's module is registered under the name `str(i)` (its global
index), so a parameter keeps its name, and its checkpoint key, whatever stage holds it and however
many stages there are; tied modules live under `tied_modules.<key>`.

Note: [stages and chunks] The layers are partitioned into `num_stages * virtual_stages` stages
(`virtual_stages` > 1 for the interleaved and zero-bubble schedules, lightspeed's `pipeline`
config keys); pipeline rank r holds stages r, r + P, ... ("loop" order) or r and 2P - 1 - r ("v"
order, the ZBV schedule's). Each local stage is a `StageChunk`: an nn.Module over the same layer
objects (so the schedule's stage sees its parameters), not registered under the PipelineModule (so
the state_dict names every parameter once).

Note: [seeding] With `seed_layers`, every layer of every micro-batch's forward calls the seed
function (`torch.manual_seed` by default). torch's `manual_seed` queues the seed for each device
kind not yet initialized (CUDA, XPU, MTIA on a CPU run; XPU, MTIA on a CUDA one) together with the
formatted Python stack of the call, so its cost grows with the depth of the stack it is called
from: about 40 us per frame on a 2-core CPU, next to a tiny layer's compute. The layer loop
therefore runs in `run_layers`' own frame, without helper or closure frames, unless activation
checkpointing needs the closure.

Note: [tied modules] A tied module is built on every stage, also where no layer uses it: its
gradient is then zero there, and its placement is reduced over data parallelism x pp (the ZeRO
strategy sums the stages' gradients, partitions its state over that group and counts it once in
the norm), which needs every pp rank in the group. DeepSpeed instead all-reduces the gradients
over the stages that use the module; the sum is the same.

Note: [forward brackets] A schedule calls the stage chunks, never the PipelineModule itself, so
whatever a strategy runs around a call of the whole model must run around each chunk's layers: the
engine replaces each chunk's `run_layers` with its strategy's `forward_method` of the owner's (ZeRO-3:
the root's forward hooks around the layers, coordinator.py's Note on other forward methods). And
`holds_layers` tells ZeRO-3's unit rule that the layers registered directly on this module are its
units, each gathered around its own forward and backward (zero/stage3/units.py's Note), as the blocks
of a ModuleList are: no layer's parameters depend on a hook of the module, which never runs here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

import torch

from lightspeed._utils.logging import get_logger
from lightspeed.comm import api as comm_api
from lightspeed.parallel.pipeline.partition import partition_layers
from lightspeed.parallel.pipeline.spec import LayerSpec, TiedLayerSpec
from lightspeed.parallel.pipeline.topology import PipeDataParallelTopology, ProcessTopology
from lightspeed.parallel.placement import Placement, PlacementTable

logger = get_logger(__name__)

ORDERS = ("loop", "v")


def _seed(seed: int, seed_fn: Callable | None) -> None:
    if seed_fn is not None:
        seed_fn(seed)
    else:
        torch.manual_seed(seed)


def _type_name(layer) -> str | None:
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    if isinstance(layer, torch.nn.Module):
        return type(layer).__name__
    return getattr(layer, "__name__", None)


def _trainable_count(layer) -> int:
    if isinstance(layer, LayerSpec):
        layer = layer.build()
    if isinstance(layer, torch.nn.Module):
        return sum(p.numel() for p in layer.parameters() if p.requires_grad)
    return 0


def stage_indices(pp_rank: int, pp_size: int, virtual_stages: int, order: str) -> list[int]:
    """The stages pipeline rank `pp_rank` holds, in schedule order (see the Note on stages)."""
    if order == "v":
        if virtual_stages != 2:
            raise ValueError(f"the 'v' stage order holds two stages per rank (got virtual_stages={virtual_stages})")
        return [pp_rank, 2 * pp_size - 1 - pp_rank]
    return [pp_rank + v * pp_size for v in range(virtual_stages)]


def _as_stage_output(out):
    """What a stage hands to the next one: a tensor or a tuple of tensors (a list becomes a tuple)."""
    if isinstance(out, list):
        out = tuple(out)
    if isinstance(out, tuple):
        bad = [type(t).__name__ for t in out if not torch.is_tensor(t)]
        if bad:
            raise TypeError(f"a pipeline stage's output must be a tensor or a tuple of tensors (got a tuple holding "
                            f"{bad[0]})")
    elif not torch.is_tensor(out):
        raise TypeError(f"a pipeline stage's output must be a tensor or a tuple of tensors (got {type(out).__name__})")
    return out


class StageChunk(torch.nn.Module):
    """One stage's layers `[start, stop)` as a module (see the Note on stages). Its input is what the
    previous stage sent, or, for the first stage, the index of a micro-batch in `inputs` (set by the
    schedule driver before each batch)."""

    def __init__(self, owner: "PipelineModule", stage: int, start: int, stop: int):
        super().__init__()
        self.stage, self.start, self.stop = stage, start, stop
        self._owner = [owner]  # not a submodule: the chunk sits beside the module, not under it
        for idx in range(start, stop):
            module = owner._modules.get(str(idx))
            if module is not None:
                self.add_module(str(idx), module)
        used = {owner._layer_specs[i].key for i in range(start, stop) if isinstance(owner._layer_specs[i], TiedLayerSpec)}
        if used:
            self.tied_modules = torch.nn.ModuleDict({k: owner.tied_modules[k] for k in sorted(used)})
        self.inputs: list | None = None
        # what runs the layers: the owner's `run_layers`, or a wrapper of it the engine sets (the Note on
        # forward brackets)
        self.run_layers: Callable = owner.run_layers

    def forward(self, *received):
        x = received[0] if len(received) == 1 else received
        if self.inputs is not None:
            x = self.inputs[int(x.reshape(-1)[0])]
        return _as_stage_output(self.run_layers(self.start, self.stop, x))


class PipelineModule(torch.nn.Module):
    """DeepSpeed's `deepspeed.pipe.PipelineModule` (same arguments and meaning). `forward(x)` runs the
    local layers in order, as DeepSpeed's; `initialize()` trains it with a pipeline schedule
    (`engine.train_batch`)."""

    holds_layers = True  # its children are its layers, run one after another (the Note on forward brackets)

    def __init__(self, layers: Iterable, num_stages: int | None = None, topology: ProcessTopology | None = None,
                 loss_fn: Callable | None = None, seed_layers: bool = False, seed_fn: Callable | None = None,
                 base_seed: int = 1234, partition_method: str = "parameters", activation_checkpoint_interval: int = 0,
                 activation_checkpoint_func: Callable | None = None, checkpointable_layers: list | None = None,
                 dynamic_shape: bool = False):
        super().__init__()
        if num_stages is None and topology is None:
            raise RuntimeError("PipelineModule: must provide num_stages or topology")
        if dynamic_shape:
            raise NotImplementedError("PipelineModule(dynamic_shape=True): activations whose shape changes between "
                                      "batches are not implemented; pad the batches to one shape")
        if checkpointable_layers is not None and not isinstance(checkpointable_layers, list):
            raise TypeError("PipelineModule: checkpointable_layers must be a list of layer class names")
        self.global_rank = comm_api.get_rank() if comm_api.is_initialized() else 0
        self.world_size = comm_api.get_world_size() if comm_api.is_initialized() else 1
        if topology is None:
            if self.world_size % num_stages:
                raise RuntimeError(f"PipelineModule: num_stages ({num_stages}) must divide the world size "
                                   f"({self.world_size})")
            topology = PipeDataParallelTopology(num_pp=num_stages, num_dp=self.world_size // num_stages)
        elif topology.world_size() != self.world_size:
            raise RuntimeError(f"PipelineModule: the topology holds {topology.world_size()} ranks, the world "
                               f"{self.world_size}")
        self._topo = topology
        self.num_stages = topology.get_dim("pipe")
        if num_stages is not None and num_stages != self.num_stages:
            raise RuntimeError(f"PipelineModule: num_stages={num_stages} but the topology has {self.num_stages} "
                               "pipe stages")
        self.stage_id = topology.get_coord(self.global_rank).pipe
        self.loss_fn = loss_fn
        self.seed_layers, self.seed_fn, self.base_seed = seed_layers, seed_fn, base_seed
        self.partition_method = partition_method
        self.activation_checkpoint_interval = int(activation_checkpoint_interval)
        self.activation_checkpoint_func = activation_checkpoint_func or functools.partial(
            torch.utils.checkpoint.checkpoint, use_reentrant=False)
        self.checkpointable_layers = checkpointable_layers
        if isinstance(layers, torch.nn.Sequential):
            layers = list(layers.children())
        self._layer_specs = list(layers)
        self._num_layers = len(self._layer_specs)
        self._funcs: dict[int, Callable] = {}
        self.tied_modules = torch.nn.ModuleDict()
        self.tied_weight_attrs: dict[str, list[str]] = {}
        self.micro_offset = 0
        self.virtual_stages, self.stage_order = 1, "loop"
        self.parts = self._partition(self.num_stages)
        self.chunks: list[StageChunk] = []
        self._build([self.stage_id])

    # ------------------------------------------------------------------ partition and build
    def _partition(self, num_parts: int) -> list[int]:
        counts = [_trainable_count(layer) for layer in self._layer_specs] \
            if self.partition_method.lower() == "parameters" else [0] * self._num_layers
        try:
            return partition_layers(self.partition_method, counts, [_type_name(x) for x in self._layer_specs], num_parts)
        except ValueError as err:
            raise NotImplementedError(f"PipelineModule: {err}") from None

    def _ranges(self, stages: list[int]) -> list[tuple[int, int]]:
        return [(self.parts[s], self.parts[s + 1]) for s in stages]

    def _build(self, stages: list[int]) -> None:
        """Build (or keep) the layers of `stages` and drop every other; tied modules on every stage."""
        wanted = [i for a, b in self._ranges(stages) for i in range(a, b)]
        for name in [n for n in self._modules if n.isdigit() and int(n) not in wanted]:
            del self._modules[name]
        self._funcs = {i: f for i, f in self._funcs.items() if i in wanted}
        first_use = {}
        for idx, layer in enumerate(self._layer_specs):
            if isinstance(layer, TiedLayerSpec):
                first_use.setdefault(layer.key, idx)
        for idx in sorted(wanted):
            layer = self._layer_specs[idx]
            if isinstance(layer, TiedLayerSpec):
                self._build_tied(layer, idx)
                module = self.tied_modules[layer.key]
                self._funcs[idx] = module if layer.forward_fn is None else functools.partial(layer.forward_fn, module)
                continue
            if idx in self._funcs:
                continue
            if isinstance(layer, PipelineModule):
                raise NotImplementedError("PipelineModule: a PipelineModule inside another is not implemented")
            if isinstance(layer, LayerSpec):
                if self.seed_layers:
                    _seed(self.base_seed + idx, self.seed_fn)
                layer = layer.build()
            if isinstance(layer, torch.nn.Module):
                self.add_module(str(idx), layer)
            elif not callable(layer):
                raise TypeError(f"PipelineModule: layer {idx} is a {type(layer).__name__}, not a module, LayerSpec or "
                                "callable")
            self._funcs[idx] = layer
        for key, idx in first_use.items():  # the tied modules no local layer uses (the Note on tied modules)
            self._build_tied(self._layer_specs[idx], idx)
        self.chunks = [StageChunk(self, s, a, b) for s, (a, b) in zip(stages, self._ranges(stages))]
        for p in self.parameters():
            p.ds_pipe_replicated = False

    def _build_tied(self, spec: TiedLayerSpec, idx: int) -> None:
        if spec.key in self.tied_modules:
            return
        if self.seed_layers:
            _seed(self.base_seed + idx, self.seed_fn)
        self.tied_modules[spec.key] = spec.build()
        self.tied_weight_attrs[spec.key] = spec.tied_weight_attr

    def set_virtual_stages(self, pp_rank: int, pp_size: int, virtual_stages: int, order: str) -> bool:
        """Repartition into `pp_size * virtual_stages` stages, this rank holding those of `order`; True
        when the local layers changed (parameters were built or dropped)."""
        if order not in ORDERS:
            raise ValueError(f"stage order {order!r}: expected one of {ORDERS}")
        stages = stage_indices(pp_rank, pp_size, virtual_stages, order)
        before = self._ranges([c.stage for c in self.chunks]) if self.chunks else []
        self.virtual_stages, self.stage_order = virtual_stages, order
        self.parts = self._partition(pp_size * virtual_stages)
        if self._ranges(stages) == before and virtual_stages == 1:
            return False
        kept = set(self._funcs)
        self._build(stages)
        return set(self._funcs) != kept

    # ------------------------------------------------------------------ running
    def _is_checkpointable(self, funcs: list) -> bool:
        if type(self).__name__ in ("GPTModelPipe", "GPT2ModelPipe"):
            return all("ParallelTransformerLayerPipe" in type(f).__name__ for f in funcs)
        if self.checkpointable_layers is not None:
            return all(type(f).__name__ in self.checkpointable_layers for f in funcs)
        return any(isinstance(f, torch.nn.Module) and any(True for _ in f.parameters()) for f in funcs)

    def run_layers(self, start: int, stop: int, x):
        """Layers `[start, stop)` on `x` (each layer's output is the next one's input), with activation
        checkpointing every `activation_checkpoint_interval` layers as DeepSpeed's forward."""
        self.micro_offset += 1
        offset = self.micro_offset + 1
        seed_fn = (torch.manual_seed if self.seed_fn is None else self.seed_fn) if self.seed_layers else None
        interval = self.activation_checkpoint_interval
        if interval <= 0 or not torch.is_grad_enabled():  # in this frame, no closure (the Note on seeding)
            for idx in range(start, stop):
                if seed_fn is not None:
                    seed_fn(self.base_seed * offset + idx)
                x = self._funcs[idx](x)
            return x
        indices = list(range(start, stop))

        def run(lo: int, hi: int):
            def body(*inputs):
                y = inputs[0] if len(inputs) == 1 else inputs
                for idx in indices[lo:hi]:
                    if seed_fn is not None:
                        seed_fn(self.base_seed * offset + idx)
                    y = self._funcs[idx](y)
                return y
            return body

        for lo in range(0, len(indices), interval):
            hi = min(lo + interval, len(indices))
            args = x if isinstance(x, tuple) else (x,)
            if self._is_checkpointable([self._funcs[i] for i in indices[lo:hi]]):
                x = self.activation_checkpoint_func(run(lo, hi), *args)
            else:
                x = run(lo, hi)(*args)
        return x

    def forward(self, forward_input):
        """The local stages' layers in order (DeepSpeed's `PipelineModule.forward`)."""
        x = forward_input
        for chunk in self.chunks:
            x = self.run_layers(chunk.start, chunk.stop, x)
        return x

    # ------------------------------------------------------------------ DeepSpeed's queries
    def partitions(self) -> list[int]:
        return self.parts

    def stage_owner(self, layer_idx: int) -> int:
        if not 0 <= layer_idx < self._num_layers:
            raise ValueError(f"layer {layer_idx} outside 0..{self._num_layers - 1}")
        for stage in range(len(self.parts) - 1):
            if self.parts[stage] <= layer_idx < self.parts[stage + 1]:
                return stage
        raise RuntimeError(f"layer {layer_idx} not owned (parts={self.parts})")

    def topology(self) -> ProcessTopology:
        return self._topo

    def mpu(self):
        """DeepSpeed's grid of this module's topology (`PipelineParallelGrid`; built on first call, a
        collective: every rank calls it)."""
        if getattr(self, "_grid", None) is None:
            from lightspeed.parallel.pipeline.grid import PipelineParallelGrid

            self._grid = PipelineParallelGrid(self._topo)
        return self._grid

    def num_pipeline_stages(self) -> int:
        return self.num_stages

    def set_checkpoint_interval(self, interval: int) -> None:
        if interval < 0:
            raise ValueError("activation checkpoint interval must be >= 0")
        self.activation_checkpoint_interval = interval

    def local_layer_indices(self) -> list[int]:
        return sorted(self._funcs)

    def tied_parameter_names(self) -> set[str]:
        return {f"tied_modules.{name}" for name, _ in self.tied_modules.named_parameters()}

    # ------------------------------------------------------------------ placements
    def placements(self, table: PlacementTable, pp_size: int) -> PlacementTable:
        """`table` with the split written (pp > 1): a layer's parameters are sharded over pp (each stage
        holds other layers); a tied module's are reduced over pp as well as data parallelism (the Note
        on tied modules)."""
        if pp_size == 1:
            return table
        tied = self.tied_parameter_names()
        placed = []
        for name, p in table.items():
            if name in tied:
                placed.append(Placement(name, p.global_shape, p.boxes, p.sharded_over,
                                        tuple(p.reduced_over) + ("pp",), p.transposed))
            else:
                placed.append(Placement(name, p.global_shape, p.boxes, tuple(p.sharded_over) + ("pp",),
                                        p.reduced_over, p.transposed))
        out = table.placed(placed)
        out.split_over = tuple(sorted(set(out.split_over) | {"pp"}))
        return out
