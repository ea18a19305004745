"""Crash-safe checkpoint files: atomic writes, safe loads, and DeepSpeed's ``latest`` tag file.

Owns how bytes reach the disk and how they are read back. It must not decide what goes into a
checkpoint or where (the manifest and engine save/load do), and it never unpickles arbitrary code.

Note: [the atomic write protocol]
    A file is written to a temp file in the *same directory* (so the rename cannot cross
    filesystems), flushed and fsynced, then ``os.replace``d over the target, and the directory is
    fsynced so the rename itself survives a power cut. A reader therefore sees the old complete
    file or the new complete one, never a prefix. ``latest`` (DeepSpeed's tag file, holding the tag
    with no newline) is written the same way and *last*, after every file of the tag is in place,
    so a crash mid-save leaves ``latest`` pointing at the previous complete checkpoint. A crash can
    leave a stray ``.<name>.tmp.*`` file next to the target; it is never read, and
    ``remove_stale_temps`` clears them.
"""

from __future__ import annotations

import os
import pickle
import re
import secrets
import zipfile
from collections.abc import Callable
from typing import IO, Any

import torch

from lightspeed.checkpoint.errors import CheckpointError

__all__ = [
    "LATEST_FILENAME",
    "atomic_write_bytes",
    "atomic_write_via",
    "atomic_torch_save",
    "safe_torch_load",
    "write_latest",
    "read_latest",
    "validate_tag",
    "remove_stale_temps",
]

LATEST_FILENAME = "latest"
_TEMP_MARK = ".tmp."

# Test-only fault injection: called as hook(point, path) at "begin", "temp_written" and "replaced".
# A crash test sets it in a child process to os._exit at a chosen point.
_fault_hook: Callable[[str, str], None] | None = None


def _fault_point(point: str, path: str) -> None:
    if _fault_hook is not None:
        _fault_hook(point, path)


def fsync_dir(directory: str | os.PathLike) -> None:
    """Make a rename or file creation inside `directory` durable (best effort where unsupported)."""
    try:
        fd = os.open(os.fspath(directory), os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory handles
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - filesystems that refuse fsync on directories
        pass
    finally:
        os.close(fd)


def _temp_name(path: str) -> str:
    directory, name = os.path.split(path)
    return os.path.join(directory, f".{name}{_TEMP_MARK}{os.getpid()}.{secrets.token_hex(4)}")


def _atomic_write(path: str | os.PathLike, write: Callable[[IO[bytes]], Any]) -> None:
    path = os.path.abspath(os.fspath(path))
    _fault_point("begin", path)
    tmp = _temp_name(path)
    # os.open with 0o666 lets the umask decide the final mode, as a plain open() would.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        _commit(tmp, path)
    except BaseException:
        _discard(tmp)
        raise
    _fault_point("replaced", path)
    fsync_dir(os.path.dirname(path))


def _commit(tmp: str, path: str) -> None:
    _fault_point("temp_written", path)
    os.replace(tmp, path)


def _discard(tmp: str) -> None:
    try:
        os.unlink(tmp)
    except OSError:
        pass


def atomic_write_via(path: str | os.PathLike, write_to: Callable[[str], Any]) -> None:
    """`write_to(temp_path)` writes the file (for writers that take a file name, e.g. safetensors'
    `save_file`), then it is fsynced and renamed over ``path``, as ``atomic_write_bytes`` does."""
    path = os.path.abspath(os.fspath(path))
    _fault_point("begin", path)
    tmp = _temp_name(path)
    try:
        write_to(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        _commit(tmp, path)
    except BaseException:
        _discard(tmp)
        raise
    _fault_point("replaced", path)
    fsync_dir(os.path.dirname(path))


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or all of the new one."""
    _atomic_write(path, lambda f: f.write(data))


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save(obj, path)``, atomically (see the Note in this module). torch writes the temp file
    by name: its C++ writer is about 3x faster than writing through a Python file object while it
    computes the zip records' CRC-32s (1.1 against 0.38 GB/s, 2 CPU cores, 2026-12-01)."""
    atomic_write_via(path, lambda tmp: torch.save(obj, tmp))


def _weights_only_reason(err: Exception) -> str:
    found = re.search(r"Unsupported global: GLOBAL (\S+)", str(err))
    if found:
        return f"it needs the global {found.group(1)}, which weights_only loading does not allow"
    line = next((ln.strip() for ln in str(err).splitlines() if "WeightsUnpickler error" in ln), "")
    return line[:200] or "it holds objects that weights_only loading does not allow"


def safe_torch_load(path: str | os.PathLike, map_location: Any = "cpu", mmap: bool = False) -> Any:
    """``torch.load(path, map_location, weights_only=True)``; every failure (missing, unreadable,
    truncated or corrupt file, a pickle that needs arbitrary globals) becomes a one-line
    ``CheckpointError`` naming the file. `mmap=True` maps the tensors' bytes instead of reading them
    (files in torch's zip format; a legacy-format file is read whole)."""
    shown = os.fspath(path)
    try:
        if mmap:
            try:
                return torch.load(shown, map_location=map_location, weights_only=True, mmap=True)
            except RuntimeError as err:
                if "mmap" not in str(err):
                    raise
        return torch.load(shown, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{shown}: checkpoint file not found") from None
    except IsADirectoryError:
        raise CheckpointError(f"{shown}: is a directory, not a checkpoint file") from None
    except pickle.UnpicklingError as err:
        if "Weights only load failed" in str(err):
            raise CheckpointError(f"{shown}: refused to load: {_weights_only_reason(err)}") from None
        raise CheckpointError(f"{shown}: is truncated or corrupt ({_first_line(err)})") from None
    except OSError as err:
        raise CheckpointError(f"{shown}: cannot be read ({err.strerror or _first_line(err)})") from None
    except (RuntimeError, EOFError, KeyError, ValueError, zipfile.BadZipFile, IndexError, TypeError) as err:
        raise CheckpointError(f"{shown}: is truncated or corrupt ({_first_line(err)})") from None


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:160]}" if text else type(err).__name__


def validate_tag(tag: str | int) -> str:
    """A checkpoint tag names one directory under the save dir: returns it as a string, or raises
    ``CheckpointError`` for an empty tag, ``.``/``..``, path separators, control characters or
    surrounding whitespace (``latest`` is read back stripped, as DeepSpeed does)."""
    if isinstance(tag, bool) or not isinstance(tag, (str, int)):
        raise CheckpointError(f"checkpoint tag must be a string (got {type(tag).__name__} {tag!r})")
    text = str(tag)
    seps = {"/", "\\", os.sep} | ({os.altsep} if os.altsep else set())
    if text in ("", ".", ".."):
        reason = "must not be empty, '.' or '..'"
    elif any(s in text for s in seps):
        reason = "must not contain a path separator"
    elif any(ord(c) < 32 or ord(c) == 127 for c in text):
        reason = "must not contain control characters"
    elif text != text.strip():
        reason = "must not start or end with whitespace"
    else:
        return text
    raise CheckpointError(f"checkpoint tag {text!r} {reason}")


def write_latest(save_dir: str | os.PathLike, tag: str | int) -> None:
    """Record ``tag`` in ``save_dir/latest`` (atomically). Call it last, once every file of the tag
    is written, and on one rank only."""
    atomic_write_bytes(os.path.join(os.fspath(save_dir), LATEST_FILENAME), validate_tag(tag).encode("utf-8"))


def read_latest(save_dir: str | os.PathLike) -> str | None:
    """The tag in ``save_dir/latest``, or None when there is no such file."""
    path = os.path.join(os.fspath(save_dir), LATEST_FILENAME)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return None
    except OSError as err:
        raise CheckpointError(f"{path}: cannot be read ({err.strerror or err})") from None
    try:
        tag = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise CheckpointError(f"{path}: is not a text file holding a checkpoint tag") from None
    try:
        return validate_tag(tag)
    except CheckpointError as err:
        raise CheckpointError(f"{path}: does not hold a valid tag ({err})") from None


def remove_stale_temps(directory: str | os.PathLike) -> list[str]:
    """Delete temp files that crashed atomic writes left in ``directory``; returns their paths.
    Only call it while no other process is writing into ``directory``."""
    directory = os.fspath(directory)
    removed = []
    for entry in os.scandir(directory):
        if entry.name.startswith(".") and _TEMP_MARK in entry.name and entry.is_file(follow_symlinks=False):
            try:
                os.unlink(entry.path)
                removed.append(entry.path)
            except FileNotFoundError:
                pass
    return removed
