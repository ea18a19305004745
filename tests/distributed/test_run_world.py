"""lightspeed.testing.run_world, the harness of the dist tests: results by rank, and a rank's exception
reported with its traceback while its peer is still blocked in a collective (not at the timeout)."""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from lightspeed.testing.run_world import WorldError, run_world

pytestmark = pytest.mark.dist


def _rank_squared():
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return dist.get_rank() ** 2, t.item()


def _rank1_fails():
    if dist.get_rank() == 1:
        raise ValueError("rank 1 gives up")
    dist.all_reduce(torch.ones(1))  # waits for rank 1, which never comes


def test_results_by_rank():
    assert run_world(_rank_squared, 3) == [(0, 3.0), (1, 3.0), (4, 3.0)]


def test_a_failing_rank_is_reported_while_its_peer_waits():
    start = time.monotonic()
    with pytest.raises(WorldError, match="rank 1 raised:(.|\n)*rank 1 gives up"):
        run_world(_rank1_fails, 2, timeout=120)
    assert time.monotonic() - start < 60


def _rank1_hangs():
    if dist.get_rank() == 1:
        time.sleep(60)


def test_a_hanging_rank_reports_where_it_hangs():
    with pytest.raises(WorldError, match="ranks \\[1\\] did not finish within 8 s(.|\n)*rank 1 stacks(.|\n)*_rank1_hangs"):
        run_world(_rank1_hangs, 2, timeout=8)
