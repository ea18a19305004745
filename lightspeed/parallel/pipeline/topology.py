"""DeepSpeed's process topologies for pipeline training: named axes over the ranks, row-major with the
first axis outermost (`ProcessTopology`), and the two layouts DeepSpeed's pipeline users build,
`PipeDataParallelTopology` (pipe, data) and `PipeModelDataParallelTopology` (pipe, data, model).

Owns: the rank <-> coordinate arithmetic of these objects. Must not: create process groups
(lightspeed's mesh, comm/topology.py, does; its order pp, dp, tp is the same as these layouts').
"""

from __future__ import annotations

from collections import namedtuple
from itertools import product


class ProcessTopology:
    """Ranks laid out over `axes` of sizes `dims`, the first axis outermost (DeepSpeed's
    `deepspeed.runtime.pipe.topology.ProcessTopology`)."""

    def __init__(self, axes, dims):
        if len(axes) != len(dims):
            raise ValueError(f"ProcessTopology: {len(axes)} axes but {len(dims)} dims")
        self.axes = list(axes)
        self.dims = [int(d) for d in dims]
        self.ProcessCoord = namedtuple("ProcessCoord", self.axes)
        self.mapping = {}
        for rank, coord in enumerate(product(*(range(d) for d in self.dims))):
            self.mapping[self.ProcessCoord(*coord)] = rank

    def get_rank(self, **coord_kwargs) -> int:
        if len(coord_kwargs) != len(self.axes):
            raise ValueError("get_rank() does not support slices; give a coordinate on every axis")
        return self.mapping[self.ProcessCoord(**coord_kwargs)]

    def get_axis_names(self) -> list[str]:
        return list(self.axes)

    def get_rank_repr(self, rank, omit_axes=("data", "pipe"), inner_sep="_", outer_sep="-") -> str:
        coord = self.get_coord(rank)
        return outer_sep.join(f"{ax}{inner_sep}{getattr(coord, ax):02d}" for ax in self.axes if ax not in omit_axes)

    def get_dim(self, axis: str) -> int:
        return self.dims[self.axes.index(axis)] if axis in self.axes else 0

    def get_coord(self, rank: int):
        for coord, r in self.mapping.items():
            if r == rank:
                return coord
        raise ValueError(f"rank {rank} not found in the topology")

    def get_axis_comm_lists(self, axis: str) -> list[list[int]]:
        """The rank lists of every group along `axis` (the ranks differing only in it)."""
        if axis not in self.axes:
            return []
        others = [a for a in self.axes if a != axis]
        lists = []
        for coord in product(*(range(self.get_dim(a)) for a in others)):
            fixed = dict(zip(others, coord))
            lists.append([self.get_rank(**fixed, **{axis: i}) for i in range(self.get_dim(axis))])
        return lists

    def filter_match(self, **filter_kwargs) -> list[int]:
        """The ranks whose coordinates match every `axis=value` given."""
        return [r for c, r in self.mapping.items() if all(getattr(c, k) == v for k, v in filter_kwargs.items())]

    def get_axis_list(self, axis: str, idx: int) -> list[int]:
        """The ranks at coordinate `idx` along `axis`."""
        i = self.axes.index(axis)
        return [r for c, r in self.mapping.items() if c[i] == idx]

    def world_size(self) -> int:
        return len(self.mapping)

    def __str__(self) -> str:
        return str(self.mapping)


class PipeDataParallelTopology(ProcessTopology):
    """Pipeline and data parallelism: axes (pipe, data)."""

    def __init__(self, num_pp, num_dp):
        super().__init__(axes=["pipe", "data"], dims=[num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    """Pipeline, data and tensor ("model") parallelism: axes (pipe, data, model)."""

    def __init__(self, num_pp, num_mp, num_dp):
        super().__init__(axes=["pipe", "data", "model"], dims=[num_pp, num_dp, num_mp])
