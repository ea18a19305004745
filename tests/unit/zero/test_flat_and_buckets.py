"""Flat layouts, shard ranges and gradient buckets: pure bookkeeping, no processes."""

import pytest
import torch

from lightspeed._utils.flat import FlatLayout, flat_views, flatten_into
from lightspeed.zero.buckets import GradBuckets
from lightspeed.zero.flat_params import FlatParams
from lightspeed.zero.partition import Range, bucket_ranges, owned_chunks, plan_flat, shard_range


def test_layout_pads_to_world_size_and_views_alias_the_buffer():
    shapes = [torch.Size([3, 5]), torch.Size([7]), torch.Size([1])]
    layout = FlatLayout.build(shapes, world_size=4)
    assert layout.numel == 23 and layout.padded_numel == 24
    tensors = [torch.randn(s) for s in shapes]
    flat = flatten_into(tensors, layout)
    views = flat_views(flat, layout)
    for v, t in zip(views, tensors):
        assert torch.equal(v, t)
    views[1].fill_(7.0)
    assert torch.all(flat[15:22] == 7.0) and flat[23] == 0


@pytest.mark.parametrize("numel,world", [(24, 4), (10, 5), (0, 2)])
def test_shard_ranges_tile_the_buffer(numel, world):
    ranges = [shard_range(numel, world, r) for r in range(world)]
    assert ranges[0].start == 0 and ranges[-1].end == numel
    assert all(a.end == b.start for a, b in zip(ranges, ranges[1:]))
    with pytest.raises(ValueError):
        shard_range(numel + 1, world, 0) if (numel + 1) % world else shard_range(numel + 3, 2 * world + 1, 0)


def test_range_intersection():
    assert Range(0, 10).intersect(Range(5, 20)) == Range(5, 10)
    assert Range(0, 3).intersect(Range(5, 8)).numel == 0


def test_bucket_ranges_never_split_a_parameter():
    ranges = [Range(0, 4), Range(4, 10), Range(10, 11), Range(11, 30)]
    assert bucket_ranges(ranges, 5) == [(0, 2), (2, 4)]
    assert bucket_ranges(ranges, 0) == [(0, 4)]
    assert bucket_ranges(ranges, 1000) == [(0, 4)]
    assert bucket_ranges([], 5) == []


def test_buckets_launch_in_index_order_only():
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (4, 6, 1, 19)]
    flat = FlatParams(params, torch.float32, keep_master=False, bucket_numel=5)
    launched = []
    buckets = GradBuckets([flat], lambda b: launched.append(b.index))
    buckets.flush()  # before a boundary backward's reset nothing is pending (a gradient read in no_sync)
    assert launched == []
    buckets.reset()
    # buffer order is reversed: [p3 (19), p2 (1), p1 (6), p0 (4)] -> buckets [p3], [p2, p1], [p0]
    assert [(b.first, b.last) for b in buckets.buckets] == [(0, 1), (1, 3), (3, 4)]
    buckets.mark_ready(params[0])  # last bucket ready first: must wait for the others
    assert launched == []
    buckets.mark_ready(params[3])
    assert launched == [0]
    buckets.mark_ready(params[1])
    assert launched == [0]
    buckets.flush()  # params[2] never got a gradient
    assert launched == [0, 1, 2]
    with pytest.raises(RuntimeError, match="twice"):
        buckets.mark_ready(params[0])


def test_flat_params_repoint_parameters_and_keep_fp32_master():
    params = [torch.nn.Parameter(torch.randn(3, 3).bfloat16()), torch.nn.Parameter(torch.randn(5).bfloat16())]
    values = [p.detach().clone() for p in params]
    flat = FlatParams(params, torch.float32, world_size=4, keep_master=True)
    assert flat.layout.padded_numel == 16 and flat.has_master  # one bucket of 14 elements, padded to 16
    for p, v in zip(params, values):
        assert torch.equal(p, v)
    flat.master_flat.add_(1.0)
    flat.copy_master_to_params()
    assert torch.equal(params[1], (values[1].float() + 1).bfloat16())


def test_plan_pads_each_bucket_to_the_world_size_and_chunks_tile_it():
    offsets, buckets, total = plan_flat([19, 1, 6, 4], 5, 4)
    assert offsets == [0, 20, 21, 28] and total == 32
    assert [(b.first, b.last, b.start, b.padded_numel) for b in buckets] == [(0, 1, 0, 20), (1, 3, 20, 8),
                                                                           (3, 4, 28, 4)]
    seen = []
    for rank in range(4):
        shard_pos = 0
        for r, pos in owned_chunks(buckets, 4, rank):
            assert pos == shard_pos
            shard_pos += r.numel
            seen.extend(range(r.start, r.end))
        assert shard_pos == total // 4
    assert sorted(seen) == list(range(total))


def test_max_inflight_finishes_the_oldest_reduction():
    class Pending:
        def __init__(self, index):
            self.index = index

        def wait(self):
            finished.append(self.index)

    params = [torch.nn.Parameter(torch.zeros(5)) for _ in range(4)]
    flat = FlatParams(params, torch.float32, keep_master=False, bucket_numel=5)
    finished = []
    buckets = GradBuckets([flat], lambda b: Pending(b.index), max_inflight=2)
    buckets.reset()
    assert len(buckets.buckets) == 4
    for p in reversed(params):  # backward order: bucket 0 holds the last parameter
        buckets.mark_ready(p)
    assert finished == [0, 1]  # the third and fourth launches each finished the oldest in flight
    buckets.wait()
    assert finished == [0, 1, 2, 3]
