"""Ranks grouped by node, for ZeRO++'s hierarchical collectives (hpZ's partition groups, qgZ's two stages).

Owns: which ranks form a node group of a given size (consecutive ranks, DeepSpeed's
`_create_zero_param_parallel_group`: ranks [i * size, (i + 1) * size)) and which form the matching
cross-node groups (the ranks with the same index within their node), and building the process groups
of both once. Must not: decide what is sent over them (the collective objects do).

The rank lists are pure functions, so a topology mesh can take them over as its node dimension.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lightspeed.comm.collectives import Communicator
from lightspeed.config.errors import ConfigError


def node_ranks(world_size: int, node_size: int, key: str) -> list[list[int]]:
    """The rank lists of the node groups: `world_size / node_size` runs of `node_size` consecutive ranks.
    `key` names the setting that asked for them, in the error when `node_size` does not divide the world."""
    if node_size < 1 or world_size % node_size:
        raise ConfigError(f"{key}: {node_size} ranks per group must divide the data-parallel world size "
                          f"({world_size})")
    return [list(range(i * node_size, (i + 1) * node_size)) for i in range(world_size // node_size)]


def cross_node_ranks(world_size: int, node_size: int, key: str) -> list[list[int]]:
    """The rank lists of the cross-node groups: group l holds rank l of every node, in node order."""
    nodes = node_ranks(world_size, node_size, key)
    return [[node[local] for node in nodes] for local in range(node_size)]


def ranks_per_node(world_size: int) -> int:
    """Ranks on one machine: LOCAL_WORLD_SIZE (set by torchrun and the lightspeed launcher), else the
    number of visible GPUs (DeepSpeed's `device_count()`), else 1; at most the world size."""
    env = os.environ.get("LOCAL_WORLD_SIZE")
    if env is not None:
        local = int(env)
    elif torch.cuda.is_available():
        local = torch.cuda.device_count()
    else:
        local = 1
    return max(1, min(local, world_size))


@dataclass(frozen=True)
class NodeComms:
    """This rank's node group (`intra`) and cross-node group (`inter`), with `node_size` ranks per node;
    both count bytes into the data-parallel communicator's stats."""

    node_size: int
    intra: Communicator
    inter: Communicator

    @property
    def node_rank(self) -> int:
        """This rank's index within its node group."""
        return self.intra.rank

    @classmethod
    def build(cls, comm: Communicator, node_size: int, key: str) -> "NodeComms":
        """Every rank of `comm` must call this, with the same `node_size` (process groups are made
        collectively). `comm` must span the default group: node groups inside a data-parallel group of
        a model-parallel run are not built."""
        world = comm.world_size
        nodes = node_ranks(world, node_size, key)
        cross = cross_node_ranks(world, node_size, key)
        if world > 1 and comm.group is not None and dist.get_world_size() != world:
            raise NotImplementedError(f"{key}: node groups inside a data-parallel group smaller than the world "
                                      f"(a model-parallel mpu) are not implemented")
        rank = comm.rank
        intra = cls._group(comm, nodes, rank)
        inter = cls._group(comm, cross, rank)
        return cls(node_size, intra, inter)

    @staticmethod
    def _group(comm: Communicator, lists: list[list[int]], rank: int) -> Communicator:
        mine = next(ranks for ranks in lists if rank in ranks)
        if len(mine) == 1:
            return Communicator(None, world_size=1, stats=comm.stats)
        if len(mine) == comm.world_size:
            return Communicator(comm.group, world_size=comm.world_size, stats=comm.stats)
        group = None
        for ranks in lists:  # every rank creates every group, in the same order
            made = dist.new_group(ranks)
            if rank in ranks:
                group = made
        return Communicator(group, world_size=len(mine), stats=comm.stats)
