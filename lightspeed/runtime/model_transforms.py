"""The model transforms `initialize()` applies, in their one fixed order, before ZeRO takes the model.

Owns: the order. Each transform is a small function `transform(model, placements, cfg, topology) ->
(model, placements)` over an unchanged model, as torchtitan's `parallelize` functions are, and writes
where each parameter it changes lives on the mesh (parallel/placement.py; every parameter starts
replicated): tensor parallelism first (it decides which slice of each weight a rank keeps), then
sequence parallelism (it wraps attention over the sp group), then AutoEP (it swaps the experts of a
Hugging Face model's MoE blocks for this ep rank's share and places them), then expert parallelism (it
binds DeepSpeed MoE layers to the "ep" group and places their experts), then activation checkpointing (it wraps whole
blocks, which must already hold their parallel layers), and last ZeRO, which is not a module transform
here but the strategy `initialize()` selects over the transformed model's parameters, and which reads
the placements. Pipeline splits will join after expert parallelism. Must not: build an optimizer or
touch process groups other than through the `Topology` it is given.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from torch import nn

from lightspeed.checkpointing import apply_activation_checkpointing
from lightspeed.comm.collectives import Communicator
from lightspeed.comm.topology import Topology
from lightspeed.parallel.autotp import tensor_parallel_transform
from lightspeed.parallel.experts import expert_parallel_transform
from lightspeed.parallel.experts.autoep import autoep_transform
from lightspeed.parallel.placement import PlacementTable, tensor_parallel_placements
from lightspeed.sequence import apply_sequence_parallel
from lightspeed.zero.stage3.init_rows import replace_init_module

ModelTransform = Callable[[nn.Module, PlacementTable, object, Topology], tuple[nn.Module, PlacementTable]]


def zero_init_splitter(topology: Topology):
    """How AutoTP splits a layer partitioned by zero.Init on `topology`: each rank receives its slices
    through Init's groups, partitioned again over the ranks of its tp rank (zero/stage3/init_rows.py)."""
    dims = tuple(d for d in ("dp_replicate", "edp_shard", "ep", "sp") if topology.size_over((d,)) > 1)

    def partitioned(module, wanted, build):
        keep = Communicator(topology.group_over(dims), topology.size_over(dims)) if dims else Communicator(None, 1)
        return replace_init_module(module, wanted, build, keep)
    return partitioned


def _tensor_parallel(model, placements, cfg, topology):
    model = tensor_parallel_transform(model, cfg, topology, partitioned=zero_init_splitter(topology))
    # the split layers hold their layouts; a model split by its own (Megatron) layers marks its parameters
    placements = PlacementTable.for_module(model)
    return model, tensor_parallel_placements(model, placements, topology.rank("tp"), topology.size("tp"))


def _keeps_placements(transform):
    """A transform that changes no parameter's place (it wraps or configures modules only)."""
    return lambda model, placements, cfg, topology: (transform(model, cfg, topology), placements)


# (name, transform), applied in this order; a feature joins the sequence at its place when it is built
TRANSFORMS: tuple[tuple[str, ModelTransform], ...] = (
    ("tensor_parallel", _tensor_parallel),
    ("sequence_parallel", _keeps_placements(apply_sequence_parallel)),
    # experts partitioned by zero.Init give each rank its rows through Init's groups (zero/stage3/init_rows.py)
    ("autoep", functools.partial(autoep_transform, partitioned_experts=replace_init_module)),
    ("expert_parallel", expert_parallel_transform),
    # DeepSpeed wraps no module for `activation_checkpointing`: the block configures checkpoint() over
    # the model-parallel group (see lightspeed/checkpointing/settings.py)
    ("activation_checkpointing", _keeps_placements(lambda model, cfg, topology: apply_activation_checkpointing(
        model, cfg, topology.as_mpu()))),
)


def apply_model_transforms(model: nn.Module, cfg, topology: Topology,
                           transforms: tuple[tuple[str, ModelTransform], ...] = TRANSFORMS
                           ) -> tuple[nn.Module, PlacementTable]:
    """`model` after every transform of `transforms`, in order, and where each of its parameters lives."""
    placements = PlacementTable.for_module(model)
    for _name, transform in transforms:
        model, placements = transform(model, placements, cfg, topology)
    return model, placements.check(model)
