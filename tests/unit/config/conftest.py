"""Fixtures for the config tests: a hermetic environment."""

import pytest


@pytest.fixture(autouse=True)
def _no_world_size_env(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
