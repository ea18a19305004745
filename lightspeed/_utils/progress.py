"""Progress bars for long operations a person waits on (loading and quantizing a checkpoint,
materialising a `zero.Init` model, converting checkpoints): `progress()`, a tqdm bar with rate and ETA
that is drawn only where someone is watching; and `format_duration` for ETAs in log lines.

A bar is drawn when every one of these holds, else `progress` returns a disabled tqdm (same interface:
iterate, `update`, `set_postfix`, context manager; no output, next to no cost):

- stderr is a terminal (a log file or a CI log would fill with carriage-return frames);
- this process is global rank 0 (every rank loading the same checkpoint would draw the same bar);
- the `lightspeed` logger lets INFO through (LIGHTSPEED_LOG_LEVEL=WARNING asks for quiet).

LIGHTSPEED_PROGRESS=1 draws bars regardless (e.g. for every rank when debugging), =0 never.

Must not: print anything else, or be used for work that takes well under a second (a bar that
flashes by is noise).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Iterable, Optional

from tqdm.auto import tqdm

from lightspeed._utils.logging import current_rank, get_logger

__all__ = ["progress", "progress_enabled", "format_duration"]


def progress_enabled() -> bool:
    """Whether `progress` draws bars in this process (rules in the module docstring)."""
    forced = os.environ.get("LIGHTSPEED_PROGRESS", "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    stream = sys.stderr
    is_terminal = stream is not None and hasattr(stream, "isatty") and stream.isatty()
    return is_terminal and current_rank() == 0 and get_logger().isEnabledFor(logging.INFO)


def progress(iterable: Optional[Iterable] = None, *, total: Optional[float] = None, desc: str = "",
             unit: str = "it", unit_scale: bool = False, enabled: bool = True, **tqdm_kwargs) -> tqdm:
    """A tqdm bar over `iterable` (or updated by hand with `.update(n)` up to `total`), shown with rate
    and ETA when `progress_enabled()` and `enabled`. `unit="B", unit_scale=True` shows bytes as
    KB/MB/GB and their rate. The bar is removed when it ends (`leave=False`), so the log line the
    caller writes afterwards stays the record."""
    tqdm_kwargs.setdefault("leave", False)
    tqdm_kwargs.setdefault("dynamic_ncols", True)
    return tqdm(iterable, total=total, desc=desc, unit=unit, unit_scale=unit_scale,
                disable=not (enabled and progress_enabled()), **tqdm_kwargs)


def format_duration(seconds: float) -> str:
    """``"42s"``, ``"3m05s"``, ``"2h03m"``, ``"3d04h"``: short, for ETAs in log lines."""
    seconds = max(0, int(round(seconds)))
    minutes, secs = divmod(seconds, 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    if days:
        return f"{days}d{hours:02d}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"
