"""Node groups of ZeRO++ (pure rank arithmetic, no processes)."""

import pytest

from lightspeed.comm.node_groups import cross_node_ranks, node_ranks, ranks_per_node
from lightspeed.config.errors import ConfigError


def test_node_groups_are_consecutive_ranks():
    assert node_ranks(8, 4, "k") == [[0, 1, 2, 3], [4, 5, 6, 7]]  # DeepSpeed's hpZ partition groups
    assert node_ranks(4, 1, "k") == [[0], [1], [2], [3]]
    assert cross_node_ranks(8, 4, "k") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert cross_node_ranks(4, 4, "k") == [[0], [1], [2], [3]]


def test_node_size_must_divide_the_world():
    with pytest.raises(ConfigError, match=r"zero_optimization.zero_hpz_partition_size: 3 ranks per group must divide "
                                          r"the data-parallel world size \(8\)"):
        node_ranks(8, 3, "zero_optimization.zero_hpz_partition_size")


def test_ranks_per_node(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert ranks_per_node(16) == 8 and ranks_per_node(4) == 4
