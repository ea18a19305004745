"""The rank heartbeat: every rank publishes, every few seconds, that it is alive, how long it has gone
without progress and which collective it waits in; a rank that waits in a collective for
``comm.stall_seconds`` names the peer that keeps it waiting and ends the job, long before the
communication timeout.

Owns `Heartbeat` (one background thread per process, started by `init_distributed` when the world has
more than one rank), `paused` (the context manager that stops this rank's stall clock during work that
legitimately makes no collective progress: checkpoint I/O, torch.compile) and `gone_ranks` (for code
that polls for peers outside collectives, the checkpoint writer's commit). Must not issue collectives
or hold the process group: it talks through the process group's key-value store only (TCPStore).

Note: what is a stall, and who reports it
    Progress is a completed collective (comm/watchdog.py counts them) or the end of a `paused` block.
    A rank writes ``lightspeed/heartbeat/<rank>`` to the store every `interval_s`: its wall time, its
    seconds without progress, the collective it waits in (or none), whether it is paused, its host and
    pid. Only a rank that has itself waited in one collective for `stall_s` reads its peers'
    entries, so a long phase without collectives (evaluation, data loading) is never reported and the
    store sees one write per rank per beat in normal training. The peer it names:
    - one whose heartbeat is older than `stall_s` (the process is stopped, or its host is gone), or
      whose pid is gone on this host (killed);
    - else one that waits in no collective, is not paused, and has made no progress for `stall_s`
      (its main thread is stuck in user code: a deadlock, a sleep, an endless loop).
    Ranks that wait in collectives themselves are the stalled rank's victims, not it. So work that
    one rank does alone for longer than `stall_s` while the others wait (evaluation on rank 0 before
    a barrier) belongs inside `paused()`, or wants a larger ``comm.stall_seconds``. With no such
    peer (ranks wait in different collectives: a program error) nothing is reported and the
    communication timeout ends the job. Heartbeat ages compare wall clocks across hosts, so they
    assume hosts whose clocks agree to well within `stall_s` (NTP).

    The report goes through the collective watchdog (one line naming the stalled rank, the reason and
    this rank's collective; the error file; every rank's stacks through the launcher, or this rank's
    own), then this process exits with `EXIT_COMM_TIMEOUT`: the launcher or torchrun then stops the
    other ranks, and without either the other waiting ranks report it too. The named rank, when it
    still runs (or once the launcher resumed it to dump its stacks), reads the store's
    ``lightspeed/heartbeat/stalled`` entry, reports itself the same way (its stacks, its error file,
    later than the reporter's, so the launcher's line is the reporter's) and exits too, so no rank is
    left waiting on it.

    A rank that waits in a collective while its beats fail to reach the store `_STORE_FAILURES` times
    in a row reports that and exits: the store's host (rank 0, or the launcher's agent) is gone, and so
    is the job. A rank that waits in nothing is left alone (it may simply outlive rank 0 at the end).

    The thread never blocks interpreter exit: it is a daemon, `stop` (called by the exit handler
    before the process group is destroyed) ends it between beats, and a beat's store calls are
    short (a check before every read, so no read waits for a missing key).
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import sys
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator, Optional

from lightspeed.comm import watchdog

KEY = "lightspeed/heartbeat/"
STALLED_KEY = KEY + "stalled"
DEFAULT_STALL_S = 60.0
_STORE_FAILURES = 3  # beats in a row that fail to reach the store before this rank gives up


def _interval(stall_s: float) -> float:
    return max(0.2, min(2.0, stall_s / 4))


class Heartbeat:
    """This process's heartbeat thread for `rank` of `world_size`, through `store` (rules in the Note)."""

    def __init__(self, store: Any, rank: int, world_size: int, stall_s: float = DEFAULT_STALL_S):
        if not stall_s > 0:
            raise ValueError(f"comm.stall_seconds must be positive (got {stall_s})")
        self.store, self.rank, self.world_size = store, rank, world_size
        self.stall_s = float(stall_s)
        self.host, self.pid = socket.gethostname(), os.getpid()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lightspeed-heartbeat", daemon=True)

    # ------------------------------------------------------------------ this rank
    def start(self) -> "Heartbeat":
        self._beat()  # peers can read this rank as soon as init_distributed returns
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)

    def _idle_s(self) -> float:
        dog = watchdog.current()
        last = max(_PAUSE["resumed"], dog.last_progress if dog is not None else 0.0)
        return time.monotonic() - last

    def _beat(self) -> None:
        dog = watchdog.current()
        oldest = dog.oldest() if dog is not None else None
        state = {"time": time.time(), "idle_s": self._idle_s(), "op": oldest[1] if oldest else None,
                 "paused": _PAUSE["count"] > 0, "host": self.host, "pid": self.pid}
        self.store.set(f"{KEY}{self.rank}", json.dumps(state))

    # ------------------------------------------------------------------ peers
    def peer(self, rank: int) -> Optional[dict]:
        """Rank `rank`'s last heartbeat, or None when it has written none."""
        key = f"{KEY}{rank}"
        if not self.store.check([key]):
            return None
        return json.loads(self.store.get(key))

    def why_stalled(self, rank: int, state: Optional[dict]) -> Optional[str]:
        """Why peer `rank` (its heartbeat `state`) keeps others waiting, or None (rules in the Note)."""
        if state is None:
            return "it never started its heartbeat"
        age = time.time() - state["time"]
        if state["host"] == self.host and not _alive(state["pid"]):
            return f"its process (pid {state['pid']}) is gone"
        if age >= self.stall_s:
            return f"its heartbeat stopped {age:.0f} s ago, so its process is stopped, hung or gone"
        if state["op"] is None and not state["paused"] and state["idle_s"] >= self.stall_s:
            return f"it waits in no collective and made no progress for {state['idle_s']:.0f} s"
        return None

    def gone(self, rank: int) -> Optional[str]:
        """Why peer `rank` can make no more progress (dead or stopped), or None while it lives."""
        reason = self.why_stalled(rank, self.peer(rank))
        return reason if reason is not None and "waits in no collective" not in reason else None

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        failures = 0
        while not self._stop.wait(_interval(self.stall_s)):  # stall_s may change: set_stall_seconds
            try:
                self._beat()
                self._check()
                failures = 0
            except Exception as e:
                failures += 1
                if self._stop.is_set():
                    return
                dog = watchdog.current()
                waiting = dog is not None and dog.oldest() is not None
                # its host (rank 0's, or the launcher's) is gone; only a rank waiting in a collective has
                # no way on: one that finished its work may outlive rank 0 and exit as it pleases
                if failures >= _STORE_FAILURES and waiting:
                    dog.report(f"the process group's store is unreachable ({type(e).__name__}: "
                               f"{str(e).splitlines()[0] if str(e) else ''})",
                               hint="the rank or launcher that hosts it is gone")
                    self._exit("")
                    return

    def _check(self) -> None:
        if self.store.check([STALLED_KEY]):
            named, reporter = self.store.get(STALLED_KEY).decode().split(",")
            dog = watchdog.current()
            if int(named) == self.rank and dog is not None:
                # reported as a collective's failure, after the reporter's: the launcher names the reporter
                dog.report(f"named as stalled by rank {reporter}", hint=f"comm.stall_seconds is {self.stall_s:g}")
                self._exit("")
        dog = watchdog.current()
        oldest = dog.oldest() if dog is not None else None
        if oldest is None or oldest[2] < self.stall_s:
            return
        for rank in range(self.world_size):
            if rank == self.rank:
                continue
            reason = self.why_stalled(rank, self.peer(rank))
            if reason is not None:
                # the report (its error file's time) first, then the name: the named rank reports after it,
                # so the launcher's first failure is this report, which says what this rank waits in
                dog.report(f"rank {rank} stalled: {reason}; this rank waits in {oldest[1]} for "
                           f"{oldest[2]:.0f} s", hint=f"comm.stall_seconds is {self.stall_s:g}")
                self.store.set(STALLED_KEY, f"{rank},{self.rank}")
                time.sleep(2 * _interval(self.stall_s))  # the store may live here: let the named rank read it
                self._exit("")
                return

    def _exit(self, text: str) -> None:
        if text:
            sys.stderr.write(f"lightspeed: rank {self.rank}: {text}")
        sys.stderr.flush()
        os._exit(watchdog.EXIT_COMM_TIMEOUT)


def _alive(pid: int) -> bool:
    """Whether process `pid` of this host runs (a zombie, killed but not yet reaped by its parent, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except (OSError, IndexError):  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True


_HEARTBEAT: Optional[Heartbeat] = None
_EXIT_HOOKED = [False]


def install(store: Any, rank: int, world_size: int, stall_s: float = DEFAULT_STALL_S) -> Optional[Heartbeat]:
    """Start this process's heartbeat (replacing an earlier one); None for a world of one rank."""
    global _HEARTBEAT
    uninstall()
    if world_size > 1:
        _HEARTBEAT = Heartbeat(store, rank, world_size, stall_s).start()
        if not _EXIT_HOOKED[0]:  # stopped while the interpreter is whole, also without init_distributed's handler
            atexit.register(uninstall)
            _EXIT_HOOKED[0] = True
        if "torch._dynamo" in sys.modules:  # else engine.compile() hooks it; importing dynamo costs seconds
            pause_during_compilation()
    return _HEARTBEAT


def uninstall() -> None:
    """Stop the heartbeat (at exit, before the process group is destroyed)."""
    global _HEARTBEAT
    if _HEARTBEAT is not None:
        _HEARTBEAT.stop()
        _HEARTBEAT = None


def current() -> Optional[Heartbeat]:
    return _HEARTBEAT


def set_stall_seconds(seconds: float) -> None:
    """``comm.stall_seconds`` from the ds_config, once `initialize()` has read it. Starts the heartbeat
    when the process group was started without `init_distributed` (torch's own init_process_group,
    as accelerate and the HF Trainer do); it reports stalls only where the collective watchdog runs."""
    if not seconds > 0:
        raise ValueError(f"comm.stall_seconds must be positive (got {seconds})")
    if _HEARTBEAT is not None:
        _HEARTBEAT.stall_s = float(seconds)
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        try:
            store = dist.distributed_c10d._get_default_store()
        except (RuntimeError, ValueError):  # a backend started without a store (MPI)
            return
        install(store, dist.get_rank(), dist.get_world_size(), seconds)


_PAUSE = {"count": 0, "resumed": time.monotonic()}  # blocks inside `paused`; when the last one ended
_PAUSE_LOCK = threading.Lock()
_COMPILE_HOOKED = [False]


def _pause(delta: int) -> None:
    with _PAUSE_LOCK:
        _PAUSE["count"] = max(0, _PAUSE["count"] + delta)
        if delta < 0:
            _PAUSE["resumed"] = time.monotonic()


@contextmanager
def paused() -> Iterator[None]:
    """Stop this rank's stall clock for the block (checkpoint I/O, compilation): the rank is not
    reported as stalled while inside, and leaving the block counts as progress."""
    _pause(+1)
    try:
        yield
    finally:
        _pause(-1)


def pause_during_compilation() -> None:
    """Pause the stall clock while torch.compile compiles (dynamo's compile start/end callbacks), for
    every compilation of this process from now on; once per process."""
    if _COMPILE_HOOKED[0]:
        return
    from torch._dynamo.callback import callback_handler

    callback_handler.register_start_callback(lambda args: _pause(+1))
    callback_handler.register_end_callback(lambda args: _pause(-1))
    _COMPILE_HOOKED[0] = True


def world_ranks(group: Any, size: int) -> list[int]:
    """The world ranks of `group`'s ranks 0..size-1 (None: the default group)."""
    if group is None:
        return list(range(size))
    import torch.distributed as dist

    return [dist.get_global_rank(group, r) for r in range(size)]


def gone_ranks(world_ranks: list[int]) -> dict[int, str]:
    """{world rank: why} for those of `world_ranks` whose process is gone or stopped (see `Heartbeat.gone`);
    empty without a heartbeat."""
    beat = _HEARTBEAT
    if beat is None:
        return {}
    found = {}
    for rank in world_ranks:
        if rank != beat.rank:
            try:
                reason = beat.gone(rank)
            except Exception as e:  # the store is gone: its host (rank 0's) died
                reason = f"the rendezvous store is unreachable ({type(e).__name__})"
            if reason is not None:
                found[rank] = reason
    return found
