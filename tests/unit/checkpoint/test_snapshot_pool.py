"""The background save's host snapshot pool (checkpoint/snapshot.py): allocated once and reused by
every save, grown when the state grows, its files equal to a synchronous save's byte for byte, and
the engine's next step waits for the copies before it changes the state. The CPU copies are done on
return, so the ordering is checked with a copier that plays an asynchronous device (`LateCopier`):
it hands back an event to wait on, as a CUDA side stream would, and completes the copies only when
waited for."""

import threading

import pytest
import torch

import lightspeed
from lightspeed.checkpoint.snapshot import SnapshotPool
from lightspeed.checkpoint.writer import CheckpointWriter, WriterOptions, options_from_config
from lightspeed.comm.collectives import Communicator
from lightspeed.config import load
from lightspeed.testing.models import TinyMLP, regression_data

COMM = Communicator(None, 1)
BATCH = 8


def _state(scale: int = 1) -> dict:
    flat = torch.arange(40.0 * scale)
    return {"a": flat[:8], "b": flat[8:].view(-1, 4)[:, 1:], "c": torch.ones(5, dtype=torch.bfloat16),
            "steps": [torch.tensor(3), torch.tensor(4)], "empty": torch.empty(0), "n": 7}


def _ptrs(snapshot) -> set[int]:
    out = set()

    def walk(o):
        if torch.is_tensor(o):
            if o.untyped_storage().nbytes():
                out.add(o.untyped_storage().data_ptr())
        elif isinstance(o, dict):
            for v in o.values():
                walk(v)
        elif isinstance(o, list):
            for v in o:
                walk(v)

    walk(snapshot.files)
    return out


def test_the_pool_is_allocated_once_and_reused():
    pool = SnapshotPool()
    first = pool.take(_state())
    assert pool.num_allocations == 1
    first_ptrs = _ptrs(first)
    second = pool.take(_state())
    assert pool.num_allocations == 1 and _ptrs(second) == first_ptrs  # the same memory, nothing new
    assert torch.equal(second.files["b"], _state()["b"]) and second.files["n"] == 7


def test_a_reserved_pool_fits_the_state_in_any_order():
    pool = SnapshotPool()
    pool.reserve({"rng": torch.zeros(100, dtype=torch.uint8), "state": _state()})
    assert pool.num_allocations == 1
    snapshot = pool.take({"state": dict(reversed(list(_state().items()))), "rng": torch.zeros(100, dtype=torch.uint8)})
    assert pool.num_allocations == 1 and torch.equal(snapshot.files["state"]["a"], torch.arange(8.0))


def test_a_bigger_state_grows_the_pool_once_and_a_smaller_one_reuses_it():
    pool = SnapshotPool()
    pool.take(_state())
    small_bytes = pool.nbytes
    bigger = pool.take(_state(scale=3))
    assert pool.num_allocations == 2 and pool.nbytes > small_bytes
    assert torch.equal(bigger.files["b"], _state(scale=3)["b"])
    pool.take(_state(scale=3))
    pool.take(_state())
    assert pool.num_allocations == 2


def test_many_growths_end_in_one_slab():
    pool = SnapshotPool()
    for scale in range(1, 7):
        pool.take({"x": torch.zeros(1000 * scale)})
    assert len(pool._slabs) <= 4
    pool.release()
    assert pool.nbytes == 0


def _files(path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.glob("*.pt"))}


def test_background_files_equal_a_synchronous_save_byte_for_byte(tmp_path):
    state = {"model.pt": {"module": _state(), "meta": {"step": 3}},
             "optim.pt": {"exp_avg": torch.randn(7, 3).t(), "big": torch.randn(2, 300_000)[:, 1:]}}  # > 1 MiB
    CheckpointWriter().save(tmp_path / "sync", "t", state, comm=COMM, dp_rank=0, num_ranks=1)
    writer = CheckpointWriter(WriterOptions(decoupled=True))
    for tag in ("t", "u"):  # the second save reuses the pool
        writer.save(tmp_path / "async", tag, state, comm=COMM, dp_rank=0, num_ranks=1)
        writer.wait(COMM)
        assert _files(tmp_path / "async" / tag) == _files(tmp_path / "sync" / "t")
    assert writer._pool.num_allocations == 1
    writer.close(COMM)
    assert writer._pool.nbytes == 0


class _Event:
    """The copies' completion on a device that is always late for the training thread: they run when
    the thread that queued them waits on the event, and only after 5 s for any other thread (the
    writer's), so a state change before that wait reaches the files every time."""

    def __init__(self, pairs):
        self._pairs, self._lock, self._done = pairs, threading.Lock(), threading.Event()
        self._owner = threading.get_ident()
        self.ran_by = None

    def _run(self):
        with self._lock:
            if not self._done.is_set():
                for dst, src in self._pairs:
                    dst.copy_(src)
                self.ran_by = threading.get_ident()
                self._done.set()

    def synchronize(self):
        if threading.get_ident() == self._owner or not self._done.wait(5.0):
            self._run()


class LateCopier:
    """An asynchronous device for `SnapshotPool`: queued copies complete at an `_Event`."""

    events: list = []

    def __init__(self, device):
        self.device = device

    def copy_all(self, pairs):
        event = _Event(pairs)
        LateCopier.events.append(event)
        return event


def _engine(decoupled: bool, pool: str = "first_save", stage: int = 0):
    torch.manual_seed(7)
    config = {"train_batch_size": BATCH, "steps_per_print": 1000, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "Adam", "params": {"lr": 0.01, "weight_decay": 0.01}}}
    if decoupled:
        config["checkpoint"] = {"writer": {"type": "python", "decoupled": True, "snapshot_pool": pool}}
    engine, *_ = lightspeed.initialize(model=TinyMLP(), config=config, dist_init_required=False)
    return engine


def _train(engine, steps: int, start: int = 0) -> None:
    x, y = regression_data(BATCH * 10)
    for s in range(start, start + steps):
        loss = engine(x[s * BATCH:(s + 1) * BATCH], y[s * BATCH:(s + 1) * BATCH])
        engine.backward(loss)
        engine.step()


def test_the_step_after_a_save_waits_for_the_copies(tmp_path):
    sync, background = _engine(False), _engine(True)
    background._checkpoint_writer._pool._copier_for = LateCopier
    _train(sync, 2)
    _train(background, 2)
    for _ in range(2):  # the second save reuses the pool, with the same wait
        tag = f"global_step{sync.global_steps}"
        background.save_checkpoint(tmp_path / "async")  # copies not run yet
        sync.save_checkpoint(tmp_path / "sync")
        _train(background, 1, start=sync.global_steps)  # changes parameters and optimizer state in place
        _train(sync, 1, start=sync.global_steps)
        background.wait_checkpoint()
        assert _files(tmp_path / "async" / tag) == _files(tmp_path / "sync" / tag)
        assert LateCopier.events[-1].ran_by == threading.get_ident()  # the step waited for them
    assert background._checkpoint_writer._pool.num_allocations == 1
    background.destroy()
    assert background._checkpoint_writer._pool.nbytes == 0


@pytest.mark.parametrize("pool, stage, allocations_after_step", [("first_save", 0, 0), ("startup", 0, 2),
                                                                 ("startup", 3, 2)])
def test_snapshot_pool_startup_allocates_before_any_save(tmp_path, pool, stage, allocations_after_step):
    engine = _engine(True, pool, stage)
    writer = engine._checkpoint_writer
    assert writer._pool.num_allocations == (1 if pool == "startup" else 0)  # startup: what exists at build
    _train(engine, 1)  # startup: tops the pool up with the optimizer state the step created
    assert writer._pool.num_allocations == allocations_after_step
    for _ in range(2):
        engine.save_checkpoint(tmp_path)
        _train(engine, 1, start=engine.global_steps)
        engine.wait_checkpoint()
    assert writer._pool.num_allocations == (allocations_after_step or 1)  # no save allocated after startup


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_snapshot_is_page_locked_asynchronous_and_keeps_temporaries_alive():
    pool = SnapshotPool()
    torch.manual_seed(0)
    weight = torch.randn(1024, 1024, device="cuda")
    expected = weight.cpu()
    for _ in range(2):
        snapshot = pool.take({"w": weight, "v": weight[3:5], "t": weight * 2})  # `t`: freed on return
        torch.zeros(1024, 1024, device="cuda")  # would take the temporary's memory if it were not recorded
        assert len(snapshot.events) == 1
        snapshot.synchronize()
        files = snapshot.files
        assert files["w"].is_pinned()
        assert files["w"].untyped_storage().data_ptr() == files["v"].untyped_storage().data_ptr()
        assert torch.equal(files["w"], expected) and torch.equal(files["t"], expected * 2)
    assert pool.num_allocations == 1


def test_snapshot_pool_without_a_background_writer_is_named_as_having_no_effect(ls_caplog):
    cfg = load({"train_batch_size": 8, "checkpoint": {"writer": {"type": "python", "snapshot_pool": "Startup"}}},
               world_size=1)
    options = options_from_config(cfg.checkpoint)
    assert options.snapshot_pool == "startup" and not options.decoupled
    assert "checkpoint.writer.snapshot_pool=startup has no effect without checkpoint.writer.decoupled" in ls_caplog.text
    writer = CheckpointWriter(options)
    writer.reserve(_state())  # a synchronous writer keeps no pool
    assert writer._pool.num_allocations == 0
