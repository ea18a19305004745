"""Tag directories on disk: where a save is staged, how it is published, and which directory a load
reads. Rank 0 alone calls `prepare` and `publish`; any rank may call `resolve`.

Owns the directory names around `save_dir/<tag>/` and the order of the renames. It must not write
or read the files inside a tag (engine_checkpoint and integrity do).

Note (publishing a tag, crash-safe at every instant):
    Names in `save_dir` for a tag T:  `T/` the published checkpoint, always complete;  `.T.tmp/` the
    staging directory every rank writes into;  `.T.old/` the previous `T/`, moved aside while the
    new one takes its place. A directory becomes `T/` only by a rename of a complete staging
    directory (all ranks' files and checksum manifests present) or of `.T.old/`, so `T/` is complete
    whenever it exists. Publishing is:

        1. `T/` -> `.T.old/`          (only when T exists)
        2. `.T.tmp/` -> `T/`
        3. fsync(save_dir), then `latest` := T (atomically, when asked)
        4. remove `.T.old/`

    A kill between 1 and 2 leaves no `T/` but a complete `.T.old/`: `resolve` reads `.T.old/` then,
    so `latest` (naming T or an older tag) always leads to a complete checkpoint, old or new, and the
    next save's `prepare` renames `.T.old/` back first. After 2 the new `T/` is complete; if 4 was
    cut short, `prepare` finishes it (both `T/` and `.T.old/` exist: the old one is stale). A kill
    before 1 leaves only a stray `.T.tmp/`, which `prepare` clears. Loads never rename anything:
    other ranks may be reading the same directory.

    Test hook: `atomic._fault_hook(point, path)` is called at "publish_begin", "old_moved",
    "new_in_place", "latest_written" and "old_removed" (path: the tag directory), besides the
    points of every atomic file write.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from lightspeed.checkpoint.atomic import LATEST_FILENAME, _TEMP_MARK, _fault_point, fsync_dir, validate_tag, write_latest
from lightspeed.checkpoint.errors import CheckpointError

__all__ = ["staging_dir", "old_dir", "prepare", "publish", "resolve"]


def staging_dir(save_dir: str | os.PathLike, tag: str) -> Path:
    return Path(save_dir) / f".{tag}.tmp"


def old_dir(save_dir: str | os.PathLike, tag: str) -> Path:
    return Path(save_dir) / f".{tag}.old"


def _recover(save_dir: Path, tag: str) -> None:
    final, old = save_dir / tag, old_dir(save_dir, tag)
    if old.exists():
        if final.exists():
            shutil.rmtree(old)  # step 4 of an earlier publish was cut short
        else:
            os.replace(old, final)  # killed between steps 1 and 2: put the complete old one back
            fsync_dir(save_dir)


def prepare(save_dir: str | os.PathLike, tag: str) -> Path:
    """Rank 0, before any rank writes: finish any publish of `tag` that a crash interrupted, clear
    temp files of an interrupted `latest` write, and make a fresh, empty staging directory. Returns
    the staging directory."""
    tag = validate_tag(tag)
    save_dir = Path(save_dir)
    save_dir.mkdir(parents=True, exist_ok=True)
    _recover(save_dir, tag)
    for entry in os.scandir(save_dir):  # temp files of a `latest` write that a crash cut short
        if entry.name.startswith(f".{LATEST_FILENAME}{_TEMP_MARK}") and entry.is_file(follow_symlinks=False):
            os.unlink(entry.path)
    staging = staging_dir(save_dir, tag)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    fsync_dir(save_dir)
    return staging


def publish(save_dir: str | os.PathLike, tag: str, *, save_latest: bool) -> Path:
    """Rank 0, once the staging directory holds every rank's files: swap it in as `save_dir/<tag>`
    and then write `latest` (see the Note). Returns the tag directory."""
    save_dir = Path(save_dir)
    final, old, staging = save_dir / tag, old_dir(save_dir, tag), staging_dir(save_dir, tag)
    _fault_point("publish_begin", str(final))
    if final.exists():
        os.replace(final, old)
        _fault_point("old_moved", str(final))
    os.replace(staging, final)
    fsync_dir(save_dir)
    _fault_point("new_in_place", str(final))
    if save_latest:
        write_latest(save_dir, tag)
        _fault_point("latest_written", str(final))
    shutil.rmtree(old, ignore_errors=True)
    _fault_point("old_removed", str(final))
    return final


def resolve(load_dir: str | os.PathLike, tag: str) -> Path:
    """The directory holding the complete checkpoint `tag`: `load_dir/<tag>`, or `.<tag>.old` when a
    save was killed while swapping it (see the Note). Read-only."""
    load_dir = Path(load_dir)
    final = load_dir / validate_tag(tag)
    if final.is_dir():
        return final
    old = old_dir(load_dir, tag)
    if old.is_dir():
        return old
    raise CheckpointError(f"{final}: checkpoint directory not found")
