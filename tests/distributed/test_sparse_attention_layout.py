"""DeepSpeed's rule for random sparse layouts on real gloo processes: `deepspeed.ops.sparse_attention`'s
SparseSelfAttention overwrites its master layout with global rank 0's on first use, so ranks that drew
different random blocks (BigBird, Variable) attend alike."""

from __future__ import annotations

import random

import pytest

from lightspeed.testing.run_world import run_world

pytestmark = [pytest.mark.dist, pytest.mark.timeout(120)]


def _layouts():
    import torch.distributed as dist

    from lightspeed.compat.deepspeed.ops.sparse_attention import BigBirdSparsityConfig, SparseSelfAttention

    random.seed(100 + dist.get_rank())  # each rank draws other random blocks
    module = SparseSelfAttention(BigBirdSparsityConfig(2, block=16, different_layout_per_head=True,
                                                       num_random_blocks=3), max_seq_length=512)
    drawn = module.master_layout.clone()
    return drawn.tolist(), module.get_layout(256).tolist(), module.master_layout[..., :16, :16].tolist()


def test_layout_broadcast_from_rank0():
    (drawn0, used0, _), (drawn1, used1, master1) = run_world(_layouts, 2)
    assert drawn0 != drawn1  # the ranks really drew different layouts
    assert used1 == used0 and master1 == used0
