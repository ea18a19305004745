"""The global gradient norm over the mesh, from the placements: which gradient elements this rank
counts, and the group its partial sum of squares is added over.

Owns: `NormPlan` and its construction from a strategy's fragments. Must not: compute the norm (the
step does, zero/sharded_step.py) or know a stage (the strategy says which mesh dims its own pieces are
disjoint over).

Note: [each element once] The global norm must count every element of the model once. A strategy's
fragments are disjoint over the dims it partitions over (`partitioned_over`: data parallelism x sp at
ZeRO 1-3; nothing at stage 0, whose ranks all hold the whole reduced gradients and agree without a
collective). A placement sharded over another dim (tp, later pp and ep) holds different elements on
each rank of it, so the partial squares are summed over the union of those dims and the partition's.
Along a dim of that union that a parameter is neither sharded nor partitioned over, its copies are
equal (a layer norm under tensor parallelism; a row-parallel bias): only the rank at coordinate 0
counts it (torchtitan's rule in `clip_grad_norm_`, Megatron's `param_is_not_tensor_parallel_duplicate`).
When no placement is sharded beyond the partition, there is no plan: the step's own agreement is the
whole sum, bit for bit what it was before placements.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch

from lightspeed.comm.codecs import AllReduce
from lightspeed.comm.collectives import Communicator
from lightspeed.comm.topology import Topology
from lightspeed.parallel.placement import PlacementTable
from lightspeed.zero.fragments import Fragment


@dataclass
class NormPlan:
    """The gradient views this rank counts (`counted`) and the all-reduce that sums their squares over
    every rank holding different elements (`all_reduce`, also used to agree the inf/nan decision)."""

    counted: list[torch.Tensor]
    all_reduce: AllReduce
    sum_dims: tuple[str, ...]

    @classmethod
    def build(cls, fragments: Iterable[Fragment], grads: Mapping[torch.Tensor, torch.Tensor],
              placements: PlacementTable, topology: Topology,
              partitioned_over: Iterable[str] | Callable[[str], Iterable[str]]) -> "NormPlan | None":
        """The plan for a strategy whose fragments are disjoint over `partitioned_over` (the same dims for
        every fragment, or a function of the parameter's name: a strategy keying its buffers by
        `reduced_over` partitions each key over its own group); `grads` maps each fragment's owner to
        the gradient laid out like it (what the norm reads). None when no placement is sharded beyond
        the partition and every fragment is partitioned alike (see the Note)."""
        fragments = list(fragments)
        wide_of = (lambda dims: {d for d in dims if topology.size_over((d,)) > 1})
        fixed = None if callable(partitioned_over) else frozenset(wide_of(partitioned_over))
        part_of = (lambda name: fixed) if fixed is not None else (lambda name: frozenset(wide_of(partitioned_over(name))))
        wide = wide_of(placements.sharded_dims())
        partitions = {part_of(f.name) for f in fragments} or {fixed or frozenset()}
        if len(partitions) == 1 and wide <= next(iter(partitions)):
            return None
        sum_dims = tuple(sorted(wide.union(*partitions)))
        coords = topology.coords()
        counted = []
        for fragment in fragments:
            if fragment.name not in placements:
                raise KeyError(f"gradient norm: no placement for {fragment.name}")
            equal_dims = [d for d in sum_dims if d not in part_of(fragment.name)]
            if placements[fragment.name].counts_on(coords, equal_dims):
                grad = grads.get(fragment.owner)
                if grad is None:
                    raise ValueError(f"gradient norm: no gradient for the optimizer tensor holding {fragment.name}")
                counted.append(grad.view(-1)[fragment.offset:fragment.offset + fragment.numel])
        comm = Communicator(topology.group_over(sum_dims), topology.size_over(sum_dims))
        return cls(counted, AllReduce(comm), sum_dims)


def device_side(grads: Mapping[torch.Tensor, torch.Tensor], master_grads: list[torch.Tensor],
                norm_grads: list[torch.Tensor] | None) -> dict[torch.Tensor, torch.Tensor]:
    """`grads` (owner -> a view into one of `master_grads`) with each view moved to the same place in the
    matching `norm_grads` entry: with the optimizer offloaded the norm reads the device gradients, while
    the owners' gradients are host copies (zero/sharded_step.py's ShardViews). `master_grads` must be
    allocated (host buffers always are)."""
    if norm_grads is None:
        return dict(grads)
    by_storage = {m.untyped_storage().data_ptr(): (m, n) for m, n in zip(master_grads, norm_grads) if m.numel()}
    out = {}
    for owner, grad in grads.items():
        found = by_storage.get(grad.untyped_storage().data_ptr())
        if found is None:
            raise ValueError("gradient norm: an optimizer gradient outside every master gradient buffer")
        master, device = found
        start = grad.storage_offset() - master.storage_offset()
        out[owner] = device.view(-1)[start:start + grad.numel()].view(grad.shape)
    return out
