"""The monitor backend interface and the check that a backend's library is installed.

A backend turns `(name, value, step)` events into its own records (an event file, a CSV, a run).
It must not decide which rank writes (`MonitorMaster` does) nor import its library at module import:
the libraries are optional and imported only when a backend is built.
"""

from __future__ import annotations

import importlib.util
from abc import ABC, abstractmethod
from typing import Any, Iterable, Sequence

Event = Sequence[Any]
"""`(name, value, step)`: DeepSpeed's event tuple; `step` is the x-axis, samples for the engine's events."""


def require_package(module: str, config_key: str, pip_name: str | None = None) -> None:
    """Raise ImportError naming the config key and the package when `module` is not installed."""
    if importlib.util.find_spec(module) is None:
        pip_name = pip_name or module
        raise ImportError(f"{config_key}.enabled needs the `{pip_name}` package, which is not installed "
                          f"(pip install {pip_name})")


class Monitor(ABC):
    """One logging backend. `write_events` takes an iterable of `(name, value, step)`."""

    def __init__(self, monitor_config: Any):
        self.monitor_config = monitor_config
        self.enabled = bool(getattr(monitor_config, "enabled", False))

    @abstractmethod
    def write_events(self, event_list: Iterable[Event]) -> None:
        """Record each event."""

    def update_config(self, config_dict: dict) -> None:
        """Record the run's configuration (a flat or nested dict of JSON values)."""

    def close(self) -> None:
        """Flush and release what the backend holds (files, runs)."""
