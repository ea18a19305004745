"""Where each parameter lives on the mesh: one frozen `Placement` per parameter, written by the model
transforms (tensor parallelism today; sequence parallelism, activation checkpointing and the ZeRO
strategy keep what they are given) and read by the strategies (which group reduces a gradient, which
ranks' copies the global norm counts) and by the checkpoint layout.

Owns: `Placement`, the default (replicated over every model dim, reduced over data parallelism), the
placement of a tensor-parallel slice (`tp_placement`), and `PlacementTable` (name -> placement for one
model, checked against it). Must not: communicate, or change a module.

Note: [what a placement says] `global_shape` is the whole parameter as the original module holds it
(what a consolidated checkpoint holds); `boxes` are the parts of the whole tensor this rank holds, each
a per-dim `(start, stop)`, in the order they are concatenated along dim 0 (`cat_dim`: another dim) to
form the local tensor (one box, except the rows of each part of a fused q|k|v layer, or the gate and up
units of AutoEP's fused experts sliced over tp, joined along their 2I dim); `transposed`: each box is
transposed before it is concatenated (a transformers Conv1D [in, out], split into a Linear [out, in]);
`sharded_over` names the mesh dims (comm/topology.py's `MESH_DIMS`) whose ranks hold different boxes;
along every other model dim (tp, pp, ep) the rank's copy equals its peers'. `reduced_over` names the
dims whose ranks hold the same box but see different data: the gradient is averaged over them (the
data-parallel dims for dense parameters; for experts, later, without `ep`). ZeRO's partition of a
parameter over data parallelism is not a placement: it is the strategy's, saved as fragments.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from lightspeed.parallel.module_kinds import logical_shape
from lightspeed.parallel.tensor_parallel import TPLayout
from lightspeed.parallel.tp_plan import Slice

Box = tuple[tuple[int, int], ...]  # per dim: [start, stop)
DATA_PARALLEL = ("dp_replicate", "edp_shard", "ep", "sp")  # comm/topology.py's "dp_sp"


@dataclass(frozen=True)
class Placement:
    """One parameter on the mesh (see the Note)."""

    name: str
    global_shape: tuple[int, ...]
    boxes: tuple[Box, ...]
    sharded_over: tuple[str, ...] = ()
    reduced_over: tuple[str, ...] = DATA_PARALLEL
    transposed: bool = False
    cat_dim: int = 0

    def __post_init__(self):
        if self.cat_dim and (self.transposed or not 0 < self.cat_dim < len(self.global_shape)):
            raise ValueError(f"placement of {self.name}: boxes joined along dim {self.cat_dim} of "
                             f"{self.global_shape}{' (transposed)' if self.transposed else ''}")
        if not self.boxes:
            raise ValueError(f"placement of {self.name}: no box")
        for box in self.boxes:
            if len(box) != len(self.global_shape) or any(
                    not 0 <= a <= b <= n for (a, b), n in zip(box, self.global_shape)):
                raise ValueError(f"placement of {self.name}: box {box} is not inside {self.global_shape}")
        if self.transposed and len(self.global_shape) != 2:
            raise ValueError(f"placement of {self.name}: only a matrix can be held transposed")
        if set(self.sharded_over) & set(self.reduced_over):
            raise ValueError(f"placement of {self.name}: a dim cannot both shard and reduce it "
                             f"({sorted(set(self.sharded_over) & set(self.reduced_over))})")

    @classmethod
    def replicated(cls, name: str, shape: Iterable[int], reduced_over: tuple[str, ...] = DATA_PARALLEL) -> "Placement":
        shape = tuple(int(n) for n in shape)
        return cls(name, shape, (tuple((0, n) for n in shape),), (), reduced_over)

    @property
    def is_replicated(self) -> bool:
        return not self.sharded_over

    @property
    def box(self) -> Box:
        """The one box of a parameter held as one block (ValueError for a fused layer's several)."""
        if len(self.boxes) != 1:
            raise ValueError(f"placement of {self.name}: {len(self.boxes)} boxes, not one")
        return self.boxes[0]

    def _box_shape(self, box: Box) -> tuple[int, ...]:
        shape = tuple(b - a for a, b in box)
        return tuple(reversed(shape)) if self.transposed else shape

    @property
    def local_shape(self) -> tuple[int, ...]:
        shapes = [self._box_shape(box) for box in self.boxes]
        if not self.global_shape:
            return ()
        d = self.cat_dim
        return shapes[0][:d] + (sum(s[d] for s in shapes),) + shapes[0][d + 1:]

    def _pieces(self, full: torch.Tensor) -> list[torch.Tensor]:
        pieces = [full[tuple(slice(a, b) for a, b in box)] for box in self.boxes]
        return [p.t() for p in pieces] if self.transposed else pieces

    def slice_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's local tensor cut from the whole one (`global_shape`): a new contiguous tensor."""
        if tuple(full.shape) != self.global_shape:
            raise ValueError(f"placement of {self.name}: expected a whole tensor of shape {self.global_shape}, got "
                             f"{tuple(full.shape)}")
        pieces = self._pieces(full)
        return pieces[0].contiguous().clone() if len(pieces) == 1 else torch.cat(pieces, dim=self.cat_dim)

    def place_into(self, full: torch.Tensor, local: torch.Tensor) -> None:
        """Write a local tensor (`local_shape`) into its boxes of the whole tensor `full` (the inverse of
        `slice_of`)."""
        if tuple(local.shape) != self.local_shape:
            raise ValueError(f"placement of {self.name}: a local tensor of shape {tuple(local.shape)}, the placement "
                             f"holds {self.local_shape}")
        row, d = 0, self.cat_dim
        for target in self._pieces(full):
            n = target.shape[d] if target.dim() else 1
            target.copy_(local.narrow(d, row, n) if local.dim() else local)
            row += n

    @classmethod
    def from_record(cls, name: str, record: Mapping) -> "Placement":
        """The placement `as_record` wrote (ValueError when malformed)."""
        try:
            return cls(str(name), tuple(int(n) for n in record["global_shape"]),
                       tuple(tuple((int(a), int(b)) for a, b in box) for box in record["boxes"]),
                       tuple(str(d) for d in record["sharded_over"]), tuple(str(d) for d in record["reduced_over"]),
                       bool(record.get("transposed", False)), int(record.get("cat_dim", 0)))
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"malformed placement record of {name}: {err}") from None

    def counts_on(self, coords: Mapping[str, int], dims: Iterable[str]) -> bool:
        """Whether this rank's copy counts once in a sum over the ranks differing in the mesh dims `dims`
        (those over which the caller's own pieces are not already disjoint): along a dim the parameter is
        sharded over each rank holds different values, so every rank counts; along any other the copies
        are equal and only the rank at coordinate 0 counts."""
        return all(coords.get(dim, 0) == 0 for dim in dims if dim not in self.sharded_over)

    def as_record(self) -> dict:
        """Plain data for a manifest."""
        return {"global_shape": list(self.global_shape), "boxes": [[list(r) for r in box] for box in self.boxes],
                "sharded_over": list(self.sharded_over), "reduced_over": list(self.reduced_over),
                "transposed": self.transposed, **({"cat_dim": self.cat_dim} if self.cat_dim else {})}


def keyed_placements(table: Mapping[str, "Placement"]) -> list[str]:
    """The names of the parameters reduced over another group than data parallelism (experts), a tied
    module of a pipeline's reduction over pp aside, sorted."""
    return sorted(n for n, p in table.items() if tuple(d for d in p.reduced_over if d != "pp") != DATA_PARALLEL)


def tp_placement(name: str, layout: TPLayout, tp_rank: int) -> Placement:
    """The placement of tensor-parallel rank `tp_rank`'s slice of a parameter split by `layout`."""
    shape = layout.full_shape
    if not layout.sharded:  # a row-parallel bias: whole on every tp rank
        return Placement.replicated(name, shape)
    transposed = layout.role == "weight" and layout.transposed
    held = tuple(reversed(shape)) if transposed else shape  # the split layer's [out, in]
    matrix = held if layout.role == "weight" else (held[0], 1)
    boxes = []
    for rows, cols in Slice(layout.style, tp_rank, layout.tp_size).indices(matrix):
        box = (rows.indices(matrix[0])[:2],) if layout.role == "bias" else (
            rows.indices(matrix[0])[:2], cols.indices(matrix[1])[:2])
        boxes.append(tuple(reversed(box)) if transposed else box)
    return Placement(name, shape, tuple(boxes), ("tp",), transposed=transposed)


class PlacementTable(dict):
    """{parameter name: Placement} for one model: every parameter (by its first name, as state_dict
    names tied ones) has one. Built replicated (`for_module`), then the transforms replace entries.
    `split_over`: mesh dims the model itself is split over (pp: each stage holds other layers), which
    count as sharded dims even on a rank that holds no parameter sharded over them."""

    split_over: tuple[str, ...] = ()

    @classmethod
    def for_module(cls, module: torch.nn.Module) -> "PlacementTable":
        # a parameter partitioned by zero.Init holds an empty placeholder: its whole shape is its ds_shape
        return cls((name, Placement.replicated(name, logical_shape(p))) for name, p in module.named_parameters())

    def placed(self, placements: Iterable[Placement]) -> "PlacementTable":
        """A copy with `placements` replacing the entries of their names (each must exist)."""
        out = PlacementTable(self)
        out.split_over = self.split_over
        for placement in placements:
            if placement.name not in out:
                raise KeyError(f"placement for {placement.name}, which is not a parameter of the model")
            out[placement.name] = placement
        return out

    def check(self, module: torch.nn.Module) -> "PlacementTable":
        """This table, after checking it names exactly `module`'s parameters with their local shapes."""
        params = dict(module.named_parameters())
        if set(params) != set(self):
            missing, extra = sorted(set(params) - set(self)), sorted(set(self) - set(params))
            raise AssertionError(f"placements do not match the model's parameters (missing {missing[:3]}, "
                                 f"extra {extra[:3]})")
        for name, p in params.items():
            if not p.is_meta and p.numel() and tuple(p.shape) != self[name].local_shape:
                raise AssertionError(f"placement of {name}: local shape {self[name].local_shape}, the parameter "
                                     f"holds {tuple(p.shape)}")
        return self

    def sharded_dims(self) -> tuple[str, ...]:
        """Every mesh dim some parameter is sharded over."""
        return tuple(sorted({dim for p in self.values() for dim in p.sharded_over} | set(self.split_over)))


def tensor_parallel_placements(module: torch.nn.Module, table: PlacementTable, tp_rank: int,
                               tp_size: int) -> PlacementTable:
    """`table` with the parameters split over the tp group placed: those of the split layers
    (tensor_parallel.py's layouts; a row-parallel bias stays replicated), and those a Megatron-style
    model marks as split (`tensor_model_parallel` or `model_parallel` true, read as DeepSpeed reads them;
    the slice along `partition_dim`, default 0, of a whole tensor `tp_size` times as long)."""
    from lightspeed.parallel.tensor_parallel import tp_layouts

    if tp_size == 1:
        return table
    layouts = tp_layouts(module)
    placed = [tp_placement(name, layout, tp_rank) for name, layout in layouts.items() if name in table]
    for name, p in module.named_parameters():
        if name in layouts or not (getattr(p, "tensor_model_parallel", False) or getattr(p, "model_parallel", False)):
            continue
        dim = int(getattr(p, "partition_dim", 0))
        shape = list(p.shape)
        n = shape[dim]
        shape[dim] = n * tp_size
        box = tuple((tp_rank * n, (tp_rank + 1) * n) if d == dim else (0, size) for d, size in enumerate(shape))
        placed.append(Placement(name, tuple(shape), (box,), ("tp",)))
    return table.placed(placed)
