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

from lightspeed.checkpointing import apply_activation_checkpointing
from lightspeed.comm.topology import Topology
from lightspeed.parallel.autotp import tensor_parallel_transform
from lightspeed.sequence import apply_sequence_parallel

ModelTransform = Callable[[nn.Module, object, Topology], nn.Module]

# (name, transform), applied in this order; a feature joins the sequence at its place when it is built
TRANSFORMS: tuple[tuple[str, ModelTransform], ...] = (
    ("tensor_parallel", tensor_parallel_transform),
    ("sequence_parallel", apply_sequence_parallel),
    # DeepSpeed wraps no module for `activation_checkpointing`: the block configures checkpoint() over
    # the model-parallel group (see lightspeed/checkpointing/settings.py)
    ("activation_checkpointing", lambda model, cfg, topology: apply_activation_checkpointing(
        model, cfg, topology.as_mpu())),
)


def apply_model_transforms(model: nn.Module, cfg, topology: Topology,
                           transforms: tuple[tuple[str, ModelTransform], ...] = TRANSFORMS) -> nn.Module:
    """`model` after every transform of `transforms`, in order."""
    for _name, transform in transforms:
        model = transform(model, cfg, topology)
    return model


def tensor_parallel_sharded(model: nn.Module) -> set[str]:
    """The names of the parameters split over the tensor-parallel group, for the gradient norm
    (comm/topology.py's Note): those of layers split by tensor parallelism, except a row-parallel bias,
    and those a Megatron-style model marks as split (`tensor_model_parallel` or `model_parallel` true,
    read as DeepSpeed reads them)."""
    from lightspeed.parallel.tensor_parallel import tp_layouts

    names = {name for name, layout in tp_layouts(model).items() if layout.sharded}
    names |= {name for name, p in model.named_parameters()
              if getattr(p, "tensor_model_parallel", False) or getattr(p, "model_parallel", False)}
    return names
