"""The comms logger (DeepSpeed's `comms_logger` block and `log_summary`) on real gloo worlds, and its
bandwidth formulas."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import lightspeed
from lightspeed.comm.comms_logger import bandwidths, trim_mean
from lightspeed.testing.models import TinyMLP, regression_data
from lightspeed.testing.run_world import run_world

pytestmark = pytest.mark.dist


def test_bandwidth_formulas_are_deepspeeds():
    # 1 MB in 1 ms at n = 4, in Gbps
    assert bandwidths("all_reduce", 10**6, 1.0, 4) == pytest.approx((16.0, 12.0))
    assert bandwidths("all_gather", 10**6, 1.0, 4) == pytest.approx((32.0, 24.0))
    assert bandwidths("reduce_scatter", 10**6, 1.0, 4) == pytest.approx((32.0, 24.0))
    assert bandwidths("all_to_all_single", 10**6, 1.0, 4) == pytest.approx((8.0, 6.0))
    assert bandwidths("broadcast", 10**6, 1.0, 4) == pytest.approx((8.0, 8.0))
    assert trim_mean([100.0] + [1.0] * 8 + [0.0]) == 1.0


def _train(comms_logger: dict, stage: int, straggler: bool):
    world, rank = dist.get_world_size(), dist.get_rank()
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 1,
           "wall_clock_breakdown": True, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": stage}, "comms_logger": comms_logger}
    engine, *_ = lightspeed.initialize(model=TinyMLP(), config=cfg)
    x, y = regression_data(4 * world)
    for i in range(2):
        b = (i * world + rank) * 2
        engine.backward(engine(x[b:b + 2], y[b:b + 2]))
        engine.step()
    table = lightspeed.comm.log_summary(show_straggler=straggler)
    from lightspeed.comm.comms_logger import COMMS_LOGGER

    counts = {name: sum(r.count for r in sizes.values()) for name, sizes in COMMS_LOGGER.records.items()}
    records = lightspeed.comm.log_summary(return_dict=True)
    assert {name: sum(v[0] for v in sizes.values()) for name, sizes in records.items()} == counts
    return table, counts


def test_summary_counts_every_profiled_op_on_every_rank():
    ranks = run_world(_train, 2, {"enabled": True}, 1, True)
    for table, counts in ranks:
        # stage 1, two steps: a reduce-scatter and an all-gather per bucket, the norm all-reduce
        assert counts["reduce_scatter"] == counts["all_gather"] >= 2 and counts["all_reduce"] == 2
        assert counts.get("broadcast", 0) >= 1  # initialize()'s broadcast from rank 0
        head = table.splitlines()[0]
        for col in ("Message Size", "Count", "Avg Latency(ms)", "busbw_avg (Gbps)", "Avg straggler(ms)"):
            assert col in head
        assert "reduce_scatter" in table
    assert ranks[0][1] == ranks[1][1]


def test_prof_ops_selects_ops_and_disabled_records_nothing():
    table, counts = run_world(_train, 2, {"enabled": True, "prof_all": False, "prof_ops": ["all_gather"]}, 1,
                              False)[0]
    assert set(counts) == {"all_gather"} and "straggler" not in table
    _, counts = run_world(_train, 2, {"enabled": False}, 0, False)[0]
    assert counts == {}


def test_debug_names_the_caller():
    _, counts = run_world(_train, 2, {"enabled": True, "debug": True, "prof_ops": []}, 0, False)[0]
    # stage 0: the bucket all-reduce launched by the strategy, the broadcast by initialize()
    assert "all_reduce | [Caller Func: _launch]" in counts and "broadcast | [Caller Func: broadcast_from_rank0]" \
        in counts, counts
