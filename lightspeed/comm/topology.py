"""`Topology`: the run's process mesh, built once from the config and the world size and passed around.

Owns: the mesh shape (dims `dp_replicate`, `dp_shard`, `sp`, `tp`; `pp` reserved), the rank arithmetic
that places a global rank in it (pure functions, tested without processes), the process group of each
dim and of the flattened dims ZeRO and the gradient norm use, and the adapter from a Megatron-style
`mpu`. Must not: issue collectives (comm/collectives.py does), or keep module-level groups.

Note: [rank order] As in Megatron and DeepSpeed, tensor parallelism is innermost: the ranks of one tp
group are contiguous (0,1 | 2,3 with tp=2), sequence parallelism next, data parallelism outermost
(dp_replicate outside dp_shard). A global rank r has coordinates
`tp = r % tp`, `sp = (r // tp) % sp`, `dp_shard = (r // (tp*sp)) % dp_shard`, `dp_replicate = r //
(tp*sp*dp_shard)`. Groups: "tp", "sp", "dp_shard", "dp_replicate", "dp" (dp_replicate x dp_shard: the
ranks holding the same model shard and different data), "dp_sp" (dp x sp: ZeRO partitions and reduces
gradients over it, since the sp ranks of a dp replica see different tokens of the same samples), and
"world". The Ulysses record (comm/sequence_groups.py) is this object's sp dim: built from its groups
when tp > 1, and at tp = 1 built before it from the same arithmetic (consecutive runs) and handed in
through an mpu.

Note: [the global gradient norm] Every element of the model must count once. Over dp_sp each element
lives once (ZeRO shards it, or stage 0 all-reduces it and the norm is taken of the whole gradient on
each rank: see the strategies). Over tp a parameter is either sharded (each tp rank holds a different
slice: its squares add over tp) or replicated (every tp rank holds the same values: norms, embeddings,
a row-parallel layer's bias). The rule: a replicated parameter contributes from tp rank 0 only
(`counts_in_norm`), and the squared partial norms are then summed over `norm_group` (tp x dp_sp, the
whole world while pp is 1).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

MESH_DIMS = ("dp_replicate", "dp_shard", "sp", "tp")  # outermost first, as init_device_mesh takes them
_FLAT_DIMS = {"dp": ("dp_replicate", "dp_shard"), "dp_sp": ("dp_replicate", "dp_shard", "sp"),
              "tp_dp_sp": ("dp_replicate", "dp_shard", "sp", "tp")}
GROUP_NAMES = MESH_DIMS + tuple(_FLAT_DIMS) + ("world",)


class TopologyError(ValueError):
    """A mesh that does not fit the world (sizes that do not divide it, an unbuilt dim)."""


@dataclass(frozen=True)
class MeshShape:
    """The sizes of the mesh's dims; their product is the world size."""

    dp_replicate: int = 1
    dp_shard: int = 1
    sp: int = 1
    tp: int = 1
    pp: int = 1

    @classmethod
    def for_world(cls, world_size: int, *, tp: int = 1, sp: int = 1, pp: int = 1,
                  dp_replicate: int = 1) -> "MeshShape":
        """The shape with `dp_shard` taking what the other dims leave of `world_size`."""
        for name, value in (("tensor_parallel.autotp_size", tp), ("sequence_parallel_size", sp),
                            ("pipeline parallel size", pp), ("dp_replicate", dp_replicate)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise TopologyError(f"{name} must be a positive integer (got {value!r})")
        if pp != 1:
            raise TopologyError(f"pipeline parallelism (pp={pp}) is not implemented; the mesh's pp dim must be 1")
        inner = tp * sp * dp_replicate
        if world_size % inner:
            raise TopologyError(f"the world size {world_size} does not divide by tp={tp} x sp={sp} x "
                                f"dp_replicate={dp_replicate} = {inner}")
        return cls(dp_replicate=dp_replicate, dp_shard=world_size // inner, sp=sp, tp=tp, pp=pp)

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.sp * self.tp * self.pp

    def size(self, name: str) -> int:
        if name == "world":
            return self.world_size
        dims = _FLAT_DIMS.get(name, (name,))
        _check_name(name)
        out = 1
        for dim in dims:
            out *= getattr(self, dim)
        return out

    def coords(self, rank: int) -> dict[str, int]:
        """{dim: coordinate} of a global rank (see the Note on rank order)."""
        out, stride = {}, 1
        for dim in reversed(MESH_DIMS):
            n = getattr(self, dim)
            out[dim] = (rank // stride) % n
            stride *= n
        return out

    def rank_of(self, coords: dict[str, int]) -> int:
        rank, stride = 0, 1
        for dim in reversed(MESH_DIMS):
            rank += coords[dim] * stride
            stride *= getattr(self, dim)
        return rank

    def rank(self, name: str, rank: int) -> int:
        """A global rank's rank within its group `name` (the order of `group_ranks`)."""
        return self.group_ranks(name, rank).index(rank)

    def group_ranks(self, name: str, rank: int) -> list[int]:
        """The global ranks of the group `name` that `rank` belongs to, ascending."""
        _check_name(name)
        if name == "world":
            return list(range(self.world_size))
        varying = _FLAT_DIMS.get(name, (name,))
        mine = self.coords(rank)
        return sorted(r for r in range(self.world_size)
                      if all(c == mine[d] for d, c in self.coords(r).items() if d not in varying))

    def all_groups(self, name: str) -> list[list[int]]:
        """Every group of `name`, each as its ascending global ranks, in order of their first rank."""
        seen, out = set(), []
        for r in range(self.world_size):
            if r not in seen:
                ranks = self.group_ranks(name, r)
                seen.update(ranks)
                out.append(ranks)
        return out


def _check_name(name: str) -> None:
    if name not in GROUP_NAMES:
        raise KeyError(f"no mesh group {name!r} (known: {', '.join(GROUP_NAMES)})")


class Topology:
    """The run's groups: `group(name)`, `size(name)`, `rank(name)` for the names of `GROUP_NAMES`.

    `group(name)` is a torch.distributed process group, or None where the group is the whole
    (default) world or the process is alone; a dim of size 1 gets this rank's own singleton group (so a
    collective on it never reaches another rank)."""

    def __init__(self, shape: MeshShape, world_rank: int, local_rank: int, groups: dict[str, Any],
                 mesh: Any = None, from_mpu: bool = False):
        self.shape, self.world_rank, self.local_rank = shape, world_rank, local_rank
        self._groups, self.mesh, self.from_mpu = groups, mesh, from_mpu
        self._ranks: dict[str, int] = {}

    # ------------------------------------------------------------------ building
    @classmethod
    def build(cls, *, tp: int = 1, sp: int = 1, pp: int = 1, dp_replicate: int = 1, mpu=None) -> "Topology":
        """From an initialized torch.distributed (or a single process when it is not). With `mpu` (a
        Megatron-style object) its groups are used as given (`from_mpu`)."""
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        if mpu is not None:
            return cls.from_mpu(mpu, sp=sp, pp=pp)
        if not dist.is_initialized():
            shape = MeshShape.for_world(1, tp=tp, sp=sp, pp=pp, dp_replicate=dp_replicate)
            return cls(shape, 0, local_rank, {})
        world_rank, world_size = dist.get_rank(), dist.get_world_size()
        shape = MeshShape.for_world(world_size, tp=tp, sp=sp, pp=pp, dp_replicate=dp_replicate)
        if shape.size("dp") == world_size:  # data parallel only: the world group, as before the mesh
            return cls(shape, world_rank, local_rank, {"dp": None, "dp_sp": None, "dp_shard": None,
                                                       "tp_dp_sp": None})
        mesh = _device_mesh(shape)
        groups = {dim: mesh.get_group(dim) for dim in MESH_DIMS}
        for name in ("dp", "dp_sp"):
            groups[name] = _flat_group(shape, name, world_rank, groups)
        groups["tp_dp_sp"] = None  # every rank, while pp is 1
        return cls(shape, world_rank, local_rank, groups, mesh=mesh)

    @classmethod
    def from_mpu(cls, mpu, *, sp: int = 1, pp: int = 1) -> "Topology":
        """From a Megatron-style `mpu`: get_data_parallel_group / _rank / _world_size, and
        get_tensor_model_parallel_* or get_model_parallel_* (tp; absent means 1), and with sp > 1
        get_sequence_parallel_* and get_sequence_data_parallel_group (DeepSpeed's names)."""
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        world_rank = dist.get_rank() if dist.is_initialized() else 0
        world_size = dist.get_world_size() if dist.is_initialized() else 1
        dp = _mpu_call(mpu, "get_data_parallel_world_size")
        tp_prefix = next((p for p in ("get_tensor_model_parallel", "get_model_parallel")
                          if hasattr(mpu, p + "_world_size")), None)
        tp = _mpu_call(mpu, tp_prefix + "_world_size") if tp_prefix else 1
        sp = _mpu_call(mpu, "get_sequence_parallel_world_size") if hasattr(mpu, "get_sequence_parallel_world_size") \
            else sp
        if pp != 1:
            raise TopologyError(f"pipeline parallelism (pp={pp}) is not implemented; the mesh's pp dim must be 1")
        if dp * tp * sp != world_size:
            raise TopologyError(f"mpu: data parallel {dp} x tensor parallel {tp} x sequence parallel {sp} is not the "
                                f"world size {world_size}")
        shape = MeshShape(dp_shard=dp, sp=sp, tp=tp)
        groups = {"dp": mpu.get_data_parallel_group(), "dp_shard": mpu.get_data_parallel_group(),
                  "tp_dp_sp": None}
        ranks = {"dp": _mpu_call(mpu, "get_data_parallel_rank"), "dp_shard": _mpu_call(mpu, "get_data_parallel_rank"),
                 "dp_replicate": 0}
        if tp_prefix:
            groups["tp"] = getattr(mpu, tp_prefix + "_group")()
            ranks["tp"] = _mpu_call(mpu, tp_prefix + "_rank")
        if sp > 1:
            for name in ("get_sequence_parallel_group", "get_sequence_parallel_rank",
                         "get_sequence_data_parallel_group"):
                if not hasattr(mpu, name):
                    raise TopologyError(f"mpu: sequence parallel size {sp} needs mpu.{name}()")
            groups["sp"], ranks["sp"] = mpu.get_sequence_parallel_group(), mpu.get_sequence_parallel_rank()
            groups["dp_sp"] = mpu.get_sequence_data_parallel_group()
        else:
            groups["dp_sp"], ranks["dp_sp"] = groups["dp"], ranks["dp"]
        topology = cls(shape, world_rank, local_rank, groups, from_mpu=True)
        topology._ranks.update(ranks)
        return topology

    # ------------------------------------------------------------------ queries
    def size(self, name: str) -> int:
        return self.shape.size(name)

    def rank(self, name: str) -> int:
        """This process's rank within the group `name`."""
        _check_name(name)
        if name not in self._ranks:
            if name in ("world", "tp_dp_sp"):
                self._ranks[name] = self.world_rank
            elif not self.from_mpu:
                self._ranks[name] = self.shape.rank(name, self.world_rank)
            else:  # an mpu's groups need not follow the mesh's rank order
                self._ranks[name] = dist.get_rank(self.group(name)) if self.size(name) > 1 else 0
        return self._ranks[name]

    def group(self, name: str) -> Any:
        """The process group of `name` this process belongs to (see the class docstring)."""
        _check_name(name)
        if name == "world" or not dist.is_initialized():
            return None
        if name in self._groups:
            return self._groups[name]
        if self.size(name) == 1:  # a dim of size 1 without a mesh: this rank alone
            self._groups[name] = dist.new_group(ranks=[self.world_rank], use_local_synchronization=True)
            return self._groups[name]
        raise TopologyError(f"mesh group {name!r} (size {self.size(name)}) is not available from the mpu given")

    @property
    def grad_reduce_group(self) -> Any:
        """The group ZeRO reduces (and partitions) gradients over: dp x sp (dp when sp is 1)."""
        return self.group("dp_sp")

    @property
    def norm_group(self) -> Any:
        """The group squared partial gradient norms are summed over (see the Note on the global norm)."""
        return self.group("tp_dp_sp")

    def counts_in_norm(self, tp_sharded: bool) -> bool:
        """Whether this rank's copy of a parameter adds to the global norm: sharded ones always,
        replicated ones on tp rank 0 only."""
        return tp_sharded or self.rank("tp") == 0

    def describe(self) -> str:
        return " x ".join(f"{dim}={getattr(self.shape, dim)}" for dim in MESH_DIMS)

    def as_mpu(self) -> "MeshMpu":
        """This topology as a Megatron-style `mpu` (for code that takes one: activation checkpointing)."""
        return MeshMpu(self)


class MeshMpu:
    """The Megatron `mpu` interface over a `Topology`: data-parallel, model- (tensor-) parallel and
    sequence-parallel group, rank and world size; groups are fetched on first use."""

    def __init__(self, topology: Topology):
        self._t = topology

    def get_data_parallel_group(self):
        return self._t.group("dp")

    def get_data_parallel_rank(self) -> int:
        return self._t.rank("dp")

    def get_data_parallel_world_size(self) -> int:
        return self._t.size("dp")

    def get_model_parallel_group(self):
        return self._t.group("tp")

    def get_model_parallel_rank(self) -> int:
        return self._t.rank("tp")

    def get_model_parallel_world_size(self) -> int:
        return self._t.size("tp")

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size

    def get_sequence_parallel_group(self):
        return self._t.group("sp")

    def get_sequence_parallel_rank(self) -> int:
        return self._t.rank("sp")

    def get_sequence_parallel_world_size(self) -> int:
        return self._t.size("sp")


def _mpu_call(mpu, name: str) -> int:
    if not hasattr(mpu, name):
        raise TopologyError(f"mpu: the object given has no {name}()")
    return int(getattr(mpu, name)())


def _device_mesh(shape: MeshShape):
    from torch.distributed.device_mesh import init_device_mesh

    backend = str(dist.get_backend()).lower()
    device_type = "cuda" if backend == "nccl" else "cpu"
    return init_device_mesh(device_type, tuple(getattr(shape, dim) for dim in MESH_DIMS), mesh_dim_names=MESH_DIMS)


def _flat_group(shape: MeshShape, name: str, world_rank: int, groups: dict[str, Any]) -> Any:
    """The group of a flattened dim: a mesh dim's own group when it alone is larger than 1, else a new
    group per block of ranks (every rank creates every group, in the same order, as new_group needs)."""
    wide = [dim for dim in _FLAT_DIMS[name] if getattr(shape, dim) > 1]
    if len(wide) <= 1:
        return groups[wide[0]] if wide else groups[_FLAT_DIMS[name][-1]]
    mine = None
    for ranks in shape.all_groups(name):
        group = dist.new_group(ranks=ranks)
        if world_rank in ranks:
            mine = group
    return mine
