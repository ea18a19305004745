"""`lightspeed._utils.progress`: when a bar is drawn (a terminal, rank 0, INFO visible, or forced),
and the duration format of the step log line's ETA."""

from __future__ import annotations

import io
import logging

import pytest

from lightspeed._utils.logging import get_logger
from lightspeed._utils.progress import format_duration, progress, progress_enabled


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def terminal(monkeypatch):
    """A terminal stream; each test installs it as sys.stderr itself (pytest's capture resets
    sys.stderr between a fixture's setup and the test)."""
    stream = _Terminal()
    for key in ("LIGHTSPEED_PROGRESS", "RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(key, raising=False)
    logger = get_logger()
    level = logger.level
    logger.setLevel(logging.INFO)
    yield stream
    logger.setLevel(level)


def test_a_bar_is_drawn_on_rank_0_at_a_terminal_with_rate_and_eta(terminal, monkeypatch):
    monkeypatch.setattr("sys.stderr", terminal)
    assert progress_enabled()
    for _ in progress(range(3), desc="loading", unit="layer", leave=True):
        pass
    out = terminal.getvalue()
    assert "loading: 100%" in out and "3/3" in out and "layer/s" in out


def test_no_bar_off_a_terminal_on_other_ranks_or_when_info_is_hidden(terminal, monkeypatch):
    monkeypatch.setattr("sys.stderr", io.StringIO())
    assert not progress_enabled()
    monkeypatch.setattr("sys.stderr", terminal)
    monkeypatch.setenv("RANK", "1")
    assert not progress_enabled()
    monkeypatch.delenv("RANK")
    get_logger().setLevel(logging.WARNING)
    assert not progress_enabled()
    with progress(total=10, desc="quiet") as bar:
        bar.update(10)
    assert terminal.getvalue() == ""


def test_the_environment_forces_bars_on_or_off(terminal, monkeypatch):
    monkeypatch.setattr("sys.stderr", terminal)
    monkeypatch.setenv("LIGHTSPEED_PROGRESS", "0")
    assert not progress_enabled()
    monkeypatch.setattr("sys.stderr", io.StringIO())
    monkeypatch.setenv("LIGHTSPEED_PROGRESS", "1")
    assert progress_enabled()


@pytest.mark.parametrize("seconds, text", [(0, "0s"), (42.4, "42s"), (185, "3m05s"), (7380, "2h03m"),
                                           (3 * 86400 + 4 * 3600 + 59, "3d04h")])
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text
