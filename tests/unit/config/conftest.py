"""Fixtures for the config tests: a hermetic environment and a caplog that sees lightspeed's logger
(it does not propagate to the root logger)."""

import logging

import pytest


@pytest.fixture(autouse=True)
def _no_world_size_env(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)


@pytest.fixture
def ls_caplog(caplog):
    logger = logging.getLogger("lightspeed")
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.WARNING, logger="lightspeed")
    try:
        yield caplog
    finally:
        logger.removeHandler(caplog.handler)
