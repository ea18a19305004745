"""`Topology`: the run's process mesh, built once from the config and the world size and passed around.

Owns: the mesh shape (dims `pp`, `dp_replicate`, `edp_shard`, `ep`, `sp`, `tp`), the rank arithmetic that
places a global rank in it (pure functions, tested without processes), the process group of each dim
and of any set of dims (the flattened groups ZeRO, expert parallelism and the gradient norm use), the
sizes read from a config (`Topology.from_config`), and the adapter from a Megatron-style `mpu`. Must
not: issue collectives (comm/collectives.py does), or keep module-level groups.

Note: [rank order] As in Megatron and DeepSpeed, tensor parallelism is innermost: the ranks of one tp
group are contiguous (0,1 | 2,3 with tp=2), sequence parallelism next, then data parallelism
(dp_replicate outside dp_shard), and pipeline stages outermost (DeepSpeed's
`PipeModelDataParallelTopology`: pipe, data, model). A global rank r has coordinates
`tp = r % tp`, `sp = (r // tp) % sp`, `dp_shard = (r // (tp*sp)) % dp_shard`, `dp_replicate = (r //
(tp*sp*dp_shard)) % dp_replicate`, `pp = r // (tp*sp*dp)`. Groups: "tp", "sp", "pp", "dp_shard",
"dp_replicate", "dp" (dp_replicate x dp_shard: the ranks holding the same model shard and different
data), "dp_sp" (dp x sp: ZeRO partitions and reduces gradients over it, since the sp ranks of a dp
replica see different tokens of the same samples), "tp_dp_sp", and "world".

Note: [experts] Expert parallelism borrows from dp_shard (torchtitan's sparse mesh; DeepSpeed's
expert groups): dp_shard = edp_shard x ep with ep inner, so an "ep" group is `ep` consecutive dp_shard ranks
(DeepSpeed's `_create_expert_and_data_parallel`) and each holds different experts; "edp" (dp_replicate
x edp_shard, DeepSpeed's expert-data-parallel group) holds the same experts and different data, and "edp_sp"
(edp x sp) is the group an expert's gradients are reduced and partitioned over, as "dp_sp" is for the
dense parameters. Without experts (ep = 1) edp_shard is dp_shard and every group is as before.

Note: [the Ulysses record] (comm/sequence_groups.py) is this object's sp dim: built from its groups
when tp > 1, and at tp = 1 built before it from the same arithmetic (consecutive runs) and handed in
through an mpu.

Note: [the recorded topology] lightspeed keeps no module-level groups: the engine's Topology is built
once and passed around. DeepSpeed's `deepspeed.utils.groups` functions take no arguments (Megatron
and HF code call `_get_data_parallel_group()`, `get_tensor_model_parallel_group()`,
`_get_expert_parallel_group("ep_size_2")`), so `initialize()` records the topology it built
(`record_topology`) and those functions answer from it (`current_topology`); nothing inside lightspeed
reads the record.

Note: [the global gradient norm] is zero/norm.py's: it reads the placements (parallel/placement.py) and
sums partial squares over `group_over` the dims where the copies differ.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

MESH_DIMS = ("pp", "dp_replicate", "edp_shard", "ep", "sp", "tp")  # outermost first, as init_device_mesh takes them
_FLAT_DIMS = {"dp_shard": ("edp_shard", "ep"), "dp": ("dp_replicate", "edp_shard", "ep"),
              "dp_sp": ("dp_replicate", "edp_shard", "ep", "sp"), "edp": ("dp_replicate", "edp_shard"),
              "edp_sp": ("dp_replicate", "edp_shard", "sp"), "tp_dp_sp": ("dp_replicate", "edp_shard", "ep", "sp", "tp"),
              "world": MESH_DIMS}
GROUP_NAMES = MESH_DIMS + tuple(_FLAT_DIMS)


def dims_of(name: str) -> tuple[str, ...]:
    """The mesh dims a group name spans, outermost first (a mesh dim spans itself)."""
    _check_name(name)
    return _FLAT_DIMS.get(name, (name,))


class TopologyError(ValueError):
    """A mesh that does not fit the world (sizes that do not divide it, an unbuilt dim)."""


def _positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise TopologyError(f"{name} must be a positive integer (got {value!r})")


@dataclass(frozen=True)
class MeshShape:
    """The sizes of the mesh's dims; their product is the world size. `dp_shard` counts every data-parallel
    shard rank; expert parallelism splits it as `edp_shard` x `ep` (the Note on experts)."""

    dp_replicate: int = 1
    dp_shard: int = 1
    sp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1

    def __post_init__(self):
        for dim in ("dp_replicate", "dp_shard", "sp", "tp", "pp", "ep"):
            _positive(dim, getattr(self, dim))
        if self.dp_shard % self.ep:
            raise TopologyError(f"expert parallel size ep={self.ep} does not divide the data-parallel shard size "
                                f"{self.dp_shard}")

    @classmethod
    def for_world(cls, world_size: int, *, tp: int = 1, sp: int = 1, pp: int = 1, dp_replicate: int = 1,
                  ep: int = 1) -> "MeshShape":
        """The shape with `dp_shard` taking what the other dims leave of `world_size`."""
        for name, value in (("tensor_parallel.autotp_size", tp), ("sequence_parallel_size", sp),
                            ("pipeline parallel size", pp), ("dp_replicate", dp_replicate),
                            ("expert parallel size", ep)):
            _positive(name, value)
        inner = tp * sp * dp_replicate * pp
        if world_size % inner:
            raise TopologyError(f"the world size {world_size} does not divide by tp={tp} x sp={sp} x "
                                f"dp_replicate={dp_replicate} x pp={pp} = {inner}")
        dp_shard = world_size // inner
        if dp_shard % ep:
            raise TopologyError(f"expert parallel size ep={ep} does not divide the data-parallel size {dp_shard} "
                                f"(world {world_size} / tp={tp} x sp={sp} x pp={pp} x dp_replicate={dp_replicate})")
        return cls(dp_replicate=dp_replicate, dp_shard=dp_shard, sp=sp, tp=tp, pp=pp, ep=ep)

    @property
    def edp_shard(self) -> int:
        return self.dp_shard // self.ep

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.sp * self.tp * self.pp

    def dim_size(self, dim: str) -> int:
        return getattr(self, dim)

    def size(self, name: str) -> int:
        out = 1
        for dim in dims_of(name):
            out *= self.dim_size(dim)
        return out

    def size_of(self, dims) -> int:
        """The number of ranks a group over the mesh dims `dims` holds."""
        out = 1
        for dim in dims:
            out *= self.dim_size(dim)
        return out

    def coords(self, rank: int) -> dict[str, int]:
        """{mesh dim: coordinate} of a global rank (see the Note on rank order)."""
        out, stride = {}, 1
        for dim in reversed(MESH_DIMS):
            n = self.dim_size(dim)
            out[dim] = (rank // stride) % n
            stride *= n
        return out

    def rank_of(self, coords: dict[str, int]) -> int:
        rank, stride = 0, 1
        for dim in reversed(MESH_DIMS):
            rank += coords.get(dim, 0) * stride
            stride *= self.dim_size(dim)
        return rank

    def rank(self, name: str, rank: int) -> int:
        """A global rank's rank within its group `name` (the order of `group_ranks`)."""
        return self.group_ranks(name, rank).index(rank)

    def group_ranks(self, name: str, rank: int) -> list[int]:
        """The global ranks of the group `name` that `rank` belongs to, ascending."""
        return self.ranks_over(dims_of(name), rank)

    def ranks_over(self, dims, rank: int) -> list[int]:
        """The global ranks that differ from `rank` only in the mesh dims `dims`, ascending."""
        varying = set(dims)
        unknown = varying - set(MESH_DIMS)
        if unknown:
            raise KeyError(f"no mesh dim {sorted(unknown)[0]!r} (known: {', '.join(MESH_DIMS)})")
        mine = self.coords(rank)
        return sorted(r for r in range(self.world_size)
                      if all(c == mine[d] for d, c in self.coords(r).items() if d not in varying))

    def all_groups(self, name: str) -> list[list[int]]:
        """Every group of `name`, each as its ascending global ranks, in order of their first rank."""
        return self.all_groups_over(dims_of(name))

    def all_groups_over(self, dims) -> list[list[int]]:
        seen, out = set(), []
        for r in range(self.world_size):
            if r not in seen:
                ranks = self.ranks_over(dims, r)
                seen.update(ranks)
                out.append(ranks)
        return out


def expert_groups_from_dp(dp_group: Any, ep: int) -> tuple[Any, Any]:
    """(expert-parallel group, expert-data-parallel group) of this rank when an mpu gives the
    data-parallel groups: DeepSpeed's rule (`_get_expert_parallel_ranks`): each data-parallel group, in
    its rank order, is cut into consecutive runs of `ep` ranks (the expert-parallel groups), and the
    ranks at the same place in each run form an expert-data-parallel group. Collective over the world:
    every rank learns every data-parallel group and creates each new group in the same order."""
    if not dist.is_initialized():  # one process: ep > 1 cannot divide its data-parallel size of 1
        raise TopologyError(f"expert parallel size ep={ep} needs torch.distributed initialized")
    mine = dist.get_process_group_ranks(dp_group) if dp_group is not None else list(range(dist.get_world_size()))
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    dp_groups = sorted({tuple(r) for r in everyone}, key=lambda r: r[0])
    me, found = dist.get_rank(), [None, None]
    for ranks in dp_groups:
        if len(ranks) % ep:
            raise TopologyError(f"expert parallel size ep={ep} does not divide the mpu's data-parallel group {list(ranks)}")
        runs = [list(ranks[i:i + ep]) for i in range(0, len(ranks), ep)]
        for kind, members in [(0, run) for run in runs] + [(1, [run[j] for run in runs]) for j in range(ep)]:
            group = dist.new_group(ranks=members)
            if me in members:
                found[kind] = group
    return found[0], found[1]


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
    def build(cls, *, tp: int = 1, sp: int = 1, pp: int = 1, dp_replicate: int = 1, ep: int = 1,
              mpu=None) -> "Topology":
        """From an initialized torch.distributed (or a single process when it is not). With `mpu` (a
        Megatron-style object) its groups are used as given (`from_mpu`)."""
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        if mpu is not None:
            return cls.from_mpu(mpu, sp=sp, pp=pp, ep=ep)
        if not dist.is_initialized():
            shape = MeshShape.for_world(1, tp=tp, sp=sp, pp=pp, dp_replicate=dp_replicate, ep=ep)
            return cls(shape, 0, local_rank, {})
        world_rank, world_size = dist.get_rank(), dist.get_world_size()
        shape = MeshShape.for_world(world_size, tp=tp, sp=sp, pp=pp, dp_replicate=dp_replicate, ep=ep)
        wide = [dim for dim in MESH_DIMS if shape.dim_size(dim) > 1]
        if len(wide) <= 1:  # one dim or none: every group is the world's or a rank's own, as before the mesh
            return cls(shape, world_rank, local_rank, {})
        mesh = _device_mesh(shape, wide)
        return cls(shape, world_rank, local_rank, {(dim,): mesh.get_group(dim) for dim in wide}, mesh=mesh)

    @classmethod
    def from_config(cls, config, *, pp: int = 1, mpu=None) -> "Topology":
        """The topology a ds_config asks for (a dict, or a loaded `LightspeedConfig`; read before it is
        validated, since validation needs the data-parallel size): `tensor_parallel.autotp_size` (0 or
        absent: 1), `sequence_parallel_size`, and `pp` from the pipeline module (DeepSpeed reads the
        stage count from `PipelineModule(num_stages=)`, not the config)."""
        sizes = mesh_sizes(config)
        return cls.build(tp=sizes["tp"], sp=sizes["sp"], pp=pp, mpu=mpu)

    @classmethod
    def from_mpu(cls, mpu, *, sp: int = 1, pp: int = 1, ep: int = 1) -> "Topology":
        """From a Megatron-style `mpu`: get_data_parallel_group / _rank / _world_size, and
        get_tensor_model_parallel_* or get_model_parallel_* (tp; absent means 1), and with sp > 1
        get_sequence_parallel_* and get_sequence_data_parallel_group (DeepSpeed's names). With ep > 1 the
        expert groups split each of the mpu's data-parallel groups as DeepSpeed's
        `_create_expert_data_and_model_parallel` does (`expert_groups_from_dp`)."""
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
        if ep > 1 and sp > 1:
            raise TopologyError(f"expert parallelism (ep={ep}) with an mpu's sequence-parallel groups (sp={sp}) is "
                                f"not implemented; pass no mpu (the mesh builds both)")
        shape = MeshShape(dp_shard=dp, sp=sp, tp=tp, ep=ep)
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
        if ep > 1:
            groups["ep"], groups["edp"] = expert_groups_from_dp(groups["dp"], ep)
            groups["edp_sp"] = groups["edp"]
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
            if name in ("world", "tp_dp_sp") and self.shape.pp == 1:
                self._ranks[name] = self.world_rank
            elif not self.from_mpu:
                self._ranks[name] = self.shape.rank(name, self.world_rank)
            else:  # an mpu's groups need not follow the mesh's rank order
                self._ranks[name] = dist.get_rank(self.group(name)) if self.size(name) > 1 else 0
        return self._ranks[name]

    def group(self, name: str) -> Any:
        """The process group of `name` this process belongs to (see the class docstring)."""
        _check_name(name)
        if not self.from_mpu:
            return self.group_over(dims_of(name))
        if name == "world" or not dist.is_initialized():
            return None
        if name in self._groups:
            return self._groups[name]
        if self.size(name) == 1:
            return self.group_over(())
        raise TopologyError(f"mesh group {name!r} (size {self.size(name)}) is not available from the mpu given")

    def group_over(self, dims) -> Any:
        """The process group of the ranks that differ from this one only in the mesh dims `dims` (None
        for the whole world). Collective the first time a set of dims is asked for: every rank must ask
        for the same sets in the same order (the strategies do, at set-up)."""
        unknown = set(dims) - set(MESH_DIMS)
        if unknown:
            raise KeyError(f"no mesh dim {sorted(unknown)[0]!r} (known: {', '.join(MESH_DIMS)})")
        key = tuple(dim for dim in MESH_DIMS if dim in dims and self.shape.dim_size(dim) > 1)
        if not dist.is_initialized() or self.shape.size_of(key) == self.shape.world_size:
            return None
        if self.from_mpu:  # an mpu's groups need not follow the mesh's rank order: only its own, by name
            name = next((n for n in self._groups if isinstance(n, str)
                         if tuple(d for d in dims_of(n) if self.shape.dim_size(d) > 1) == key), None)
            if name is None and key:
                raise TopologyError(f"a group over the mesh dims {key} is not available from the mpu given")
            if name is not None:
                return self._groups[name]
        if key not in self._groups:
            if not key:  # this rank alone: a collective on it never reaches another rank
                self._groups[key] = dist.new_group(ranks=[self.world_rank], use_local_synchronization=True)
            else:  # every rank creates every block's group, in the same order, as new_group needs
                for ranks in self.shape.all_groups_over(key):
                    group = dist.new_group(ranks=ranks)
                    if self.world_rank in ranks:
                        self._groups[key] = group
        return self._groups[key]

    def size_over(self, dims) -> int:
        return self.shape.size_of(dims)

    def coords(self) -> dict[str, int]:
        """This process's coordinate on each mesh dim."""
        return self.shape.coords(self.world_rank)

    @property
    def grad_reduce_group(self) -> Any:
        """The group ZeRO reduces (and partitions) gradients over: dp x sp (dp when sp is 1)."""
        return self.group("dp_sp")

    def describe(self) -> str:
        return " x ".join(f"{dim}={self.shape.dim_size(dim)}" for dim in MESH_DIMS)

    def as_mpu(self) -> "MeshMpu":
        """This topology as a Megatron-style `mpu` (for code that takes one: activation checkpointing)."""
        return MeshMpu(self)


_CURRENT: Topology | None = None


def record_topology(topology: Topology | None) -> None:
    """Record the topology `initialize()` built, for DeepSpeed's argument-less group functions (the
    Note on the recorded topology); None forgets it."""
    global _CURRENT
    _CURRENT = topology


def current_topology() -> Topology | None:
    """The topology the last `initialize()` of this process built, or None."""
    return _CURRENT


class MeshMpu:
    """The Megatron `mpu` interface over a `Topology`: data-parallel, model- (tensor-) parallel,
    sequence-parallel, pipeline and expert (-data-) parallel group, rank and world size; groups are
    fetched on first use (collective the first time: every rank asks in the same order)."""

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

    def get_pipeline_model_parallel_group(self):
        return self._t.group("pp")

    def get_pipeline_model_parallel_rank(self) -> int:
        return self._t.rank("pp")

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self._t.size("pp")

    def get_expert_parallel_group(self):
        return self._t.group("ep")

    def get_expert_parallel_rank(self) -> int:
        return self._t.rank("ep")

    def get_expert_parallel_world_size(self) -> int:
        return self._t.size("ep")

    def get_expert_data_parallel_group(self):
        return self._t.group("edp")

    def get_expert_data_parallel_rank(self) -> int:
        return self._t.rank("edp")

    def get_expert_data_parallel_world_size(self) -> int:
        return self._t.size("edp")


def _mpu_call(mpu, name: str) -> int:
    if not hasattr(mpu, name):
        raise TopologyError(f"mpu: the object given has no {name}()")
    return int(getattr(mpu, name)())


def mesh_sizes(config) -> dict[str, int]:
    """{"tp": .., "sp": ..} from a ds_config dict or a `LightspeedConfig` (its raw dict), before validation."""
    raw = getattr(config, "raw", config)
    if not isinstance(raw, dict):
        return {"tp": 1, "sp": 1}
    tp_section = raw.get("tensor_parallel")
    tp = tp_section.get("autotp_size", 1) if isinstance(tp_section, dict) else 1
    if tp is None or tp == 0:  # DeepSpeed's default of 0 means "off"
        tp = 1
    sp = raw.get("sequence_parallel_size")
    if sp is not None and (isinstance(sp, bool) or not isinstance(sp, int) or sp < 1):
        raise TopologyError(f"sequence_parallel_size: must be a positive integer (got {sp!r})")
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise TopologyError(f"tensor_parallel.autotp_size: must be a positive integer (got {tp!r})")
    return {"tp": tp, "sp": sp or 1}


def _device_mesh(shape: MeshShape, dims: list[str]):
    """The device mesh over the dims larger than 1 (init_device_mesh builds one group per slice of each)."""
    from torch.distributed.device_mesh import init_device_mesh

    backend = str(dist.get_backend()).lower()
    device_type = "cuda" if backend == "nccl" else "cpu"
    return init_device_mesh(device_type, tuple(shape.dim_size(dim) for dim in dims), mesh_dim_names=tuple(dims))
