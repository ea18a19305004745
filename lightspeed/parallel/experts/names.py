"""The names of a rank's expert state in a checkpoint: what a parameter (or buffer) of this rank's
experts is called in the whole model, the one with every expert on one rank (ep = 1).

Owns: `ExpertNames` (built by `expert_names` from a model whose experts are already split), which
renames state-dict keys between this rank's names and the whole model's, and says which keys are
expert state. Must not: read or write files, communicate, or place parameters (transform.py and
autoep.py do).

Note: [global names] A DeepSpeed-style `MoE` layer names its local experts
`<layer>.experts.deepspeed_experts.<i>.*` on every ep rank, so the same name means another expert on
each rank: local expert i of ep rank r is global expert g = r x num_local_experts + i
(transform.py's Note). A checkpoint names each expert by g (`.deepspeed_experts.<g>.*`): the names an
ep = 1 model has, so the tag loads at any ep size, and consolidates to the ep = 1 model's state
dict, without knowing the saving layout. AutoEP's fused experts (`<block>.experts.gate_up_proj`
[E_local, ...]) already have one name on every rank: their placements (autoep.py) put each rank's rows
into the whole [E, ...] tensor, which is what a checkpoint holds.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from lightspeed.parallel.experts.autoep_layer import EPExperts
from lightspeed.parallel.experts.transform import moe_layers
from lightspeed.parallel.placement import Placement


@dataclass(frozen=True)
class _DeepSpeedLayer:
    prefix: str  # "<layer>.experts.deepspeed_experts."
    num_local: int
    num_experts: int
    ep_rank: int


@dataclass(frozen=True)
class ExpertNames:
    """This rank's expert state names (the Note on global names). `fused`: the qualified names of the
    AutoEP experts modules (their keys need no renaming, only the placements' rows)."""

    layers: tuple[_DeepSpeedLayer, ...]
    fused: tuple[str, ...]

    def __bool__(self) -> bool:
        return bool(self.layers or self.fused)

    def _split(self, key: str) -> tuple[_DeepSpeedLayer, int, str] | None:
        for layer in self.layers:
            if key.startswith(layer.prefix):
                index, dot, rest = key[len(layer.prefix):].partition(".")
                if dot and index.isdigit():
                    return layer, int(index), rest
        return None

    def to_global(self, key: str, ep_rank: int | None = None) -> str:
        """The whole model's name of a key of this rank (or of ep rank `ep_rank`, whose keys are named
        alike); unchanged outside DeepSpeed-style experts."""
        found = self._split(key)
        if found is None:
            return key
        layer, i, rest = found
        return f"{layer.prefix}{(layer.ep_rank if ep_rank is None else ep_rank) * layer.num_local + i}.{rest}"

    def is_fused(self, key: str) -> bool:
        """Whether `key` is an AutoEP fused experts tensor (this rank's rows of the whole one)."""
        return any(key.startswith(f"{name}.") for name in self.fused)

    def to_local(self, key: str) -> str | None:
        """This rank's name of a whole model's key; None for another ep rank's expert (unchanged outside
        DeepSpeed-style experts). ValueError for an expert index past the layer's experts."""
        found = self._split(key)
        if found is None:
            return key
        layer, g, rest = found
        if g >= layer.num_experts:
            raise ValueError(f"{key}: expert {g} of a layer with {layer.num_experts} experts")
        rank, i = divmod(g, layer.num_local)
        return f"{layer.prefix}{i}.{rest}" if rank == layer.ep_rank else None

    def one_expert(self, key: str, placement: Placement) -> Placement:
        """The placement of a DeepSpeed-style expert parameter (its global name `key`; `placement`: in the
        layer's experts stacked along dim 0, transform.py's) within that one expert's whole tensor: the
        same boxes, less the expert's rows, the same mesh dims (a slice over tp stays one)."""
        layer, g, _rest = self._split(key)
        n0 = placement.global_shape[0] // layer.num_experts
        boxes = tuple(((box[0][0] - g * n0, box[0][1] - g * n0),) + tuple(box[1:]) for box in placement.boxes)
        return Placement(key, (n0,) + tuple(placement.global_shape[1:]), boxes, placement.sharded_over,
                         placement.reduced_over, placement.transposed)

    def is_expert(self, key: str) -> bool:
        """Whether `key` is expert state, each ep rank holding other experts under it."""
        return self._split(key) is not None or self.is_fused(key)


def expert_names(model: nn.Module, ep_rank: int) -> ExpertNames:
    """The `ExpertNames` of `model`'s experts on ep rank `ep_rank` (empty for a model without experts)."""
    layers = []
    for name, layer in moe_layers(model):
        prefix = f"{name}.experts.deepspeed_experts." if name else "experts.deepspeed_experts."
        layers.append(_DeepSpeedLayer(prefix, layer.num_local_experts, layer.ep_size * layer.num_local_experts,
                                      ep_rank))
    fused = tuple(name for name, module in model.named_modules() if isinstance(module, EPExperts))
    return ExpertNames(tuple(layers), fused)


__all__ = ["ExpertNames", "expert_names"]
