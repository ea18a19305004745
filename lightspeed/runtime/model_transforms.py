"""The model transforms `initialize()` applies, in their one fixed order, before ZeRO takes the model.

Owns: the order. Each transform is a small function `transform(model, cfg, topology) -> model` over an
unchanged model, as torchtitan's `parallelize` functions are: tensor parallelism first (it decides
which slice of each weight a rank keeps), then sequence parallelism (it wraps attention over the sp
group), then activation checkpointing (it wraps whole blocks, which must already hold their parallel
layers), and last ZeRO, which is not a module transform here but the strategy `initialize()` selects
over the transformed model's parameters. Must not: build an optimizer or touch process groups other
than through the `Topology` it is given.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from lightspeed.comm.topology import Topology
from lightspeed.sequence import apply_sequence_parallel

ModelTransform = Callable[[nn.Module, object, Topology], nn.Module]

# (name, transform), applied in this order; a feature joins the sequence at its place when it is built
TRANSFORMS: tuple[tuple[str, ModelTransform], ...] = (
    ("sequence_parallel", apply_sequence_parallel),
)


def apply_model_transforms(model: nn.Module, cfg, topology: Topology,
                           transforms: tuple[tuple[str, ModelTransform], ...] = TRANSFORMS) -> nn.Module:
    """`model` after every transform of `transforms`, in order."""
    for _name, transform in transforms:
        model = transform(model, cfg, topology)
    return model
