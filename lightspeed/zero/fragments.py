"""Fragments: how every ZeRO stage describes the training state it holds, in one vocabulary.

A fragment is a contiguous run of one parameter's elements that this rank keeps an fp32 master value
(and optimizer state) for: the parameter's name and shape, the element range of the flattened
parameter, and where those elements sit in the optimizer's tensor that holds them (the "owner": a
parameter's fp32 master view at stage 0, a flat master shard at stages 1-2, a piece of a group's shard
at stage 3). The optimizer state of the elements is `optimizer.state[owner][key]` at the same offsets.
Checkpoints save fragments and load them into any other set of fragments (`checkpoint/universal.py`),
so no code assumes how an earlier run was sharded. Must not: read or write files, or communicate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

from lightspeed.zero.partition import Range


@dataclass(frozen=True)
class Fragment:
    name: str  # the parameter's name in the module (its first name when tied)
    shape: tuple[int, ...]  # the whole parameter's shape
    start: int  # elements [start, end) of the flattened parameter held here
    end: int
    owner: torch.Tensor  # the optimizer's tensor holding these elements (fp32 master, or the fp32 param)
    offset: int  # position of element `start` in owner.view(-1)

    @property
    def numel(self) -> int:
        return self.end - self.start

    def master_view(self) -> torch.Tensor:
        """The fragment's fp32 values, a 1-D view into its owner."""
        return self.owner.view(-1)[self.offset:self.offset + self.numel]


def first_names(module: torch.nn.Module) -> dict[int, str]:
    """id(parameter) -> its first name in `module` (tied parameters keep the first one, as state_dict does)."""
    names: dict[int, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    return names


def range_fragments(name: str, shape: tuple[int, ...], param: Range, pieces: Iterable[tuple[Range, torch.Tensor, int]]):
    """Fragments of one parameter laid out at flat range `param`, for each (flat range, owner, owner
    offset of that range's start) this rank holds: the parts of the parameter inside them."""
    for held, owner, owner_offset in pieces:
        part = param.intersect(held)
        if part.numel:
            yield Fragment(name, tuple(shape), part.start - param.start, part.end - param.start, owner,
                           owner_offset + part.start - held.start)


def owner_groups(optimizer: torch.optim.Optimizer | None) -> dict[int, int]:
    """id(optimizer tensor) -> index of the optimizer param group that steps it."""
    if optimizer is None:
        return {}
    return {id(t): gi for gi, group in enumerate(optimizer.param_groups) for t in group["params"]}


def fragments_state_dict(fragments: list[Fragment], optimizer: torch.optim.Optimizer | None, *, stage: int,
                         dp_world_size: int, dp_rank: int) -> dict:
    """This rank's training state as plain data: each fragment as [name, shape, start, end, owner index,
    offset], the owners' fp32 values, each owner's optimizer state and group, and the groups'
    hyperparameters. What `checkpoint/universal.py` reads back into any other fragments."""
    owners: list[torch.Tensor] = []
    index: dict[int, int] = {}
    for f in fragments:
        if id(f.owner) not in index:
            index[id(f.owner)] = len(owners)
            owners.append(f.owner)
    groups = owner_groups(optimizer)
    state = [dict(optimizer.state.get(o, {})) if optimizer is not None else {} for o in owners]
    param_groups = ([{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
                    if optimizer is not None else [])
    return {"format": "fragments", "version": 1, "stage": stage, "dp_world_size": dp_world_size, "dp_rank": dp_rank,
            "fragments": [[f.name, list(f.shape), f.start, f.end, index[id(f.owner)], f.offset] for f in fragments],
            "owners": [o.detach() for o in owners], "owner_groups": [groups.get(id(o), -1) for o in owners],
            "state": state, "param_groups": param_groups}


def select_fragments(state: dict, keep) -> dict:
    """A `fragments_state_dict` holding only the fragments whose name `keep(name)` accepts, and the owners
    (with their optimizer state and group) those fragments lie in."""
    kept = [entry for entry in state["fragments"] if keep(entry[0])]
    used = sorted({entry[4] for entry in kept})
    index = {old: new for new, old in enumerate(used)}
    return {**state, "fragments": [[*entry[:4], index[entry[4]], entry[5]] for entry in kept],
            "owners": [state["owners"][i] for i in used], "owner_groups": [state["owner_groups"][i] for i in used],
            "state": [state["state"][i] for i in used]}


def module_shapes(module: torch.nn.Module, full_shape=None) -> dict[str, tuple[int, ...]]:
    """Name -> full shape of every entry of `module.state_dict()`; `full_shape(param)` gives a parameter's
    logical shape where the tensor itself is a placeholder (stage 3), or None to take the tensor's."""
    shapes = {k: tuple(v.shape) for k, v in module.state_dict(keep_vars=True).items()}
    if full_shape is not None:
        for name, p in module.named_parameters(remove_duplicate=False):
            shape = full_shape(p)
            if shape is not None and name in shapes:
                shapes[name] = tuple(shape)
    return shapes
