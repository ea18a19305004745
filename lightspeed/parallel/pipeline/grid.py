"""DeepSpeed's `PipelineParallelGrid`: the process groups of a pipe / data / model topology, answered by
lightspeed's mesh (comm/topology.py), whose pp, dp, tp order is the topology's.

Owns: the grid's rank queries and groups under DeepSpeed's names, and its default split of a world
into pipe x data (`_prime_factors`). Must not: build groups other than through the mesh.
"""

from __future__ import annotations

from lightspeed.comm import api as comm_api
from lightspeed.comm.topology import Topology
from lightspeed.parallel.pipeline.topology import PipeDataParallelTopology, ProcessTopology


def _prime_factors(n: int) -> list[int]:
    """The prime factorization of a positive integer, ascending."""
    if n <= 0:
        raise ValueError("Values must be strictly positive.")
    primes, p = [], 2
    while n != 1:
        while n % p:
            p += 1
        primes.append(p)
        n //= p
    return primes


class PipelineParallelGrid:
    """The groups of `topology` (default: the world split into pipe x data, alternating its prime
    factors as DeepSpeed does). Every rank must construct it (a collective: the groups are built)."""

    def __init__(self, topology: ProcessTopology | None = None, process_group=None):
        self.global_rank = comm_api.get_rank() if comm_api.is_initialized() else 0
        self.world_size = comm_api.get_world_size() if comm_api.is_initialized() else 1
        if topology is None:
            pp = dp = 1
            for i, prime in enumerate(_prime_factors(self.world_size)):
                if i % 2 == 0:
                    pp *= prime
                else:
                    dp *= prime
            topology = PipeDataParallelTopology(num_pp=pp, num_dp=dp)
        axes = topology.get_axis_names()
        if [a for a in ("pipe", "data", "model") if a in axes] != axes:
            raise NotImplementedError(f"PipelineParallelGrid over axes {axes}: only pipe, data and model, in that "
                                      "order, are implemented")
        self._topo = topology
        if not self._is_grid_valid():
            raise AssertionError("Invalid Grid")
        self.data_parallel_size = max(topology.get_dim("data"), 1)
        self.pipe_parallel_size = max(topology.get_dim("pipe"), 1)
        self.model_parallel_size = max(topology.get_dim("model"), 1)
        self.slice_parallel_size = self.model_parallel_size
        self._mesh = Topology.build(tp=self.model_parallel_size, pp=self.pipe_parallel_size)
        coord = topology.get_coord(self.global_rank)
        self.stage_id = coord.pipe
        self.data_parallel_id = getattr(coord, "data", 0)
        self.is_first_stage = self.stage_id == 0
        self.is_last_stage = self.stage_id == self.pipe_parallel_size - 1
        self.pp_group = self._ranks(("pp",))
        self.dp_group = self._ranks(("dp_replicate", "edp_shard", "ep"))
        self.slice_group = self._ranks(("tp",))
        self.p2p_groups = self._build_p2p_groups()

    def _is_grid_valid(self) -> bool:
        """Whether the topology holds exactly the world's ranks."""
        return self._topo.world_size() == self.world_size

    def _ranks(self, dims) -> list[int]:
        return self._mesh.shape.ranks_over(dims, self.global_rank)

    def _build_p2p_groups(self) -> list[list[int]]:
        """[rank, its next stage's rank] for every rank of the world (the last stage wraps to the first)."""
        out = []
        for rank in range(self.world_size):
            pipe = self._mesh.shape.ranks_over(("pp",), rank)
            out.append([rank, pipe[(pipe.index(rank) + 1) % len(pipe)]])
        return out

    def stage_to_global(self, stage_id: int, **kwargs) -> int:
        me = self._topo.get_coord(self.global_rank)
        return self._topo.get_rank(**me._replace(pipe=stage_id, **kwargs)._asdict())

    def topology(self) -> ProcessTopology:
        return self._topo

    def get_global_rank(self) -> int:
        return self.global_rank

    def get_stage_id(self) -> int:
        return self.stage_id

    def get_data_parallel_id(self) -> int:
        return self.data_parallel_id

    def get_pipe_parallel_rank(self) -> int:
        return self.stage_id

    def get_pipe_parallel_world_size(self) -> int:
        return self.pipe_parallel_size

    def get_pipe_parallel_group(self):
        return self._mesh.group("pp")

    get_pipeline_model_parallel_rank = get_pipe_parallel_rank
    get_pipeline_model_parallel_world_size = get_pipe_parallel_world_size

    def get_data_parallel_rank(self) -> int:
        return self.data_parallel_id

    def get_data_parallel_world_size(self) -> int:
        return self.data_parallel_size

    def get_data_parallel_group(self):
        return self._mesh.group("dp")

    def get_data_parallel_group_ranks(self) -> list[int]:
        return self.dp_group

    def get_model_parallel_rank(self) -> int:
        """This rank's place among the ranks of its data-parallel index (pipe x model), DeepSpeed's
        "model parallel" group of a grid."""
        return self._ranks(("pp", "tp")).index(self.global_rank)

    def get_model_parallel_world_size(self) -> int:
        return self.pipe_parallel_size * self.model_parallel_size

    def get_model_parallel_group(self):
        return self._mesh.group_over(("pp", "tp"))

    def get_slice_parallel_rank(self) -> int:
        return getattr(self._topo.get_coord(self.global_rank), "model", 0)

    def get_slice_parallel_world_size(self) -> int:
        return self.slice_parallel_size

    def get_slice_parallel_group(self):
        return self._mesh.group_over(("tp",))

    get_tensor_model_parallel_rank = get_slice_parallel_rank
    get_tensor_model_parallel_world_size = get_slice_parallel_world_size
    get_tensor_model_parallel_group = get_slice_parallel_group
