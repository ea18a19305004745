"""The communication timeout's resolution and the collective watchdog's reports, in this process (the
error path) and in a subprocess (a wait that never ends: the watchdog thread ends the process)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from datetime import timedelta
from pathlib import Path

import pytest

from lightspeed.comm.init import DEFAULT_TIMEOUT, comm_timeout
from lightspeed.comm.watchdog import EXIT_COMM_TIMEOUT, CollectiveWatchdog

REPO = Path(__file__).resolve().parents[3]


def test_timeout_from_argument_environment_or_default():
    assert comm_timeout(None, {}) == DEFAULT_TIMEOUT == timedelta(minutes=10)
    assert comm_timeout(None, {"LIGHTSPEED_COMM_TIMEOUT": "7.5"}) == timedelta(seconds=7.5)
    assert comm_timeout(timedelta(seconds=3), {"LIGHTSPEED_COMM_TIMEOUT": "7"}) == timedelta(seconds=3)
    assert comm_timeout(12) == timedelta(seconds=12)


@pytest.mark.parametrize("value, env, message", [
    (None, {"LIGHTSPEED_COMM_TIMEOUT": "soon"}, "LIGHTSPEED_COMM_TIMEOUT must be a number of seconds (got 'soon')"),
    (None, {"LIGHTSPEED_COMM_TIMEOUT": "-1"}, "LIGHTSPEED_COMM_TIMEOUT must be a positive number of seconds"),
    (None, {"LIGHTSPEED_COMM_TIMEOUT": "nan"}, "LIGHTSPEED_COMM_TIMEOUT must be a positive number of seconds"),
    (timedelta(0), {}, "init_distributed(timeout=) must be positive"),
    ("600", {}, "init_distributed(timeout=) takes a datetime.timedelta or seconds (got str)"),
])
def test_bad_timeouts_are_refused(value, env, message):
    with pytest.raises((ValueError, TypeError)) as err:
        comm_timeout(value, env)
    assert message in str(err.value)


def test_a_failed_wait_is_reported_once_with_the_collective_and_written_to_the_error_file(
        tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("LIGHTSPEED_AGENT_PID", raising=False)
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    dog = CollectiveWatchdog(30, rank=3)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="Timed out waiting"):
            with dog.watch("all_reduce (sum) of 4 KiB on a group of 2 ranks"):
                raise RuntimeError("Timed out waiting 5000ms for recv operation to complete\nmore detail")
    dog.close()
    err = capsys.readouterr().err
    line = ("lightspeed: rank 3: all_reduce (sum) of 4 KiB on a group of 2 ranks failed after 0 s: RuntimeError: "
            "Timed out waiting 5000ms for recv operation to complete; a peer rank stopped, hung or died")
    assert err.count(line) == 1  # the second failure adds nothing
    assert "stacks of every thread" in err and "test_watchdog.py" in err  # no launcher: this rank's own stacks
    assert json.loads(error_file.read_text())["message"].startswith(line)
    assert dog.oldest() is None


def test_a_completed_wait_leaves_nothing_pending():
    dog = CollectiveWatchdog(30, rank=0)
    with dog.watch("barrier"):
        assert dog.oldest()[1] == "barrier"
    assert dog.oldest() is None
    dog.close()


@pytest.mark.parametrize("env, argument, expected", [({}, "", 5.0), ({"LIGHTSPEED_COMM_TIMEOUT": "9"}, "", 9.0),
                                                    ({}, "timeout=8", 8.0)])
def test_the_configs_timeout_applies_unless_the_argument_or_environment_set_one(env, argument, expected):
    code = textwrap.dedent(f"""
        import torch
        import torch.distributed as dist
        from lightspeed.comm import init, watchdog
        init.init_distributed(verbose=False, {argument})
        seconds = init.apply_config_timeout(5.0)  # what initialize() does with comm.timeout_seconds: 5
        gloo = dist.group.WORLD._get_backend(torch.device("cpu"))
        print(seconds, init.timeout_seconds(), watchdog.current().timeout_s, gloo.options._timeout.total_seconds())
        from lightspeed.checkpoint.writer import options_from_config
        print(options_from_config(None, init.timeout_seconds()).commit_timeout_s)
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", **env})
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, second = proc.stdout.split("\n")[:2]
    assert first.split() == [str(expected)] * 4 and second == str(expected)


def test_a_wait_that_never_ends_is_reported_and_ends_the_process():
    code = textwrap.dedent("""
        import threading
        from lightspeed.comm.watchdog import CollectiveWatchdog
        dog = CollectiveWatchdog(0.5, rank=1, poll_s=0.05)
        with dog.watch("all_gather of 1.0 MiB on a group of 4 ranks"):
            threading.Event().wait(60)  # a collective that neither completes nor raises
    """)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == EXIT_COMM_TIMEOUT, proc.stderr
    assert time.monotonic() - start < 30
    assert ("lightspeed: rank 1: all_gather of 1.0 MiB on a group of 4 ranks did not complete within the "
            "communication timeout of 0.5 s") in proc.stderr
    assert "line 6, in <module>" in proc.stderr  # the main thread's stack, in the wait
