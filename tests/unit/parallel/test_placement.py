"""Placements without processes: the replicated default, a tensor-parallel slice's boxes for every split
style (column, row, fused q|k|v parts, a transposed Conv1D, biases), cutting the local tensor from the
whole one, the table's checks against a model, and the norm's counting rule."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightspeed.parallel.placement import DATA_PARALLEL, Placement, PlacementTable, tensor_parallel_placements, \
    tp_placement
from lightspeed.parallel.tensor_parallel import TPLayout
from lightspeed.parallel.tp_plan import COLWISE, ROWWISE, colwise_parts


def test_replicated_default():
    p = Placement.replicated("w", (3, 5))
    assert p.box == ((0, 3), (0, 5)) and p.is_replicated and p.reduced_over == DATA_PARALLEL
    assert p.local_shape == (3, 5)
    assert p.as_record() == {"global_shape": [3, 5], "boxes": [[[0, 3], [0, 5]]], "sharded_over": [],
                             "reduced_over": list(DATA_PARALLEL), "transposed": False}
    with pytest.raises(ValueError, match="malformed placement record of w"):
        Placement.from_record("w", {"boxes": []})


@pytest.mark.parametrize("style, shape, transposed", [
    (COLWISE, (12, 7), False), (ROWWISE, (12, 8), False), (colwise_parts(4, 4, 4), (12, 7), False),
    (COLWISE, (7, 12), True),  # a Conv1D [in, out]: held as Linear [out, in]
])
@pytest.mark.parametrize("tp", [2, 4])
def test_tp_slices_are_the_layouts_shards(style, shape, transposed, tp):
    """The placement's boxes cut exactly the slice the layer holds (TPLayout.shard), for every rank."""
    full = torch.randn(shape)
    bias = torch.randn(shape[1] if transposed else shape[0])
    for role, whole in (("weight", full), ("bias", bias)):
        layout = TPLayout(style, role, tuple(whole.shape), transposed, tp)
        for rank in range(tp):
            placement = tp_placement("x", layout, rank)
            local = layout.shard(whole, rank)
            assert torch.equal(placement.slice_of(whole), local)
            assert placement.local_shape == layout.shard_shape(rank)
            assert placement.transposed == (transposed and role == "weight")
            back = torch.zeros_like(whole)
            placement.place_into(back, local)  # the inverse: the rank's elements land where they came from
            mask = torch.zeros_like(whole)
            placement.place_into(mask, torch.ones_like(local))
            assert torch.equal(back, whole * mask) and mask.sum() == local.numel()
            assert Placement.from_record("x", placement.as_record()) == placement
            assert placement.sharded_over == (("tp",) if layout.sharded else ())


def test_fused_parts_have_one_box_each():
    layout = TPLayout(colwise_parts(4, 4, 4), "weight", (12, 6), False, 2)
    placement = tp_placement("qkv", layout, 1)
    assert placement.boxes == (((2, 4), (0, 6)), ((6, 8), (0, 6)), ((10, 12), (0, 6)))
    with pytest.raises(ValueError, match="3 boxes, not one"):
        placement.box


def test_bad_placements():
    with pytest.raises(ValueError, match="not inside"):
        Placement("w", (4,), (((0, 5),),))
    with pytest.raises(ValueError, match="cannot both shard and reduce"):
        Placement("w", (4,), (((0, 4),),), ("sp",), DATA_PARALLEL)


def test_counting_rule():
    """Along a dim a parameter is sharded over every rank counts; along one it is replicated over, rank 0."""
    sharded = Placement("a", (4,), (((0, 2),),), ("tp",))
    replicated = Placement.replicated("b", (4,))
    for tp_rank in (0, 1):
        coords = {"tp": tp_rank, "edp_shard": 1}
        assert sharded.counts_on(coords, ("tp",))
        assert replicated.counts_on(coords, ("tp",)) == (tp_rank == 0)
        assert replicated.counts_on(coords, ())


class _Megatron(nn.Module):
    def __init__(self):
        super().__init__()
        self.col = nn.Parameter(torch.zeros(3, 4))
        self.col.tensor_model_parallel = True  # Megatron's attribute (DeepSpeed reads it)
        self.row = nn.Parameter(torch.zeros(4, 3))
        self.row.model_parallel, self.row.partition_dim = True, 1
        self.norm = nn.Parameter(torch.zeros(4))


def test_table_for_a_megatron_model():
    model = _Megatron()
    table = tensor_parallel_placements(model, PlacementTable.for_module(model), tp_rank=1, tp_size=2)
    assert table["col"].global_shape == (6, 4) and table["col"].box == ((3, 6), (0, 4))
    assert table["row"].global_shape == (4, 6) and table["row"].box == ((0, 4), (3, 6))
    assert table["norm"].is_replicated and table.sharded_dims() == ("tp",)
    assert table.check(model) is table


def test_table_checks_the_model():
    model = _Megatron()
    table = PlacementTable.for_module(model)
    with pytest.raises(KeyError, match="not a parameter"):
        table.placed([Placement.replicated("missing", (1,))])
    wrong = table.placed([Placement("col", (6, 4), (((0, 2), (0, 4)),), ("tp",))])
    with pytest.raises(AssertionError, match="local shape"):
        wrong.check(model)
    del table["norm"]
    with pytest.raises(AssertionError, match="missing"):
        table.check(model)
