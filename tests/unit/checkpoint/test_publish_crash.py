"""A save that overwrites the tag `latest` names, killed at every point of its protocol (each file's
atomic write, the manifest, each rename of the publish, `latest`), synchronous or in the background:
`latest` always leads to a complete, verified checkpoint, old or new, and the next save recovers."""

import os
import signal
import time
import traceback
from pathlib import Path

import pytest
import torch

from lightspeed.checkpoint import atomic, engine_checkpoint
from lightspeed.checkpoint.atomic import read_latest
from lightspeed.checkpoint.tag_dir import resolve
from lightspeed.checkpoint.tag_reader import verify_tag
from lightspeed.checkpoint.writer import CheckpointWriter, WriterOptions
from lightspeed.comm.collectives import Communicator

needs_fork = pytest.mark.skipif(not hasattr(os, "fork") or not hasattr(signal, "SIGKILL"), reason="needs fork")
COMM = Communicator(None, 1)
TAG = "global_step10"


def state(version: float):
    shared = {"module": {"w": torch.full((64, 8), version), "b": torch.full((8,), version)},
              "counters": {"global_steps": int(version)}, "client_state": {"v": version}}
    strategy = {"state": {0: {"exp_avg": torch.full((512,), version)}}}
    return shared, strategy


def save(save_dir, version, decoupled=False, tag=TAG):
    shared, strategy = state(version)
    writer = CheckpointWriter(WriterOptions(decoupled=decoupled))
    engine_checkpoint.save(save_dir, tag, shared=shared, strategy_state=strategy, strategy_replicated=False,
                           comm=COMM, dp_rank=0, writer=writer)
    writer.wait(COMM)


def loaded_version(save_dir) -> float:
    """The version `latest` leads to, after checking that every tensor and the manifest agree."""
    tag = read_latest(save_dir)
    loaded = engine_checkpoint.load(save_dir, tag, dp_rank=0)
    version = float(loaded.shared["client_state"]["v"])
    for t in [*loaded.shared["module"].values(), loaded.strategy_state["state"][0]["exp_avg"]]:
        assert torch.equal(t, torch.full_like(t, version))
    assert loaded.shared["counters"]["global_steps"] == int(version)
    problems, _ = verify_tag(resolve(save_dir, tag), tag)
    assert problems == []
    return version


def protocol_events(tmp_path) -> list[tuple[str, str]]:
    """Every (fault point, file or directory name) a same-tag overwrite passes, in order."""
    seen = []
    probe = tmp_path / "probe"
    save(probe, 1.0)
    atomic._fault_hook = lambda point, path: seen.append((point, os.path.basename(path)))
    try:
        save(probe, 2.0)
    finally:
        atomic._fault_hook = None
    return seen


def fork_and_crash(body) -> int:
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            torch.set_num_threads(1)
            body()
        except BaseException:
            traceback.print_exc()
            code = 99
        finally:
            os._exit(code)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.002)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise AssertionError("child hung")


def test_protocol_passes_every_point_in_order(tmp_path):
    events = protocol_events(tmp_path)
    names = [n for _, n in events]
    # the three files, then the manifest, then the publish: old moved aside, new in place, latest, old removed
    assert names.index("checksums_rank0.json") > max(names.index(f) for f in
                                                     ("model_states.pt", "optim_states_rank0.pt", "rng_rank0.pt"))
    publish = [p for p, _ in events if p in ("publish_begin", "old_moved", "new_in_place", "latest_written",
                                              "old_removed")]
    assert publish == ["publish_begin", "old_moved", "new_in_place", "latest_written", "old_removed"]
    assert events.index(("begin", "latest")) > events.index(("new_in_place", TAG))


@needs_fork
@pytest.mark.parametrize("decoupled", [False, True], ids=["sync", "background"])
def test_kill_at_every_point_of_a_same_tag_overwrite(tmp_path, decoupled):
    events = protocol_events(tmp_path)
    new_from = events.index(("new_in_place", TAG))
    assert len(events) >= 17
    for i, event in enumerate(events):
        save_dir = tmp_path / f"kill{i}"
        save(save_dir, 1.0)

        def crash_at_i():
            count = {"n": 0}

            def hook(point, path):
                if count["n"] == i:
                    os._exit(17)
                count["n"] += 1

            atomic._fault_hook = hook
            save(save_dir, 2.0, decoupled=decoupled)

        assert fork_and_crash(crash_at_i) == 17, event
        assert read_latest(save_dir) == TAG
        expected = 2.0 if i >= new_from else 1.0  # the hook at "new_in_place" runs after that rename
        assert loaded_version(save_dir) == expected, (i, event)
        # the next save recovers whatever the crash left, and leaves no side directories
        save(save_dir, 3.0, decoupled=decoupled)
        assert loaded_version(save_dir) == 3.0
        assert sorted(p.name for p in save_dir.iterdir()) == sorted(["latest", TAG]), event


def test_load_finds_the_old_directory_between_the_renames(tmp_path):
    save(tmp_path, 1.0)
    os.replace(tmp_path / TAG, tmp_path / f".{TAG}.old")  # as a kill right after step 1 leaves it
    assert loaded_version(tmp_path) == 1.0
    assert not (tmp_path / TAG).exists()  # loading renames nothing
    save(tmp_path, 2.0)
    assert loaded_version(tmp_path) == 2.0
    assert not (tmp_path / f".{TAG}.old").exists()


def test_new_tag_save_killed_keeps_latest_on_the_previous_tag(tmp_path):
    save(tmp_path, 1.0, tag="a")

    def crash():
        atomic._fault_hook = lambda point, path: os._exit(17) if point == "publish_begin" else None
        save(tmp_path, 2.0, tag="b")

    assert fork_and_crash(crash) == 17
    assert read_latest(tmp_path) == "a" and loaded_version(tmp_path) == 1.0
    assert not (tmp_path / "b").exists() and (tmp_path / ".b.tmp").exists()
    save(tmp_path, 2.0, tag="b")
    assert read_latest(tmp_path) == "b" and loaded_version(tmp_path) == 2.0
    assert not (tmp_path / ".b.tmp").exists()


def test_rng_state_is_returned_not_applied(tmp_path):
    save(tmp_path, 1.0)
    torch.manual_seed(5)
    before = torch.get_rng_state()
    loaded = engine_checkpoint.load(tmp_path, None, dp_rank=0)
    assert torch.equal(torch.get_rng_state(), before) and loaded.rng_state is not None
    assert Path(loaded.path).name == TAG
