"""Stall reports for collectives: which collective a rank waits in, and what every rank was doing when one
of them stopped making progress.

Owns the process's `CollectiveWatchdog` (installed by `init_distributed`), which `Communicator` wraps
around every blocking wait of a collective (the call of a synchronous one, `wait()` of an asynchronous
one: an asynchronous handle nobody waits on is no stall). A wait that has not ended within the
communication timeout (the one given to torch.distributed, so gloo raises and NCCL aborts at about the
same moment) is reported once per process:

- one line on stderr naming the rank, the collective (op, bytes, group size) and the timeout;
- the same line in torch.distributed.elastic's error file (TORCHELASTIC_ERROR_FILE), so the launcher
  ends the job with it as the reason;
- the Python stacks: under the `lightspeed` launcher (LIGHTSPEED_AGENT_PID is this process's parent)
  the launcher is signalled and dumps every local rank's stacks, this one's included, one rank at a
  time; under any other launcher this rank dumps its own threads' stacks.

Under torch.distributed.elastic (the `lightspeed` launcher, torchrun) `install` also records an uncaught
exception's first line in the error file, with the precise time (`ERROR_TIME_KEY`) the launcher orders
failures by (launcher/exits.py), so a job ends naming the rank that failed first and its own error.

A collective that raised (gloo's timeout) is reported from the waiting thread, then the error goes on.
One that neither completes nor raises (a hung NCCL call with error handling off) is reported by the
watchdog thread, which then ends the process with `EXIT_COMM_TIMEOUT`.

Must not: issue collectives, or change what a collective does; it only watches. Writes to stderr
directly (not the rank-0 logger): a dying rank's report must appear whatever its rank, as
faulthandler's own output does.
"""

from __future__ import annotations

import faulthandler
import itertools
import json
import os
import signal
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from typing import Iterator, Optional

from lightspeed._utils.sizes import human_bytes

EXIT_COMM_TIMEOUT = 124  # coreutils timeout's status: the launcher reports it as a stall
AGENT_PID_ENV = "LIGHTSPEED_AGENT_PID"
STACKS_SIGNAL = signal.SIGUSR1  # the launcher -> a worker: dump your stacks
STALL_SIGNAL = signal.SIGUSR2  # a worker -> the launcher: a rank stalled, dump every rank's stacks
DUMP_PAUSE_S = 0.3  # the launcher's pause after each rank's dump, so dumps do not interleave
ERROR_TIME_KEY = "lightspeed_time"  # error-file key: time.time() of the failure, finer than torch's seconds
ERROR_COLLECTIVE_KEY = "lightspeed_collective"  # error-file key: true when a collective failed or stalled


class CollectiveWatchdog:
    """Tracks the collectives in flight in this process and reports one older than `timeout_s`."""

    def __init__(self, timeout_s: float, rank: int, poll_s: Optional[float] = None):
        if timeout_s <= 0:
            raise ValueError(f"communication timeout must be positive (got {timeout_s} s)")
        self.timeout_s = float(timeout_s)
        self.rank = rank
        self.poll_s = poll_s if poll_s is not None else min(1.0, self.timeout_s / 10)
        self._pending: dict[int, tuple[object, float]] = {}  # token -> (description, start)
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._report_lock = threading.Lock()
        self._reported = False
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self.last_progress = time.monotonic()  # when a wait last ended normally (the heartbeat's progress)

    # ------------------------------------------------------------------ tracking
    @contextmanager
    def watch(self, desc) -> Iterator[None]:
        """Wrap a blocking wait for the collective `desc` (text, or `(name, bytes or None, group size)`,
        formatted only if it is reported): a wait older than the timeout is reported by the watchdog
        thread; an error raised by the wait is reported here, then re-raised."""
        token = next(self._ids)
        since = time.monotonic()
        with self._lock:
            self._pending[token] = (desc, since)
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="lightspeed-comm-watchdog", daemon=True)
                self._thread.start()
        try:
            yield
        except Exception as e:
            with self._lock:
                self._pending.pop(token, None)
            first = str(e).splitlines()[0] if str(e) else ""
            self.report(f"{describe(desc)} failed after {time.monotonic() - since:.0f} s: {type(e).__name__}: {first}")
            raise
        with self._lock:
            self._pending.pop(token, None)
        self.last_progress = time.monotonic()

    def oldest(self) -> Optional[tuple[int, str, float]]:
        """(token, description, seconds waited) of the oldest collective in flight, or None."""
        with self._lock:
            if not self._pending:
                return None
            token, (desc, since) = min(self._pending.items(), key=lambda kv: kv[1][1])
        return token, describe(desc), time.monotonic() - since

    def close(self) -> None:
        self._stop.set()

    # ------------------------------------------------------------------ reporting
    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            oldest = self.oldest()
            if oldest is None or oldest[2] < self.timeout_s:
                continue
            token, desc, age = oldest
            self.report(f"{desc} did not complete within the communication timeout of {self.timeout_s:g} s "
                        f"(waited {age:.0f} s)")
            with self._lock:
                still_pending = token in self._pending
            if still_pending:  # neither completed nor raised: nothing else will end this rank
                sys.stderr.flush()
                os._exit(EXIT_COMM_TIMEOUT)
            return

    def report(self, what: str, hint: str = "a peer rank stopped, hung or died (timeout: "
               "LIGHTSPEED_COMM_TIMEOUT, --comm_timeout, comm.timeout_seconds or init_distributed(timeout=))") -> None:
        """Report a stall once per process (see the module docstring); a second caller waits for the
        first report to finish, so the process does not exit while the launcher dumps the stacks."""
        with self._report_lock:
            if self._reported:
                return
            self._reported = True
            line = f"lightspeed: rank {self.rank}: {what}; {hint}"
            sys.stderr.write(line + "\n")
            sys.stderr.flush()
            _write_error_file(line, collective=True)
            if _launcher_pid() is not None:
                os.kill(_launcher_pid(), STALL_SIGNAL)
                local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
                time.sleep(1.0 + DUMP_PAUSE_S * (local_ranks + 1))
            else:
                sys.stderr.write(f"lightspeed: rank {self.rank}: stacks of every thread:\n{format_stacks()}")
                sys.stderr.flush()


def format_stacks() -> str:
    """Every thread's Python stack, most recent call last, each under its thread's name."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        parts.append(f"Thread {names.get(ident, ident)}:\n{''.join(traceback.format_stack(frame))}")
    return "\n".join(parts)


def describe(desc) -> str:
    """A collective's description for a report (see `CollectiveWatchdog.watch`)."""
    if isinstance(desc, str):
        return desc
    name, num_bytes, group_size = desc
    size = f" of {human_bytes(num_bytes)}" if num_bytes is not None else ""
    return f"{name}{size} on a group of {group_size} ranks"


def _launcher_pid() -> Optional[int]:
    """The `lightspeed` launcher's agent, when it is this process's parent (it handles STALL_SIGNAL)."""
    value = os.environ.get(AGENT_PID_ENV, "")
    return int(value) if value.isdigit() and int(value) == os.getppid() else None


def _write_error_file(line: str, collective: bool = False) -> None:
    """The reason in torch.distributed.elastic's error-file format, unless the file already has one;
    `collective`: the reason is a collective that failed or stalled (what a peer's failure causes)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or os.path.exists(path):
        return
    try:
        with open(path, "w") as f:
            now = time.time()
            json.dump({"message": line, "timestamp": int(now), ERROR_TIME_KEY: now, ERROR_COLLECTIVE_KEY: collective}, f)
    except OSError:
        pass  # the stderr line is the report; the file only improves the launcher's summary


_WATCHDOG: Optional[CollectiveWatchdog] = None


def install(timeout_s: float, rank: int) -> CollectiveWatchdog:
    """Make this process's watchdog (replacing an earlier one), and under the `lightspeed` launcher let
    it ask for this rank's stacks with STACKS_SIGNAL."""
    global _WATCHDOG
    if _WATCHDOG is not None:
        _WATCHDOG.close()
    _WATCHDOG = CollectiveWatchdog(timeout_s, rank)
    if _launcher_pid() is not None:
        faulthandler.register(STACKS_SIGNAL, file=sys.stderr, all_threads=True, chain=False)
    if os.environ.get("TORCHELASTIC_ERROR_FILE") and not isinstance(sys.excepthook, _RecordUncaught):
        sys.excepthook = _RecordUncaught(sys.excepthook)
    return _WATCHDOG


class _RecordUncaught:
    """sys.excepthook that writes the exception's first line to the error file (unless torch's @record
    or a stall report wrote one first), then hands the exception to the previous hook."""

    def __init__(self, previous):
        self.previous = previous

    def __call__(self, kind, value, tb) -> None:
        if not issubclass(kind, KeyboardInterrupt):
            text = str(value).strip()
            _write_error_file(f"{kind.__name__}: {text.splitlines()[0]}" if text else kind.__name__)
        self.previous(kind, value, tb)


def uninstall() -> None:
    """At exit: stop the watchdog, and ignore STACKS_SIGNAL from here on. faulthandler's handler is
    removed when the interpreter finalizes, and the signal's default action would then end this
    process (status 138) when the launcher asks for stacks while this rank exits after its error."""
    global _WATCHDOG
    if _WATCHDOG is not None:
        _WATCHDOG.close()
        _WATCHDOG = None
    if _launcher_pid() is not None and threading.current_thread() is threading.main_thread():
        faulthandler.unregister(STACKS_SIGNAL)
        signal.signal(STACKS_SIGNAL, signal.SIG_IGN)


def current() -> Optional[CollectiveWatchdog]:
    """The watchdog `init_distributed` installed, or None (process group started some other way)."""
    return _WATCHDOG
