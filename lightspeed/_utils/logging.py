"""Rank-aware logging for library code. Library code logs through here and never prints.

By default only rank 0 emits records (the rank is read from the environment or torch.distributed);
`log_all_ranks()` lifts that for debugging. `warn_once` deduplicates by message.
"""

from __future__ import annotations

import logging
import os
import sys

_LOGGER_NAME = "lightspeed"
_warned: set[str] = set()


def current_rank() -> int:
    """This process's global rank: torch.distributed's when a group is up, else the launcher's environment, else 0."""
    # torch.distributed is only looked up, never imported here: comm/ is its one importer, and if it
    # was never imported no process group can be initialized.
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    for key in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
        if key in os.environ:
            try:
                return int(os.environ[key])
            except ValueError:
                continue
    return 0


class _RankFilter(logging.Filter):
    all_ranks = False

    def filter(self, record: logging.LogRecord) -> bool:
        rank = current_rank()
        record.rank = rank
        # a record logged with extra={"all_ranks": True} chose its ranks itself (DeepSpeed's log_dist)
        return self.all_ranks or getattr(record, "all_ranks", False) or rank == 0


_filter = _RankFilter()


def get_logger(name: str | None = None) -> logging.Logger:
    """Return the `lightspeed` logger (or a child of it); the handler is installed once."""
    root = logging.getLogger(_LOGGER_NAME)
    if not getattr(root, "_lightspeed_configured", False):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[lightspeed] [%(levelname)s] [rank %(rank)s] %(message)s"))
        handler.addFilter(_filter)
        root.addHandler(handler)
        root.setLevel(os.environ.get("LIGHTSPEED_LOG_LEVEL", "INFO").upper())
        root.propagate = False
        root._lightspeed_configured = True  # type: ignore[attr-defined]
    if name is None or name == _LOGGER_NAME:
        return root
    if name.startswith(_LOGGER_NAME + "."):
        return logging.getLogger(name)
    return root.getChild(name)


def set_log_level(level: str) -> None:
    """The `lightspeed` logger's level and its handlers' (the config's `log_level`, as DeepSpeed's
    `set_log_level_from_string`: "debug", "info", "warning", "error" or "critical")."""
    root = get_logger()
    root.setLevel(level.upper())
    for handler in root.handlers:
        handler.setLevel(level.upper())


def log_all_ranks(enabled: bool = True) -> None:
    """Let records from every rank through (default: rank 0 only)."""
    _RankFilter.all_ranks = enabled


def warn_once(message: str, logger: logging.Logger | None = None) -> None:
    """Log `message` as a warning the first time it is seen in this process."""
    if message in _warned:
        return
    _warned.add(message)
    (logger or get_logger()).warning(message)
