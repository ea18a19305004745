"""Checksums for checkpoint files: what each rank records after writing, and the checks on load.

Owns the per-rank checksum manifest (`checksums_rank<R>.json` in a tag directory) and verifying files
against it. It must not decide which files a checkpoint has (engine_checkpoint does) nor move
directories (tag_dir does), and it never unpickles objects: naming a tensor reads the pickle with
stubs that build nothing.

Note (what the checksums cover, and why they cost nothing at save time):
    A file written by ``torch.save`` is a zip archive of *stored* (uncompressed) records: ``data.pkl``
    (the pickled structure: dict keys, counters, shapes), one ``data/<k>`` record per tensor storage,
    and a few small ones. torch computes each record's CRC-32 while it writes and keeps it in the
    zip's central directory, so after the write a rank reads only that directory (a few KB at the end
    of the file) and records, per file: its size, each record's CRC-32, and a CRC-32 of the central
    directory itself. On load every record is re-read and its CRC-32 recomputed (torch's reader does
    not check them), so any change to tensor bytes, to the pickle, or to the index is detected; a
    flipped bit inside a ``data/<k>`` record is reported with the names of the tensors stored in it.
    Measured on 2 busy CPU cores, 2026-12-01: xxh3_64, the fastest hash tried (14 GB/s; zlib.crc32
    1.7, blake2b 0.6), over every tensor would add about 7% to a save that torch writes at 1.1 GB/s;
    reading the directories back took 0.05% of a 0.6 GB save (`benchmarks/checkpoint_save.py`).
    When torch was told not to compute CRCs (`torch.serialization.set_crc32_options`), the records
    are read back and hashed here instead, at about that 7%. CRC-32 catches every burst of up to 32 bits
    and misses longer random damage with probability 2**-32: right for storage faults, not meant to
    stop a forger (nothing in a checkpoint is executed: loads are weights_only).

    A rank's manifest lists the files that rank wrote and, through `num_ranks`, how many manifests
    the tag has, so a rank verifies the files it reads from its own manifest and rank 0's (for the
    shared files) without reading the other ranks' files. The manifest carries a CRC-32 of its own
    body, the tag it was written for, and the id of the save (the same on every rank of one save).

Note (files without a manifest, and turning checks off):
    DeepSpeed's checkpoints have no manifest, but torch wrote them too: `verify_zip` re-reads every
    record and compares it with the CRC-32 torch stored in the zip's central directory, so a flipped
    byte is refused naming the file, the record and its tensors. (What that cannot see: a file
    replaced whole, or an index rewritten to match; the manifests' index CRC and sizes catch those for
    lightspeed's own files.) The cost is one more read of every byte of a file, streamed through an
    8 MiB buffer per thread (threads for files of 8 MiB and more; pread and zlib.crc32 release the GIL),
    before its first use. benchmarks/checkpoint_read_verify.py, a 3.55 GB stage-2 checkpoint of 2
    ranks, files in the page cache, 2 CPU cores shared with other work (load average 5-6), 2026-12-04:
    the check alone ran at 3.7-4.0 GB/s; reading every master and optimizer state (what a load into
    an engine reads) took 2.96 s unverified and 3.48 s verified (+18%); converting to safetensors, which
    reads only the masters yet checks every byte, 3.20 -> 3.57 s in one run and 2.45 -> 3.59 s in
    another. Opening the reader, which was lazy, now checks the model file and rank 0's optimizer
    file (about 1 s there). From a cold disk the check's read is the disk's speed, and it fills the page
    cache the load then reads from. `verification(False)`, which a caller's `verify=False` or the command
    line's `--no-verify` sets, turns every check off for the reads under it.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import struct
import zipfile
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch

from lightspeed.checkpoint.atomic import atomic_write_bytes
from lightspeed.checkpoint.errors import CheckpointError

__all__ = ["MANIFEST_FORMAT", "manifest_name", "file_entry", "write_manifest", "read_manifest", "Manifest",
           "verify_file", "verify_zip", "tensors_in_record", "verification", "verification_enabled",
           "UNVERIFIED_HINT"]

MANIFEST_FORMAT = "lightspeed-checksums"
MANIFEST_VERSION = 1
_MANIFEST_RE = re.compile(r"^checksums_rank(\d+)\.json$")
_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")  # zip local file header, 30 bytes
_LOCAL_MAGIC = 0x04034B50
_PARALLEL_MIN_BYTES = 8 << 20  # files smaller than this are checked on one thread
_CHUNK_BYTES = 8 << 20  # records are read and checked this much at a time


# Whether checkpoint reads verify their files. On unless a caller said `verify=False` (or `--no-verify`):
# a context variable, so the choice reaches every reader below the call (the tensor-parallel merge,
# the DeepSpeed reader) without each layer passing it on.
_VERIFY: ContextVar[bool] = ContextVar("lightspeed_checkpoint_verify", default=True)
UNVERIFIED_HINT = "pass verify=False (on the command line --no-verify) to read it unverified"


@contextmanager
def verification(enabled: bool) -> Iterator[None]:
    """Within the block, checkpoint reads verify their files (`enabled`) or skip every check."""
    token = _VERIFY.set(bool(enabled))
    try:
        yield
    finally:
        _VERIFY.reset(token)


def verification_enabled() -> bool:
    return _VERIFY.get()


def manifest_name(rank: int) -> str:
    return f"checksums_rank{rank}.json"


def manifest_rank(filename: str) -> int | None:
    found = _MANIFEST_RE.match(filename)
    return int(found.group(1)) if found else None


def _hex(crc: int) -> str:
    return f"{crc & 0xFFFFFFFF:08x}"


def _torch_computes_crc() -> bool:
    get = getattr(torch.serialization, "get_crc32_options", None)
    return True if get is None else bool(get())


def _central_directory_crc(f, size: int) -> int:
    """CRC-32 of everything from the central directory's start to the end of the file."""
    with zipfile.ZipFile(f) as z:
        start = getattr(z, "start_dir", None)  # where zipfile found the directory (zip64 included)
    if not isinstance(start, int):
        start = _central_directory_start(f, size)
    if not 0 <= start <= size:
        raise zipfile.BadZipFile(f"central directory offset {start} outside the file")
    f.seek(start)
    return zlib.crc32(f.read(size - start))


def _central_directory_start(f, size: int) -> int:
    # The end-of-central-directory record (and the zip64 one, which torch writes for large files)
    # says where the directory starts; read it ourselves where zipfile does not say.
    tail = min(size, 1 << 16)
    f.seek(size - tail)
    data = f.read(tail)
    at = data.rfind(b"PK\x05\x06")
    if at < 0:
        raise zipfile.BadZipFile("no end of central directory record")
    (offset,) = struct.unpack_from("<I", data, at + 16)
    if offset == 0xFFFFFFFF:
        loc = data.rfind(b"PK\x06\x07", 0, at)
        if loc < 0:
            raise zipfile.BadZipFile("no zip64 end of central directory locator")
        (z64_at,) = struct.unpack_from("<Q", data, loc + 8)
        f.seek(z64_at)
        z64 = f.read(56)
        if z64[:4] != b"PK\x06\x06":
            raise zipfile.BadZipFile("bad zip64 end of central directory record")
        (offset,) = struct.unpack_from("<Q", z64, 48)
    return offset


def file_entry(path: str | os.PathLike) -> dict[str, Any]:
    """The checksum entry of a freshly written file: ``{"bytes", "records": {name: crc}, "index_crc32"}``
    for a torch zip file, ``{"bytes", "crc32"}`` for any other file (read whole: keep those small)."""
    path = os.fspath(path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        if not zipfile.is_zipfile(f):
            f.seek(0)
            return {"bytes": size, "crc32": _hex(zlib.crc32(f.read()))}
        f.seek(0)
        with zipfile.ZipFile(f) as z:
            infos = z.infolist()
        if _torch_computes_crc():
            records = {i.filename: _hex(i.CRC) for i in infos}
        else:
            records = _hash_records(path, infos, size)
        index = _central_directory_crc(f, size)
    return {"bytes": size, "records": records, "index_crc32": _hex(index)}


def _hash_records(path: str, infos: list[zipfile.ZipInfo], size: int) -> dict[str, str]:
    with open(path, "rb") as f:
        fd = f.fileno()
        return {i.filename: _hex(_crc_range(fd, *_record_span(fd, i, size, path))) for i in infos}


def _record_span(fd: int, info: zipfile.ZipInfo, size: int, shown: str) -> tuple[int, int]:
    """(offset, length) of the data of record `info`, after checking its local header agrees with the index."""
    at = info.header_offset
    if at + _LOCAL_HEADER.size > size:
        raise CheckpointError(f"{shown}: record {info.filename} lies past the end of the file (truncated or corrupt)")
    fields = _LOCAL_HEADER.unpack(os.pread(fd, _LOCAL_HEADER.size, at))
    magic, name_len, extra_len = fields[0], fields[9], fields[10]
    start = at + _LOCAL_HEADER.size
    if magic != _LOCAL_MAGIC or os.pread(fd, name_len, start).decode("utf-8", "replace") != info.filename:
        raise CheckpointError(f"{shown}: the zip index does not match record {info.filename} (corrupt)")
    if info.compress_type != zipfile.ZIP_STORED:
        raise CheckpointError(f"{shown}: record {info.filename} is compressed; torch.save never writes that")
    begin = start + name_len + extra_len
    if begin + info.file_size > size:
        raise CheckpointError(f"{shown}: record {info.filename} runs past the end of the file (truncated)")
    return begin, info.file_size


def _crc_range(fd: int, offset: int, length: int) -> int:
    # Streamed through one reused buffer: memory stays at one chunk however large the record, and
    # nothing is left mapped (a mapped file's touched pages would count as the process's memory).
    buf = bytearray(min(length, _CHUNK_BYTES))
    view = memoryview(buf)
    crc = 0
    while length > 0:
        got = os.preadv(fd, [view[:min(length, len(buf))]], offset)
        if got <= 0:
            raise OSError(f"unexpected end of file at byte {offset}")
        crc = zlib.crc32(view[:got], crc)
        offset += got
        length -= got
    return crc


# ---------------------------------------------------------------------------------------------- manifests


@dataclass(frozen=True)
class Manifest:
    """One rank's checksum manifest: the files it wrote and their entries."""

    path: str
    tag: str
    rank: int
    num_ranks: int
    files: dict[str, dict[str, Any]]
    save_id: str | None = None  # the same in every manifest one save wrote (None: written before ids)


def _body_crc(body: dict[str, Any]) -> str:
    return _hex(zlib.crc32(json.dumps(body, sort_keys=True, separators=(",", ":")).encode("utf-8")))


def write_manifest(directory: str | os.PathLike, *, tag: str, rank: int, num_ranks: int,
                   files: dict[str, dict[str, Any]], save_id: str | None = None) -> str:
    """Write `directory/checksums_rank<rank>.json` atomically; returns its path. `save_id`: one value
    shared by every rank of one save, so a rank's files copied in from another save of the same tag
    are told apart."""
    body = {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "tag": tag, "rank": rank,
            "num_ranks": num_ranks, "algorithm": "crc32", "files": files}
    if save_id is not None:
        body["save_id"] = save_id
    body["body_crc32"] = _body_crc(body)
    path = os.path.join(os.fspath(directory), manifest_name(rank))
    atomic_write_bytes(path, json.dumps(body, indent=1, sort_keys=True).encode("utf-8"))
    return path


def read_manifest(path: str | os.PathLike, *, tag: str | None = None, rank: int | None = None) -> Manifest:
    """Read and check one manifest (format, its own CRC, and the tag / rank it must be for)."""
    shown = os.fspath(path)
    try:
        with open(shown, "rb") as f:
            body = json.loads(f.read().decode("utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{shown}: checksum manifest not found") from None
    except OSError as err:
        raise CheckpointError(f"{shown}: cannot be read ({err.strerror or err})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{shown}: checksum manifest is corrupt ({type(err).__name__})") from None
    if not isinstance(body, dict) or body.get("format") != MANIFEST_FORMAT:
        raise CheckpointError(f"{shown}: not a lightspeed checksum manifest")
    if body.get("version") != MANIFEST_VERSION or body.get("algorithm") != "crc32":
        raise CheckpointError(f"{shown}: checksum manifest version {body.get('version')!r} / algorithm "
                              f"{body.get('algorithm')!r} is not one this lightspeed reads")
    claimed = body.pop("body_crc32", None)
    if claimed != _body_crc(body):
        raise CheckpointError(f"{shown}: checksum manifest is corrupt (its own checksum does not match)")
    try:
        save_id = body.get("save_id")
        manifest = Manifest(shown, str(body["tag"]), int(body["rank"]), int(body["num_ranks"]), dict(body["files"]),
                            None if save_id is None else str(save_id))
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(f"{shown}: checksum manifest is missing fields") from None
    if tag is not None and manifest.tag != tag:
        raise CheckpointError(f"{shown}: checksum manifest is for tag {manifest.tag!r}, not {tag!r} "
                              "(a file copied from another checkpoint?)")
    if rank is not None and manifest.rank != rank:
        raise CheckpointError(f"{shown}: checksum manifest is for rank {manifest.rank}, not {rank}")
    return manifest


# ---------------------------------------------------------------------------------------------- verify


def verify_file(path: str | os.PathLike, entry: dict[str, Any], *, threads: int | None = None) -> None:
    """Raise a one-line `CheckpointError` naming the file (and the tensor, where the damage is in
    tensor data) unless `path` matches its manifest `entry`."""
    shown = os.fspath(path)
    try:
        size = os.path.getsize(shown)
    except FileNotFoundError:
        raise CheckpointError(f"{shown}: missing (the checksum manifest lists it)") from None
    except OSError as err:
        raise CheckpointError(f"{shown}: cannot be read ({err.strerror or err})") from None
    expected = entry.get("bytes")
    if size != expected:
        raise CheckpointError(f"{shown}: is {size} bytes, the checksum manifest says {expected} "
                              f"({'truncated' if isinstance(expected, int) and size < expected else 'changed'})")
    if "crc32" in entry:
        with open(shown, "rb") as f:
            if _hex(zlib.crc32(f.read())) != entry["crc32"]:
                raise CheckpointError(f"{shown}: fails its checksum (the file is corrupt)")
        return
    records: dict[str, str] = entry["records"]
    with open(shown, "rb") as f:
        try:
            index = _central_directory_crc(f, size)
            f.seek(0)
            with zipfile.ZipFile(f) as z:
                infos = {i.filename: i for i in z.infolist()}
        except (zipfile.BadZipFile, struct.error, OSError, ValueError) as err:
            raise CheckpointError(f"{shown}: its zip index is corrupt ({err})") from None
        if _hex(index) != entry["index_crc32"]:
            raise CheckpointError(f"{shown}: its zip index fails its checksum (the file is corrupt)")
        if set(infos) != set(records):
            raise CheckpointError(f"{shown}: holds records {sorted(set(infos) ^ set(records))[:3]} the checksum "
                                  "manifest does not agree on (corrupt or replaced)")
        bad = _bad_records(f.fileno(), infos, records, size, shown, threads)
    if bad:
        raise CheckpointError(f"{shown}: {_describe(shown, bad)} fails its checksum (the file is corrupt)")


def verify_zip(path: str | os.PathLike, *, threads: int | None = None) -> bool:
    """Check a torch zip file that has no checksum manifest (DeepSpeed's files, a model's ``.bin``)
    against the CRC-32 its writer stored for every record, reading each record once. Raises a one-line
    `CheckpointError` naming the file and the record (and its tensors) that fail. Returns False, and
    checks nothing, for a file that holds no CRCs to check: torch's legacy (non-zip) format, or a zip
    whose writer was told not to compute them (every record's CRC is 0)."""
    shown = os.fspath(path)
    try:
        size = os.path.getsize(shown)
        with open(shown, "rb") as f:
            if not zipfile.is_zipfile(f):
                f.seek(0)
                if f.read(4) == b"PK\x03\x04":  # a zip whose end was cut off
                    raise CheckpointError(f"{shown}: is truncated or corrupt (no zip index at its end)")
                return False
            f.seek(0)
            try:
                with zipfile.ZipFile(f) as z:
                    infos = {i.filename: i for i in z.infolist()}
            except (zipfile.BadZipFile, struct.error, ValueError) as err:
                raise CheckpointError(f"{shown}: its zip index is corrupt ({err})") from None
            records = {name: _hex(i.CRC) for name, i in infos.items()}
            if all(i.CRC == 0 for i in infos.values() if i.file_size):  # written without CRCs
                return False
            bad = _bad_records(f.fileno(), infos, records, size, shown, threads)
    except FileNotFoundError:
        raise CheckpointError(f"{shown}: checkpoint file not found") from None
    except OSError as err:
        raise CheckpointError(f"{shown}: cannot be read ({err.strerror or err})") from None
    if bad:
        raise CheckpointError(f"{shown}: {_describe(shown, bad)} fails the CRC-32 stored in the file (the file "
                              "is corrupt)")
    return True


def _bad_records(fd: int, infos, records, size, shown, threads) -> list[str]:
    def check(name: str) -> str | None:
        crc = _crc_range(fd, *_record_span(fd, infos[name], size, shown))
        return None if _hex(crc) == records[name] else name

    names = sorted(infos)
    if threads is None:
        threads = min(8, os.cpu_count() or 1) if size >= _PARALLEL_MIN_BYTES else 1
    if threads <= 1:
        return [n for n in map(check, names) if n is not None]
    with ThreadPoolExecutor(threads) as pool:  # pread and zlib.crc32 release the GIL on large buffers
        return [n for n in pool.map(check, names) if n is not None]


def _describe(shown: str, bad: list[str]) -> str:
    parts = []
    for record in bad[:3]:
        short = record.split("/", 1)[1] if "/" in record else record
        if short == "data.pkl":
            parts.append("the pickled structure (record data.pkl)")
            continue
        if short.startswith("data/"):
            try:
                names = tensors_in_record(shown, record)
            except Exception:  # the pickle may be damaged too: the record name still locates it
                names = []
            if names:
                shown_names = ", ".join(repr(n) for n in names[:3]) + (" ..." if len(names) > 3 else "")
                parts.append(f"tensor {shown_names} (record {short})")
                continue
        parts.append(f"record {short}")
    more = f" and {len(bad) - 3} more records" if len(bad) > 3 else ""
    return " and ".join(parts) + more


# ------------------------------------------------------------------------------------------ naming tensors


class _StorageRef:
    def __init__(self, key: str):
        self.key = key


class _Stub:
    """Stands for any global a pickle names; building one runs no code of that global."""

    qualname = ""

    def __new__(cls, *args, **kwargs):  # REDUCE calls the class, NEWOBJ only its __new__: set up here
        self = object.__new__(cls)
        self.args = args + tuple(kwargs.values())
        self.items = {}
        self.state = None
        return self

    def __setstate__(self, state):
        self.state = state

    def __setitem__(self, key, value):
        self.items[key] = value

    def append(self, value):
        self.items[len(self.items)] = value

    def extend(self, values):
        for v in values:
            self.append(v)


class _NamingUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        return type(name, (_Stub,), {"qualname": f"{module}.{name}"})

    def persistent_load(self, pid):
        if isinstance(pid, tuple) and len(pid) >= 3 and pid[0] == "storage":
            return _StorageRef(str(pid[2]))
        return None


def _walk(obj: Any, path: str, out: list[tuple[str, str]], depth: int = 0) -> None:
    if depth > 200:
        return
    if isinstance(obj, _StorageRef):
        out.append((obj.key, path))
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _walk(v, f"{path}.{k}" if path else str(k), out, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _walk(v, f"{path}.{i}" if path else str(i), out, depth + 1)
    elif isinstance(obj, _Stub):
        # a rebuilt object (a tensor from its storage, an OrderedDict from its items) keeps the name
        # of the place it is stored under
        for v in obj.args:
            _walk(v, path, out, depth + 1)
        _walk(obj.items, path, out, depth + 1)
        if obj.state is not None:
            _walk(obj.state, path, out, depth + 1)


def _storage_names(pickled: bytes) -> Iterator[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    _walk(_NamingUnpickler(io.BytesIO(pickled)).load(), "", out)
    return iter(out)


def tensors_in_record(path: str | os.PathLike, record: str) -> list[str]:
    """The names (dotted key paths, e.g. ``module.fc1.weight``) of the tensors whose storage is the
    zip record `record` of the torch file at `path`."""
    key = record.rsplit("/", 1)[1]
    with zipfile.ZipFile(os.fspath(path)) as z:
        pkl = next(n for n in z.namelist() if n.endswith("/data.pkl") or n == "data.pkl")
        pickled = z.read(pkl)
    seen: list[str] = []
    for storage_key, name in _storage_names(pickled):
        if storage_key == key and name not in seen:
            seen.append(name)
    return seen
