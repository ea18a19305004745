"""Writing one rank's checkpoint files, now or in the background, and completing a save across ranks.

Owns `CheckpointWriter`: the save protocol for a set of named objects per rank (stage into a tag's
staging directory, record checksums, rank 0 publishes), the host-memory snapshot that lets training
continue while a background thread writes, and handing a writer's errors back to the caller. It must
not decide what goes into a checkpoint (engine_checkpoint does) and calls collectives only from the
caller's thread.

Note (completing a save without collectives in the writer thread):
    `latest` may name a tag only once every rank's files are on disk, so someone must learn that all
    ranks finished. A collective from the background thread is unsafe: NCCL and gloo collectives on
    one group must be issued in the same order by every rank, and the training thread issues its own
    on the same group at times the writer thread cannot know. So completion goes through the
    filesystem the ranks already share (rank 0 renames the directory that holds every rank's files):

    - each rank's job writes its files into the staging directory, then its checksum manifest
      `checksums_rank<R>.json` last (atomically): the manifest's presence says "rank R is done"; a
      rank whose job fails writes `failed_rank<R>` (holding the error) instead;
    - rank 0's job, after its own files, polls the staging directory until every rank's manifest (or
      a failure marker) is there, then publishes the tag and writes `latest` (tag_dir's Note); a
      failure marker, a rank whose process is gone or stopped (the rank heartbeat, comm/heartbeat.py,
      checked every `_PEER_CHECK_S`: a rank killed mid-save ends the wait within seconds), or
      `commit_timeout_s` without news, aborts the publish and `latest` keeps its old value.

    The same job runs inline for a synchronous save. Either way the caller's thread then agrees on
    the outcome with one all-reduce (`wait`): synchronously at the end of `save`, asynchronously at
    the next `save`, `wait()` or load. Every rank therefore raises if any rank's job failed, and once
    `wait` returns on any rank, rank 0 has published. An error in a background job is also logged by
    the thread when it happens, so a process that exits without waiting (the thread is not a daemon:
    the interpreter finishes the write before it exits) still reports it.

    The snapshot: before `save` returns, every tensor to be written is copied into a host pool the
    writer keeps across saves (snapshot.py's Note: allocated once, page-locked for CUDA tensors,
    copied asynchronously on a side stream), keeping views of one storage views of one copy, so the
    files load exactly as a synchronous save's. Training may run on as soon as `save` returns, but
    must call `wait_snapshot` before it changes the state (the engine does at its next step): on
    CUDA the copies may still be reading it. The thread does not hold the training thread up:
    torch's file writer releases the GIL while it writes a record (during a 1 GiB background
    torch.save, the training thread's longest wait was 0.14 s; torch 2.13, 2 busy CPU cores,
    2026-12-01), so what a background save costs training is CPU and disk bandwidth.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightspeed._utils.logging import get_logger, warn_once
from lightspeed._utils.sizes import human_bytes
from lightspeed.checkpoint import tag_dir
from lightspeed.checkpoint.atomic import atomic_torch_save, atomic_write_bytes
from lightspeed.checkpoint.errors import CheckpointError
from lightspeed.checkpoint.integrity import file_entry, manifest_name, read_manifest, write_manifest
from lightspeed.checkpoint.snapshot import Snapshot, SnapshotPool
from lightspeed.comm import heartbeat
from lightspeed.comm.collectives import Communicator

__all__ = ["WriterOptions", "CheckpointWriter", "SaveStats", "failure_marker", "options_from_config"]

logger = get_logger(__name__)
_POLL_S = 0.02
_PEER_CHECK_S = 1.0  # how often rank 0's commit asks the heartbeat whether a waited-for rank is gone


def failure_marker(rank: int) -> str:
    return f"failed_rank{rank}"


@dataclass(frozen=True)
class WriterOptions:
    """`decoupled`: write in a background thread (DeepSpeed's `checkpoint.writer.decoupled`);
    `show_statistics`: log bytes and seconds of every save; `commit_timeout_s`: how long rank 0
    waits for the other ranks' files before giving the save up (the engine passes the communication
    timeout, ``comm.timeout_seconds``: a rank slower than that would have failed a collective too);
    `snapshot_pool`: when the engine sizes the background save's host pool, "first_save" or "startup"
    (`checkpoint.writer.snapshot_pool`)."""

    decoupled: bool = False
    show_statistics: bool = False
    commit_timeout_s: float = 600.0
    snapshot_pool: str = "first_save"


@dataclass
class SaveStats:
    """Seconds the caller was held (`stall_s`), seconds the next step waited for the snapshot's
    copies (`step_wait_s`, background saves), seconds of the write (`write_s`), bytes written."""

    tag: str
    stall_s: float = 0.0
    step_wait_s: float = 0.0
    write_s: float = 0.0
    num_bytes: int = 0


@dataclass
class _Job:
    save_dir: Path
    tag: str
    files: dict[str, Any]
    dp_rank: int
    num_ranks: int
    save_latest: bool
    ready: Snapshot | None  # the snapshot the files are, its copies perhaps still running
    stats: SaveStats
    world_ranks: list[int]  # the world rank of each rank of the save's group (for the heartbeat)
    save_id: str | None = None  # rank 0's, the same on every rank (in each manifest)


class CheckpointWriter:
    """One per engine. `save` is collective (every rank of `comm` calls it with the same tag)."""

    def __init__(self, options: WriterOptions | None = None):
        self.options = options or WriterOptions()
        self._thread: threading.Thread | None = None
        self._pending: _Job | None = None
        self._error: BaseException | None = None
        self._pool = SnapshotPool()
        self._copying: Snapshot | None = None  # the last snapshot, until the state may change
        self.last_stats: SaveStats | None = None

    # ------------------------------------------------------------------------------------ public
    def save(self, save_dir, tag: str, files: dict[str, Any], *, comm: Communicator, dp_rank: int,
             num_ranks: int, save_latest: bool = True) -> Path:
        """Write `files` ({file name: object for torch.save}) as this rank's part of `save_dir/<tag>`.
        Returns the tag directory (complete once the save has been waited for)."""
        self.wait(comm)
        start = time.perf_counter()
        save_dir = Path(save_dir)
        save_id = self._prepare(save_dir, tag, comm, dp_rank)  # the staging directory exists before any rank writes
        stats = SaveStats(tag)
        if not self.options.decoupled:
            job = _Job(save_dir, tag, files, dp_rank, num_ranks, save_latest, None, stats,
                       heartbeat.world_ranks(comm.group, num_ranks), save_id)
            with heartbeat.paused():
                error = self._run_job(job)
            self._agree(comm, job, error)
            stats.stall_s = time.perf_counter() - start
            self._report(stats)
            return save_dir / tag
        job = _Job(save_dir, tag, {}, dp_rank, num_ranks, save_latest, None, stats,
                   heartbeat.world_ranks(comm.group, num_ranks), save_id)
        self._pending, self._error = job, None
        try:
            job.ready = self._copying = self._pool.take(files)
            job.files = job.ready.files
        except Exception as err:  # e.g. out of pinned memory: an error of this save like any other,
            self._error = err  # reported on every rank at the next save or wait, as the other ranks
            self._mark_failed(tag_dir.staging_dir(save_dir, tag), dp_rank, err)  # have started theirs
            logger.error("background checkpoint save of tag %s failed: %s", tag, err)
            return save_dir / tag
        self._thread = threading.Thread(target=self._background, args=(job,), name=f"lightspeed-ckpt-{tag}")
        self._thread.start()
        stats.stall_s = time.perf_counter() - start
        return save_dir / tag

    def _prepare(self, save_dir: Path, tag: str, comm: Communicator, dp_rank: int) -> str:
        """Rank 0 prepares the staging directory; returns the save's id, rank 0's (every rank's manifest
        carries it)."""
        error = None
        save_id = uuid.uuid4().hex
        if dp_rank == 0:
            try:
                tag_dir.prepare(save_dir, tag)
            except OSError as err:
                error = f"cannot prepare {tag_dir.staging_dir(save_dir, tag)}: {err}"
        # a barrier that also tells every rank if rank 0 failed, and rank 0's id
        outcomes = comm.all_gather_object((error, save_id))
        if outcomes[0][0] is not None:
            raise CheckpointError(f"saving tag {tag}: rank 0 {outcomes[0][0]}")
        return outcomes[0][1]

    def wait(self, comm: Communicator) -> None:
        """Block until the previous background save is complete on every rank; raise (on every rank)
        a `CheckpointError` if it failed anywhere. Collective when a save is pending; a no-op otherwise."""
        job = self._pending
        if job is None:
            return
        if self._thread is not None:
            with heartbeat.paused():
                self._thread.join()
        self._thread, self._pending = None, None
        error, self._error = self._error, None
        self._copying = None  # the thread waited for the copies before it wrote
        self._agree(comm, job, error)
        self._report(job.stats)

    def wait_snapshot(self) -> None:
        """Block until the last background save's copies of the state are complete: call before
        changing the state (on CPU they are done when `save` returns). Not collective."""
        if self._copying is not None:
            waited = self._copying.synchronize()
            if self._pending is not None:
                self._pending.stats.step_wait_s += waited
            self._copying = None

    def reserve(self, state: Any) -> None:
        """Size the snapshot pool for saves of `state` now (tensors as a later save's files hold
        them), so the first background save allocates nothing; a no-op for synchronous saves."""
        if self.options.decoupled:
            self._pool.reserve(state)

    def close(self, comm: Communicator) -> None:
        """Wait for a pending save (collective then, as `wait`) and free the snapshot pool."""
        self.wait(comm)
        self._pool.release()

    @property
    def pending(self) -> bool:
        return self._pending is not None

    @property
    def writing(self) -> bool:
        """True while a background save's thread still writes (`wait` then returns without joining)."""
        return self._thread is not None and self._thread.is_alive()

    # ------------------------------------------------------------------------------------ the job
    def _background(self, job: _Job) -> None:
        error = self._run_job(job)
        if error is not None:
            self._error = error
            logger.error("background checkpoint save of tag %s failed: %s", job.tag, error)

    def _run_job(self, job: _Job) -> BaseException | None:
        staging = tag_dir.staging_dir(job.save_dir, job.tag)
        start = time.perf_counter()
        try:
            if job.ready is not None:
                job.ready.synchronize()
            entries = {}
            for name, obj in job.files.items():
                path = staging / name
                atomic_torch_save(obj, path)
                entries[name] = file_entry(path)
                job.stats.num_bytes += entries[name]["bytes"]
            write_manifest(staging, tag=job.tag, rank=job.dp_rank, num_ranks=job.num_ranks, files=entries,
                           save_id=job.save_id)
            if job.dp_rank == 0:
                self._await_ranks(job, staging)
                tag_dir.publish(job.save_dir, job.tag, save_latest=job.save_latest)
        except BaseException as err:  # noqa: BLE001 - handed to the caller's thread, never lost
            self._mark_failed(staging, job.dp_rank, err)
            return err
        finally:
            job.stats.write_s = time.perf_counter() - start
            job.files = {}  # drop the snapshot's references; the buffers go back to the pool
        return None

    def _await_ranks(self, job: _Job, staging: Path) -> None:
        deadline = time.monotonic() + self.options.commit_timeout_s
        waiting = set(range(job.num_ranks))
        next_peer_check = time.monotonic() + _PEER_CHECK_S
        while True:
            for rank in sorted(waiting):
                failed = staging / failure_marker(rank)
                if failed.exists():
                    reason = failed.read_text(errors="replace").strip()
                    raise CheckpointError(f"{staging}: rank {rank} failed to write its part of tag {job.tag} "
                                          f"({reason}); the tag is not published")
                if (staging / manifest_name(rank)).exists():
                    read_manifest(staging / manifest_name(rank), tag=job.tag, rank=rank)
                    waiting.discard(rank)
            if not waiting:
                return
            if time.monotonic() > next_peer_check:
                next_peer_check = time.monotonic() + _PEER_CHECK_S
                gone = heartbeat.gone_ranks([job.world_ranks[r] for r in sorted(waiting)])
                if gone:
                    rank, why = next(iter(gone.items()))
                    raise CheckpointError(f"{staging}: rank {rank} (world rank) cannot finish its part of tag "
                                          f"{job.tag}: {why}; the tag is not published")
            if time.monotonic() > deadline:
                raise CheckpointError(f"{staging}: ranks {sorted(waiting)} did not finish their part of tag "
                                      f"{job.tag} within {self.options.commit_timeout_s:g} s; the tag is not "
                                      "published")
            time.sleep(_POLL_S)

    @staticmethod
    def _mark_failed(staging: Path, rank: int, err: BaseException) -> None:
        try:
            text = f"{type(err).__name__}: {err}".splitlines()[0][:500]
            atomic_write_bytes(staging / failure_marker(rank), text.encode("utf-8", "replace"))
        except OSError:
            pass  # the staging directory itself may be what failed; rank 0 then times out

    def _agree(self, comm: Communicator, job: _Job, error: BaseException | None) -> None:
        # An object all-gather, not a tensor all-reduce: it runs on gloo and NCCL alike (a CPU tensor
        # cannot go through NCCL, and the writer does not know the device), and carries the reasons.
        mine = None if error is None else f"{type(error).__name__}: {error}".splitlines()[0][:300]
        outcomes = comm.all_gather_object(mine)
        failed = [r for r, reason in enumerate(outcomes) if reason is not None]
        if error is not None:
            if isinstance(error, CheckpointError) or not isinstance(error, Exception):
                raise error  # KeyboardInterrupt and friends stay what they are
            raise CheckpointError(f"saving tag {job.tag} failed on rank {job.dp_rank}: {mine}") from error
        if failed:
            raise CheckpointError(f"saving tag {job.tag} failed on rank(s) {failed} ({outcomes[failed[0]]}); "
                                  "`latest` was not moved to it")

    def _report(self, stats: SaveStats) -> None:
        self.last_stats = stats
        if self.options.show_statistics:
            rate = stats.num_bytes / max(stats.write_s, 1e-9)
            logger.info("checkpoint %s: %s written in %.3f s (%s/s), training held %.3f s (+%.3f s at the next "
                        "step)", stats.tag, human_bytes(stats.num_bytes), stats.write_s, human_bytes(rate),
                        stats.stall_s, stats.step_wait_s)


def options_from_config(checkpoint_config: Any, commit_timeout_s: float = WriterOptions.commit_timeout_s) -> WriterOptions:
    """WriterOptions from the `checkpoint` config section and the communication timeout. Without a `writer` block, saves are
    synchronous (DeepSpeed's default engine); `writer.type` PYTHON is the one built (config/support.py
    refuses the others), and its io_buffer settings, which only DeepNVMe's writer reads, are logged
    as unused."""
    writer = getattr(checkpoint_config, "writer", None)
    if writer is None:
        return WriterOptions(commit_timeout_s=commit_timeout_s)
    for key, default in (("io_buffer_size", 64 * 1024**2), ("io_buffer_double", True)):
        if getattr(writer, key) != default:
            warn_once(f"checkpoint.writer.{key} has no effect with writer type PYTHON (it sizes DeepNVMe's pinned "
                      "I/O buffers)", logger)
    if writer.snapshot_pool != "first_save" and not writer.decoupled:
        warn_once(f"checkpoint.writer.snapshot_pool={writer.snapshot_pool} has no effect without "
                  "checkpoint.writer.decoupled (only a background save snapshots the state)", logger)
    return WriterOptions(decoupled=bool(writer.decoupled), show_statistics=bool(writer.show_statistics),
                         snapshot_pool=writer.snapshot_pool, commit_timeout_s=commit_timeout_s)
