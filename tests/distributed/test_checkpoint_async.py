"""Background checkpoint writing (`checkpoint.writer.decoupled`): the files load exactly as a
synchronous save's, training continues with identical losses, the snapshot pool is allocated once
(at ZeRO-3 at start-up, collectively), a writer's error reaches every rank at the next save or
wait, mismatched tags and save_dirs fail at once on every rank, and a process that exits right after
a background save still completes it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

import lightspeed
from lightspeed.checkpoint import engine_checkpoint, writer as writer_mod
from lightspeed.checkpoint.atomic import read_latest
from lightspeed.checkpoint.errors import CheckpointError
from lightspeed.checkpoint.tag_reader import verify_tag
from lightspeed.testing.models import TinyMLP, regression_data
from lightspeed.testing.run_world import run_world

pytestmark = pytest.mark.dist

BATCH = 8
BASE = {"train_batch_size": BATCH, "steps_per_print": 1000,
        "optimizer": {"type": "Adam", "params": {"lr": 0.01, "weight_decay": 0.01}}}
ASYNC = {"writer": {"type": "python", "decoupled": True}}


def _train(engine, steps, start):
    world, rank = dist.get_world_size(), dist.get_rank()
    micro = engine.train_micro_batch_size_per_gpu()
    x, y = regression_data(BATCH * 20)
    losses = []
    for s in range(start, start + steps):
        base = s * BATCH + rank * micro
        xb = x[base:base + micro] + 0.01 * torch.randn(micro, x.shape[1])  # RNG draws: the RNG state matters
        loss = engine(xb, y[base:base + micro])
        engine.backward(loss)
        engine.step()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item() / world)
    return losses


def _scenario(save_dir: str, config: dict):
    torch.manual_seed(1234 + dist.get_rank())
    engine, *_ = lightspeed.initialize(model=TinyMLP(), config=config)
    first = _train(engine, 3, 0)
    engine.save_checkpoint(save_dir, client_state={"epoch": 2})
    during = _train(engine, 3, 3)  # with a background writer, these steps run while it writes
    engine.wait_checkpoint()
    allocations = engine._checkpoint_writer._pool.num_allocations
    torch.manual_seed(999)
    engine2, *_ = lightspeed.initialize(model=TinyMLP(seed=5), config=config)
    path, client = engine2.load_checkpoint(save_dir)
    assert client == {"epoch": 2} and engine2.global_steps == 3
    resumed = _train(engine2, 3, 3)
    loaded = engine_checkpoint.load(save_dir, None, dp_rank=dist.get_rank())
    return first, during, resumed, loaded, allocations


def _same(a, b) -> bool:
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _compare_worker(root: str, stages: tuple[int, ...]):
    out = []
    for stage in stages:
        cfg = dict(BASE, zero_optimization={"stage": stage})
        sync = _scenario(os.path.join(root, f"sync{stage}"), cfg)
        # at stage 3 the snapshot pool is sized at start-up (a gather of the module state, collective)
        pool = "startup" if stage == 3 else "first_save"
        writer = dict(ASYNC["writer"], snapshot_pool=pool)
        background = _scenario(os.path.join(root, f"async{stage}"), dict(cfg, checkpoint={"writer": writer}))
        s_first, s_during, s_resumed, s_loaded, _ = sync
        a_first, a_during, a_resumed, a_loaded, allocations = background
        out.append({
            "stage": stage,
            "losses_equal": s_first == a_first and s_during == a_during and s_resumed == a_resumed,
            "resume_exact": a_resumed == a_during and s_resumed == s_during,
            "files_equal": _same(s_loaded.shared, a_loaded.shared)
            and _same(s_loaded.strategy_state, a_loaded.strategy_state)
            and _same(s_loaded.rng_state, a_loaded.rng_state),
            # first_save: one pool allocation, by the save; startup: at initialize and after the first step
            "pool_allocations_ok": allocations == (2 if pool == "startup" else 1),
        })
    return out


def test_background_save_loads_exactly_as_a_synchronous_one(tmp_path):
    results = run_world(_compare_worker, 2, str(tmp_path), (0, 2, 3))
    for rank_results in results:
        for r in rank_results:
            assert r["losses_equal"] and r["resume_exact"] and r["files_equal"] and r["pool_allocations_ok"], r
    for stage in (0, 2, 3):
        for kind in ("sync", "async"):
            directory = tmp_path / f"{kind}{stage}"
            assert read_latest(directory) == "global_step3"
            assert verify_tag(directory / "global_step3", "global_step3")[0] == []


def _failing_worker(root: str):
    rank = dist.get_rank()
    cfg = dict(BASE, checkpoint=dict(ASYNC, tag_validation="Fail"))
    engine, *_ = lightspeed.initialize(model=TinyMLP(), config=cfg)
    _train(engine, 1, 0)
    engine.save_checkpoint(root, tag="good")
    engine.wait_checkpoint()
    report = {}

    real = writer_mod.atomic_torch_save

    def broken(obj, path):
        if rank == 1 and "rng_rank1" in str(path):
            raise OSError(28, "No space left on device")
        return real(obj, path)

    writer_mod.atomic_torch_save = broken
    try:
        engine.save_checkpoint(root, tag="bad")  # returns: the failure happens in the background
        _train(engine, 1, 1)  # training goes on
        try:
            engine.wait_checkpoint()
        except CheckpointError as err:
            report["wait"] = str(err)
        engine.wait_checkpoint()  # reported once: nothing pending any more
        # the same failure surfaces at the next save when nobody waited
        engine.save_checkpoint(root, tag="bad2")
        try:
            engine.save_checkpoint(root, tag="after")
        except CheckpointError as err:
            report["next_save"] = str(err)
    finally:
        writer_mod.atomic_torch_save = real
    report["latest_after_failures"] = read_latest(root)
    engine.save_checkpoint(root, tag="recovered")
    engine.wait_checkpoint()
    report["latest"] = read_latest(root)
    try:
        engine.save_checkpoint(root, tag=f"rank{rank}")
    except CheckpointError as err:
        report["tag_validation"] = str(err)
        report["tag_is_assertion"] = isinstance(err, AssertionError)  # DeepSpeed asserts that tags agree
    # a snapshot that fails on one rank (out of host memory, say) is reported like a writer error
    if rank == 1:
        engine._checkpoint_writer._pool.take = lambda files: (_ for _ in ()).throw(MemoryError("no pinned memory"))
    engine.save_checkpoint(root, tag="snap")
    try:
        engine.wait_checkpoint()
    except CheckpointError as err:
        report["snapshot"] = str(err)
    if rank == 1:
        del engine._checkpoint_writer._pool.take
    # rank 0 cannot even make the staging directory: every rank hears it at once
    if rank == 0:
        with open(os.path.join(root, "a_file"), "w") as f:
            f.write("not a directory")
    dist.barrier()
    try:
        engine.save_checkpoint(os.path.join(root, "a_file"), tag="x")
    except CheckpointError as err:
        report["prepare"] = str(err)
    report["final_latest"] = read_latest(root)
    # ranks that name different directories fail at once, every rank naming who had which
    start = time.monotonic()
    try:
        engine.save_checkpoint(os.path.join(root, f"dir{rank}"), tag="split")
    except CheckpointError as err:
        report["dirs"] = (str(err), time.monotonic() - start)
        report["dirs_is_assertion"] = isinstance(err, AssertionError)
    return report


def test_writer_errors_reach_every_rank(tmp_path):
    reports = run_world(_failing_worker, 2, str(tmp_path))
    for rank, report in enumerate(reports):
        assert "wait" in report and "next_save" in report, report
        if rank == 1:
            assert "No space left on device" in report["wait"]
        else:
            # rank 0 saw rank 1's failure marker and did not publish; it names rank 1 and its error
            assert "rank 1 failed to write its part of tag bad " in report["wait"]
            assert "No space left on device" in report["wait"]
            assert "rank 1 failed to write its part of tag bad2 " in report["next_save"]
        assert report["latest_after_failures"] == "good"
        assert report["latest"] == "recovered"
        assert "not the same on every rank" in report["tag_validation"]
        assert report["tag_is_assertion"] and not report["dirs_is_assertion"]
        assert "no pinned memory" in report["snapshot"], report
        assert "rank 0 cannot prepare" in report["prepare"], report
        assert report["final_latest"] == "recovered"
        assert "the checkpoint tag is not the same on every rank: 'rank0' on rank 0; 'rank1' on rank 1 " \
            "(checkpoint.tag_validation is Fail)" in report["tag_validation"]
        message, seconds = report["dirs"]
        assert message.startswith(f"save_checkpoint: save_dir differs between ranks: '{tmp_path / 'dir0'}' on rank 0; "
                                  f"'{tmp_path / 'dir1'}' on rank 1; pass the same save_dir and tag")
        assert seconds < 10
    assert not (tmp_path / "dir0").exists() and not (tmp_path / "dir1").exists()
    assert not (tmp_path / "bad").exists() and not (tmp_path / "bad2").exists()
    assert verify_tag(tmp_path / "recovered", "recovered")[0] == []


EXIT_CHILD = textwrap.dedent('''
    import sys, torch
    import lightspeed
    from lightspeed.testing.models import TinyMLP, regression_data
    cfg = {"train_batch_size": 4, "steps_per_print": 1000, "optimizer": {"type": "Adam", "params": {"lr": 0.1}},
           "checkpoint": {"writer": {"type": "PYTHON", "decoupled": True, "show_statistics": True}}}
    engine, *_ = lightspeed.initialize(model=TinyMLP(), config=cfg)
    x, y = regression_data(4)
    engine.backward(engine(x, y)); engine.step()
    engine.save_checkpoint(sys.argv[1], tag="at_exit")
    # no wait: the interpreter finishes the background write before it exits
''')


def test_exit_right_after_a_background_save_completes_it(tmp_path):
    env = dict(os.environ, LIGHTSPEED_ACCELERATOR="cpu", LIGHTSPEED_LOG_LEVEL="WARNING")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    proc = subprocess.run([sys.executable, "-c", EXIT_CHILD, str(tmp_path)], env=env, capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert read_latest(tmp_path) == "at_exit"
    assert verify_tag(tmp_path / "at_exit", "at_exit")[0] == []
