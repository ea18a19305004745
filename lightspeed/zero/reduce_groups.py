"""Which group reduces each parameter's gradient and partitions its state: its placement's
`reduced_over` (parallel/placement.py), each such group with its own collective objects (Megatron's
buffer key: dense parameters in one set of buffers, expert parameters in another).

Owns: `ReduceGroups`, built once by `select_strategy` from the placements and handed to the strategy,
which keys its flat buffers (stages 0-2) or parameter groups (stage 3) by it. Must not: create
collectives other than through comm/ (`Collectives.default`), or know a stage.

Note: [the default key] Dense parameters are reduced over data parallelism x sp (comm/topology.py's
"dp_sp"), the group the strategy's own `comm` covers: they keep exactly the buffers, collectives and
order they had before placements. Only a parameter placed with another `reduced_over` (an expert,
reduced over the expert-data-parallel group "edp_sp") gets a key of its own. A run without such a
parameter has one key and behaves bit for bit as before.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from lightspeed.comm.codecs import Collectives
from lightspeed.comm.collectives import Communicator
from lightspeed.comm.topology import Topology, dims_of

Key = tuple[str, ...]


def default_key(topology: Topology | None = None) -> Key:
    """The dims dense parameters are reduced over: "dp_sp"'s, those of size > 1 in `topology`."""
    dims = dims_of("dp_sp")
    return dims if topology is None else tuple(d for d in dims if topology.size_over((d,)) > 1)


@dataclass
class ReduceGroups:
    """`default`: the strategy's own collectives (the dense key); `by_key`: the others; `key_of`:
    id(parameter) -> its key, for the parameters of another key only."""

    default: Collectives
    by_key: dict[Key, Collectives] = field(default_factory=dict)
    key_of: dict[int, Key] = field(default_factory=dict)

    @classmethod
    def single(cls, collectives: Collectives) -> "ReduceGroups":
        return cls(collectives)

    @classmethod
    def build(cls, module: torch.nn.Module, placements, topology: Topology | None,
              collectives: Collectives) -> "ReduceGroups":
        """The groups `placements` ask for; one key (the strategy's `collectives`) when every parameter
        is reduced over the data-parallel dims."""
        out = cls(collectives)
        if placements is None or topology is None:
            return out
        dense = default_key(topology)
        for name, p in module.named_parameters():
            placement = placements.get(name)
            if placement is None:
                continue
            key = tuple(d for d in dims_of("world") if d in placement.reduced_over and topology.size_over((d,)) > 1)
            if key == dense:
                continue
            if key not in out.by_key:
                out.by_key[key] = Collectives.default(Communicator(topology.group_over(key), topology.size_over(key)))
            out.key_of[id(p)] = key
        return out

    @property
    def keyed(self) -> bool:
        """Whether some parameter is reduced over another group than the strategy's own."""
        return bool(self.key_of)

    def key(self, param: torch.nn.Parameter) -> Key | None:
        """The parameter's key; None for the default (dense) one."""
        return self.key_of.get(id(param))

    def of(self, param: torch.nn.Parameter) -> Collectives:
        key = self.key_of.get(id(param))
        return self.default if key is None else self.by_key[key]

    def for_key(self, key: Key | None) -> Collectives:
        return self.default if key is None else self.by_key[key]

    def split(self, params: Iterable[torch.nn.Parameter]) -> list[tuple[Key | None, list[torch.nn.Parameter]]]:
        """`params` by key, in order of first appearance, the default key first (its buffers keep their
        place)."""
        order: dict[Key | None, list[torch.nn.Parameter]] = {None: []}
        for p in params:
            order.setdefault(self.key(p), []).append(p)
        return [(k, v) for k, v in order.items() if v]
