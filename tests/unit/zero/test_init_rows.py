"""zero/stage3/init_rows.py's arithmetic of the exchange, without processes: a flat range of a tensor
splits into contiguous boxes, and the wanted elements of boxes joined along one dim, taken shard by
shard from any split of the flat buffer (as Init's ranks hold it) and placed at the count of wanted
elements before each shard, are the joined tensor (random shapes, boxes and shard bounds)."""

from __future__ import annotations

import random

import pytest
import torch

from lightspeed.zero.stage3.init_rows import _elements, _flat_boxes, _joined, _numel


def _case(rng: random.Random):
    ndim = rng.randint(1, 4)
    shape = [rng.randint(1, 5) for _ in range(ndim)]
    base = [(a, rng.randint(a + 1, n)) for n in shape for a in [rng.randrange(n)]]
    dim = rng.randrange(ndim)
    cuts = sorted(rng.sample(range(shape[dim] + 1), min(shape[dim] + 1, rng.choice([2, 4]))))
    boxes = [tuple(cut if d == dim else base[d] for d in range(ndim))
             for cut in ((cuts[i], cuts[i + 1]) for i in range(0, len(cuts) - 1, 2))]
    return shape, boxes


def test_shards_deliver_the_joined_boxes():
    rng = random.Random(0)
    for _ in range(300):
        shape, boxes = _case(rng)
        dim, joined = _joined(shape, boxes, "t")
        full = torch.arange(torch.Size(shape).numel()).view(shape)
        want = torch.cat([full[tuple(slice(a, b) for a, b in box)] for box in boxes], dim=dim)
        assert tuple(want.shape) == joined
        total = full.numel()
        bounds = sorted({0, total, *rng.sample(range(total + 1), min(total + 1, rng.randint(1, 5)))})
        got = []
        for lo, hi in zip(bounds, bounds[1:]):
            pieces = _flat_boxes(shape, lo, hi)
            for start, box in pieces:  # each piece is the contiguous flat range it claims
                sub = full[tuple(slice(a, b) for a, b in box)].reshape(-1)
                assert torch.equal(sub, torch.arange(start, start + sub.numel()))
            assert sum(torch.Size([b - a for a, b in box]).numel() for _, box in pieces) == hi - lo
            part = _elements(full.reshape(-1)[lo:hi].clone(), lo, shape, boxes, dim)
            assert part.numel() == _numel(shape, boxes, lo, hi) and _numel(shape, boxes, 0, lo) == len(got)
            got += part.tolist()
        assert got == want.reshape(-1).tolist(), (shape, boxes, bounds)


@pytest.mark.parametrize("boxes,match", [
    ([((0, 2), (0, 3))], "not non-empty boxes"),
    ([((0, 1), (0, 1)), ((1, 2), (1, 2))], "differ along one dim only"),
    ([((0, 1), (1, 2)), ((0, 1), (0, 1))], "increasing and disjoint"),
])
def test_bad_boxes_are_refused(boxes, match):
    with pytest.raises(ValueError, match=match):
        _joined((2, 2), boxes, "w")
