"""The gradient norm's plan from placements, without processes: which fragments a rank counts and over
which mesh dims the partial squares are summed (zero/norm.py's Note), and that a run without a placement
sharded beyond the partition gets no plan (the step's own agreement, unchanged)."""

from __future__ import annotations

import torch

from lightspeed.comm.topology import MeshShape, Topology, dims_of
from lightspeed.parallel.placement import Placement, PlacementTable
from lightspeed.zero.fragments import Fragment
from lightspeed.zero.norm import NormPlan, device_side


def _setup():
    owner = torch.zeros(10)
    grad = torch.arange(10.0)
    fragments = [Fragment("a", (6,), 0, 6, owner, 0), Fragment("b", (4,), 0, 4, owner, 6)]
    table = PlacementTable({"a": Placement("a", (12,), (((0, 6),),), ("tp",)), "b": Placement.replicated("b", (4,))})
    return fragments, {owner: grad}, table


def test_tp_replicated_parameters_count_on_tp_rank_0_only():
    fragments, grads, table = _setup()
    shape = MeshShape.for_world(4, tp=2)  # tp2 x dp2
    for rank in range(4):
        plan = NormPlan.build(fragments, grads, table, Topology(shape, rank, 0, {}), dims_of("dp_sp"))
        assert plan.sum_dims == ("edp_shard", "tp")
        counted = [v.tolist() for v in plan.counted]
        expected = [[0, 1, 2, 3, 4, 5]] + ([[6, 7, 8, 9]] if rank % 2 == 0 else [])
        assert counted == expected, rank
    # stage 0: nothing partitioned, so the sum runs over tp alone
    plan = NormPlan.build(fragments, grads, table, Topology(shape, 1, 0, {}), ())
    assert plan.sum_dims == ("tp",) and len(plan.counted) == 1


def test_no_plan_without_a_placement_sharded_beyond_the_partition():
    fragments, grads, table = _setup()
    table["a"] = Placement.replicated("a", (6,))
    topology = Topology(MeshShape.for_world(4, tp=2), 0, 0, {})
    assert NormPlan.build(fragments, grads, table, topology, dims_of("dp_sp")) is None
    fragments, grads, table = _setup()  # a tp dim of one: sharded over nothing that exists
    assert NormPlan.build(fragments, grads, table, Topology(MeshShape.for_world(4), 0, 0, {}), ()) is None


def test_offloaded_gradients_are_read_on_the_device_side():
    master = torch.zeros(8)  # the host copy the optimizer reads
    device = torch.arange(8.0)  # where the gradients were reduced
    owner = torch.zeros(4)
    out = device_side({owner: master[4:8]}, [master], [device])
    assert out[owner].tolist() == [4.0, 5.0, 6.0, 7.0]
    assert device_side({owner: master[4:8]}, [master], None)[owner] is not None


def test_squared_norm_of_long_cpu_tensors_is_accurate():
    """zero/grad_clip.py's Note [CPU norms]: a flat ZeRO buffer of millions of elements on the CPU; torch's
    own CPU norm of it is off by about 2e-4 relative at 8M elements (fp32); the summed squares are within 1e-6.
    Also bf16 input, an empty tensor, a non-contiguous view, and several tensors of awkward lengths."""
    from lightspeed.zero.grad_clip import CPU_PIECE, squared_norm

    gen = torch.Generator().manual_seed(0)
    long = torch.randn(8_000_003, generator=gen) * 1e-3
    odd = torch.randn(3, CPU_PIECE + 5, generator=gen).t()  # not contiguous
    small = torch.randn(17, generator=gen)
    grads = [long, torch.empty(0), odd, small]
    want = sum(float(g.double().square().sum()) for g in grads)
    got = squared_norm(grads)
    assert got.dtype == torch.float32 and got.dim() == 0
    assert abs(float(got) - want) / want < 1e-6
    half = long.bfloat16()
    want_bf16 = float(half.double().square().sum())
    assert abs(float(squared_norm([half])) - want_bf16) / want_bf16 < 1e-6
    assert float(squared_norm([])) == 0.0 and float(squared_norm([torch.empty(0)])) == 0.0
