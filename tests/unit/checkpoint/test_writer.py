"""The writer's cross-rank completion through the filesystem, without processes: rank 0's job plays
itself, the test plays rank 1 by writing into the staging directory. Rank 0 publishes only once rank
1's manifest is there, gives up on a failure marker or a timeout, and the snapshot keeps views of one
storage views of one copy."""

import threading
import time

import pytest
import torch

from lightspeed.checkpoint import tag_dir
from lightspeed.checkpoint.atomic import atomic_torch_save, atomic_write_bytes, read_latest
from lightspeed.checkpoint.errors import CheckpointError
from lightspeed.checkpoint.integrity import file_entry, manifest_name, read_manifest, write_manifest
from lightspeed.checkpoint.snapshot import SnapshotPool
from lightspeed.checkpoint.tag_reader import TagReader, verify_tag
from lightspeed.checkpoint.writer import CheckpointWriter, WriterOptions, failure_marker
from lightspeed.comm.collectives import Communicator

COMM = Communicator(None, 1)


def play_rank1(save_dir, tag, delay=0.0):
    time.sleep(delay)
    staging = tag_dir.staging_dir(save_dir, tag)
    atomic_torch_save({"x": torch.arange(4)}, staging / "b.pt")
    for _ in range(500):  # rank 0's save id, which a real save shares through its collective
        if (staging / manifest_name(0)).exists():
            break
        time.sleep(0.01)
    save_id = read_manifest(staging / manifest_name(0), tag=tag, rank=0).save_id
    write_manifest(staging, tag=tag, rank=1, num_ranks=2, files={"b.pt": file_entry(staging / "b.pt")}, save_id=save_id)


def test_rank0_publishes_only_after_rank1_is_done(tmp_path):
    writer = CheckpointWriter(WriterOptions(decoupled=True))
    writer.save(tmp_path, "t", {"a.pt": {"w": torch.ones(3)}}, comm=COMM, dp_rank=0, num_ranks=2)
    time.sleep(0.3)
    assert not (tmp_path / "t").exists() and read_latest(tmp_path) is None  # waiting for rank 1
    play_rank1(tmp_path, "t")
    writer.wait(COMM)
    assert read_latest(tmp_path) == "t"
    reader = TagReader(tmp_path / "t", "t")
    assert torch.equal(reader.load("b.pt", writer_rank=1)["x"], torch.arange(4))
    assert torch.equal(reader.load("a.pt", writer_rank=0)["w"], torch.ones(3))
    assert verify_tag(tmp_path / "t", "t") == ([], [])


def test_a_failure_marker_stops_the_publish(tmp_path):
    writer = CheckpointWriter(WriterOptions(decoupled=True))
    writer.save(tmp_path, "t", {"a.pt": {"w": torch.ones(3)}}, comm=COMM, dp_rank=0, num_ranks=2)
    atomic_write_bytes(tag_dir.staging_dir(tmp_path, "t") / failure_marker(1), b"OSError: disk full")
    with pytest.raises(CheckpointError, match=r"rank 1 failed to write its part of tag t \(OSError: disk full\)"):
        writer.wait(COMM)
    assert not (tmp_path / "t").exists() and read_latest(tmp_path) is None
    writer.wait(COMM)  # reported once


def test_rank0_gives_up_after_the_timeout(tmp_path):
    writer = CheckpointWriter(WriterOptions(commit_timeout_s=0.2))
    with pytest.raises(CheckpointError, match=r"ranks \[1\] did not finish .* within 0.2 s"):
        writer.save(tmp_path, "t", {"a.pt": {"w": torch.ones(3)}}, comm=COMM, dp_rank=0, num_ranks=2)
    assert not (tmp_path / "t").exists()


def test_synchronous_save_waits_for_a_slow_rank(tmp_path):
    other = threading.Thread(target=play_rank1, args=(tmp_path, "t", 0.3))
    writer = CheckpointWriter()
    # prepare() runs inside save(): start rank 1 only once the staging directory exists
    real_prepare = tag_dir.prepare

    def prepare_then_start(save_dir, tag):
        out = real_prepare(save_dir, tag)
        other.start()
        return out

    tag_dir.prepare = prepare_then_start
    try:
        writer.save(tmp_path, "t", {"a.pt": {"w": torch.ones(3)}}, comm=COMM, dp_rank=0, num_ranks=2)
    finally:
        tag_dir.prepare = real_prepare
    other.join()
    assert read_latest(tmp_path) == "t" and verify_tag(tmp_path / "t", "t")[0] == []


def test_snapshot_keeps_shared_storage_and_detaches_from_training(tmp_path):
    flat = torch.arange(10.0)
    state = {"a": flat[:4], "b": flat[4:].view(2, 3), "n": [1, (2, torch.Size([3]))]}
    snapshot = SnapshotPool().take(state)
    assert snapshot.events == []  # CPU: copied on return
    snap = snapshot.files
    assert snap["a"].untyped_storage().data_ptr() == snap["b"].untyped_storage().data_ptr()
    assert snap["a"].untyped_storage().data_ptr() != flat.untyped_storage().data_ptr()
    flat.add_(100)  # training moves on
    assert torch.equal(snap["a"], torch.arange(4.0)) and torch.equal(snap["b"], torch.arange(4.0, 10).view(2, 3))
    assert snap["n"] == [1, (2, torch.Size([3]))]
