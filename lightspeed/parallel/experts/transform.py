"""The model transform for expert parallelism: find the model's MoE layers, bind each to the run's
"ep" group, and place every expert parameter on the mesh.

Owns: `expert_parallel_size` (the ep size a model's MoE layers ask for, read before the topology is
built), `expert_placements`, and `expert_parallel_transform` (runtime/model_transforms.py's step).
Must not: build groups (the Topology does) or move parameters.

Note: [expert placements] Local expert i of an MoE layer on ep rank r is global expert g = r x
num_local_experts + i. Each of its parameters is placed as one block of the experts' parameters
stacked along dim 0: global shape [num_experts x n0, ...] for a local [n0, ...], this rank's box the rows
[g x n0, (g + 1) x n0); `sharded_over=("ep",)` (the ep ranks hold different experts) and
`reduced_over=("dp_replicate", "edp_shard", "sp")` (the ranks holding the same experts and seeing
different tokens). The strategies reduce each expert gradient over that group, and the global gradient
norm counts each ep coordinate's experts once.

Note: [beside tensor parallelism] With tp > 1 (AutoTP or an mpu on the dense layers) and DeepSpeed's
default `enable_expert_tensor_parallelism=False`, the experts and the gate stay whole (AutoTP leaves every linear layer inside an MOELayer out of its plan:
`kept_whole_under_tp`): the tp ranks of a group hold the same experts, so "tp" is not in
`sharded_over` and the gradient norm counts one tp rank's copy. Each tp rank runs only its share of
the capacity slots (layer.py's Note on tensor parallelism), so its expert gradient is a partial one:
"tp" joins `reduced_over` (`expert_reduced_over`), and the strategies reduce and partition the experts
over the tp x expert-data-parallel ranks, which makes them equal again on every tp rank.

Note: [experts sliced over tp] With `enable_expert_tensor_parallelism=True` (layer.py's Note on expert
tensor parallelism) each expert parameter is this tp rank's slice of the expert's whole parameter
(tensor_parallel.py's layout; `tp_placement` gives its box in the whole one), and that box is shifted
by the expert's rows in the stack: `sharded_over=("ep", "tp")` and `reduced_over` the
expert-data-parallel dims only (every tp rank's gradient of its slice is whole already). The
row-parallel layer's bias is whole on every tp rank (its gradient too): sharded over ep only. The
gradient norm then counts each slice once. Experts split by the model's own (Megatron) layers are
refused.
"""

from __future__ import annotations

from torch import nn

from lightspeed.comm.topology import Topology
from lightspeed.parallel.experts.errors import MoEArgumentError
from lightspeed.parallel.experts.layer import MOELayer, bind_expert_group
from lightspeed.parallel.placement import Placement, PlacementTable, tp_placement
from lightspeed.parallel.tensor_parallel import tp_layouts

EXPERT_DATA_PARALLEL = ("dp_replicate", "edp_shard", "sp")  # comm/topology.py's "edp_sp"


def moe_layers(model: nn.Module) -> list[tuple[str, MOELayer]]:
    """(qualified name, layer) of every MOELayer in `model`, in module order."""
    return [(name, module) for name, module in model.named_modules() if isinstance(module, MOELayer)]


def expert_parallel_size(model: nn.Module) -> int:
    """The expert-parallel size `model`'s MoE layers ask for (1 without any); every layer must agree."""
    sizes = {}
    for name, layer in moe_layers(model):
        sizes.setdefault(layer.ep_size, name)
    if len(sizes) > 1:
        named = ", ".join(f"{where or '<model>'} ep_size={size}" for size, where in sorted(sizes.items()))
        raise MoEArgumentError(f"MoE layers with different ep_size ({named}): lightspeed builds one expert-parallel "
                               "group per run, so every MoE layer of a model needs the same ep_size")
    return next(iter(sizes), 1)


def expert_reduced_over(topology: Topology, sliced: bool = False) -> tuple[str, ...]:
    """The dims an expert's gradient is reduced over: the expert-data-parallel ones, and tp when the
    dense layers are tensor-parallel and the experts whole (the Note beside tensor parallelism; not
    when they are `sliced` over tp: the Note on experts sliced over tp)."""
    return EXPERT_DATA_PARALLEL + (("tp",) if topology.size("tp") > 1 and not sliced else ())


def kept_whole_under_tp(model: nn.Module) -> list[str]:
    """The names of the modules AutoTP must leave whole: every MOELayer (its gate and experts)."""
    return [name for name, _layer in moe_layers(model)]


def expert_placements(model: nn.Module, topology: Topology) -> list[Placement]:
    """The placement of every expert parameter of `model` (the Note on expert placements)."""
    ep_rank, tp_rank = topology.rank("ep"), topology.rank("tp")
    out = []
    for prefix, layer in moe_layers(model):
        total = layer.ep_size * layer.num_local_experts
        sliced = layer.expert_tensor_parallel and layer.tp_size > 1
        reduced_over = expert_reduced_over(topology, sliced)
        for i, expert in enumerate(layer.experts.deepspeed_experts):
            g = ep_rank * layer.num_local_experts + i
            base = f"{prefix}.experts.deepspeed_experts.{i}" if prefix else f"experts.deepspeed_experts.{i}"
            layouts = tp_layouts(expert) if sliced else {}
            for pname, p in expert.named_parameters():
                if p.dim() == 0:
                    raise NotImplementedError(f"expert parallelism: the expert parameter {base}.{pname} is a scalar; "
                                              "only parameters with at least one dimension can be placed")
                layout = layouts.get(pname)
                if layout is not None and layout.sharded:  # its box in the expert's whole parameter
                    whole = tp_placement(pname, layout, tp_rank)
                    dims = ("ep", "tp")
                else:  # whole on every tp rank (a row-parallel bias, or no slicing)
                    whole = Placement.replicated(pname, layout.full_shape if layout is not None else p.shape)
                    dims = ("ep",)
                within = whole.boxes
                n0 = whole.global_shape[0]
                shape = (total * n0,) + tuple(whole.global_shape[1:])
                boxes = tuple(((box[0][0] + g * n0, box[0][1] + g * n0),) + tuple(box[1:]) for box in within)
                out.append(Placement(f"{base}.{pname}", shape, boxes, dims, reduced_over, whole.transposed))
    return out


def expert_parallel_transform(model: nn.Module, placements: PlacementTable, cfg, topology: Topology
                              ) -> tuple[nn.Module, PlacementTable]:
    """Bind the MoE layers of `model` to `topology`'s "ep" group and place their experts; a model
    without MoE layers passes unchanged."""
    layers = moe_layers(model)
    if not layers:
        return model, placements
    for name, layer in layers:
        for pname, _ in layer.named_parameters():
            placement = placements.get(f"{name}.{pname}" if name else pname)
            if placement is not None and "tp" in placement.sharded_over:  # a Megatron model's own split
                raise NotImplementedError(f"MoE layer {name or '<model>'}: its parameter {pname} is split over the "
                                          "tensor-parallel group by the model's own layers; such experts and gates are "
                                          "not implemented (MoE(enable_expert_tensor_parallelism=True) with experts "
                                          "of plain nn.Linear layers has lightspeed slice them)")
        bind_expert_group(layer, topology)
    placed = expert_placements(model, topology)
    tied = [p.name for p in placed if p.name not in placements]  # placements name a tied parameter once
    if tied:
        raise NotImplementedError(f"expert parallelism: the expert parameter {tied[0]} is tied to a parameter "
                                  "named before it; experts sharing weights with other modules are not supported")
    return model, placements.placed(placed)
