"""The rank heartbeat's rules, through an in-memory store (no process group): which peer a waiting rank
names, and the stall clock's pauses. The end-to-end stalls (SIGSTOP, a sleeping rank, a rank killed
mid-save, with and without the launcher) are in tests/launcher/test_local_launch.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from lightspeed.comm import heartbeat, watchdog


class FakeStore:
    def __init__(self):
        self.data: dict[str, bytes] = {}

    def set(self, key, value):
        self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        return self.data[key]

    def check(self, keys):
        return all(k in self.data for k in keys)


def _state(store, rank, **changes):
    state = {"time": time.time(), "idle_s": 0.0, "op": None, "paused": False, "host": "elsewhere", "pid": 1}
    state.update(changes)
    store.set(f"{heartbeat.KEY}{rank}", json.dumps(state))


@pytest.fixture
def beat():
    return heartbeat.Heartbeat(FakeStore(), rank=0, world_size=2, stall_s=3.0)


def test_a_peer_is_named_for_a_stopped_heartbeat_a_gone_process_or_no_progress_outside_collectives(beat):
    store = beat.store
    assert "never started" in beat.why_stalled(1, beat.peer(1))
    _state(store, 1, time=time.time() - 10)
    assert "heartbeat stopped 10 s ago" in beat.why_stalled(1, beat.peer(1))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # reaped: its pid is gone
    _state(store, 1, host=beat.host, pid=dead.pid)
    assert f"its process (pid {dead.pid}) is gone" in beat.why_stalled(1, beat.peer(1))
    _state(store, 1, host=beat.host, pid=os.getpid(), idle_s=5.0)
    assert "waits in no collective and made no progress for 5 s" in beat.why_stalled(1, beat.peer(1))
    assert beat.gone(1) is None  # alive, only slow: the checkpoint writer keeps waiting


@pytest.mark.parametrize("changes", [{"idle_s": 1.0}, {"idle_s": 9.0, "op": "all_reduce"},
                                     {"idle_s": 9.0, "paused": True}])
def test_a_live_peer_that_progresses_waits_in_a_collective_or_is_paused_is_not_named(beat, changes):
    _state(beat.store, 1, **changes)
    assert beat.why_stalled(1, beat.peer(1)) is None


def test_the_published_state_has_the_collective_waited_in_and_the_pause(beat, monkeypatch):
    dog = watchdog.CollectiveWatchdog(600, rank=0)
    monkeypatch.setattr(watchdog, "_WATCHDOG", dog)
    with dog.watch("all_reduce of 4 B on a group of 2 ranks"), heartbeat.paused():
        beat._beat()
        state = beat.peer(0)
    assert state["op"] == "all_reduce of 4 B on a group of 2 ranks" and state["paused"]
    beat._beat()
    state = beat.peer(0)
    assert state["op"] is None and not state["paused"] and state["idle_s"] < 1.0
    dog.close()


def test_a_stall_seconds_must_be_positive():
    with pytest.raises(ValueError, match="comm.stall_seconds must be positive"):
        heartbeat.set_stall_seconds(0)
