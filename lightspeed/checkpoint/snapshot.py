"""The host snapshot a background checkpoint save writes from: a pool of host memory allocated once
and reused by every save, and the copies of the state into it.

Owns `SnapshotPool` (the memory, where each storage goes in it, the copies) and `Snapshot` (one
save's host copy and the events its copies complete at). It must not write files or decide what is
saved (writer.py, engine_checkpoint.py), and it does not know when the state changes: its callers
wait on `Snapshot.synchronize` before they overwrite the state or the pool.

Note (the snapshot pool):
    - Memory: on CUDA, exact-size page-locked host memory (`_utils/pinned.py`): torch's pinned
      allocator rounds each allocation up to a power of two, and allocating one checkpoint's worth
      inside a save held training 12.6 s (1.3B parameters, 17.9 GB, one H200). On CPU, plain host
      memory. Either is faulted in when allocated, so a save only copies.
    - Lifetime: the pool is sized by the first save (or `reserve`, before any save) and kept; a save
      whose storages fit allocates nothing. One that does not fit adds one slab holding exactly what
      is missing (past `_MAX_SLABS` slabs the pool is replaced by one of the whole size), so a pool
      reserved before the optimizer created its state grows once, by that state, and a pool that
      holds CPU-only state is re-allocated page-locked when CUDA tensors come. `release` frees it.
    - Placement: first-fit decreasing over the slabs, every storage at a `_ALIGN`-byte boundary. It
      depends only on the multiset of storage sizes, so a save of the sizes a pool was sized for
      fits it whatever order the state lists them in.
    - Each storage is copied once (views of one storage stay views of one copy, so the files load as
      a synchronous save's), into its own slice of a slab: torch.save writes a tensor's whole
      storage, and a slice is a storage of its own.
    - Copies from CUDA run on a side stream per device, which first waits for the work queued on the
      current stream (it produced the state), non_blocking into page-locked memory; each source is
      recorded on the side stream, so a temporary of the state (a ZeRO-3 gather) may be freed when
      the save returns. An event marks their end: the writer's thread waits on it before writing,
      the engine's next step before it changes the state, the next save before the pool is
      overwritten. The step waits on the host, not with a stream wait: a strategy may change the
      state from its own streams or threads (offload), and by then the forward and backward have
      hidden most of the copies. On CPU the same calls copy inline and there is no event.
"""

from __future__ import annotations

import copy
import ctypes
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from lightspeed._utils.device import Stream
from lightspeed._utils.logging import get_logger
from lightspeed._utils.pinned import page_locked_empty
from lightspeed._utils.sizes import human_bytes

__all__ = ["Snapshot", "SnapshotPool"]

logger = get_logger(__name__)
_ALIGN = 256
_MAX_SLABS = 4
# Host-to-host copies below this many bytes are one memmove: torch's copy hands every call to its
# intra-op thread pool, which on a busy host cost 11-16 ms per copy whatever its size (64 KiB: 16 ms
# against 2 us for memmove; 256 MiB: 35 ms against 30; 2 busy CPU cores, torch 2.13, 2026-12-04), and
# a state holds hundreds of small storages (biases, per-parameter step counters).
_MEMMOVE_BYTES = 1 << 20


def _aligned(nbytes: int) -> int:
    return (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN


@dataclass
class Snapshot:
    """One save's host copy of the state (`files`: the state's structure, its tensors in the pool)
    and the events its copies complete at (none on CPU, where they are done on return)."""

    files: Any
    events: list = field(default_factory=list)

    def synchronize(self) -> float:
        """Block until the copies are complete; returns the seconds waited. Safe from any thread."""
        if not self.events:
            return 0.0
        start = time.perf_counter()
        for event in self.events:
            event.synchronize()
        return time.perf_counter() - start


class _StreamCopier:
    """Copies from one device into host memory, queued on a side stream of that device (a no-op
    stand-in on CPU: `_utils/device.py`)."""

    def __init__(self, device: torch.device):
        self._stream = Stream(device)

    def copy_all(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
        """dst <- src for each (dst, src); returns an event they complete at, or None when done."""
        self._stream.wait_current()
        with self._stream.context():
            for dst, src in pairs:
                if src.device.type == "cpu" and src.numel() < _MEMMOVE_BYTES:
                    ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.numel())
                else:
                    dst.copy_(src, non_blocking=src.is_cuda)
        for _, src in pairs:
            self._stream.record(src)
        return self._stream.record_event()


def _storages(obj: Any) -> dict[tuple, torch.UntypedStorage]:
    """The distinct storages of the tensors in `obj` (dicts, lists, tuples), in walk order."""
    found: dict[tuple, torch.UntypedStorage] = {}

    def walk(o: Any) -> None:
        if torch.is_tensor(o):
            s = o.untyped_storage()
            found.setdefault(_key(s), s)
        elif isinstance(o, dict):
            for v in o.values():
                walk(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v)

    walk(obj)
    return found


def _key(storage: torch.UntypedStorage) -> tuple:
    return (str(storage.device), storage.data_ptr(), storage.nbytes())


def _place(sizes: list[int], capacities: list[int]) -> tuple[list[tuple[int, int]], int]:
    """(slab, byte offset) of each size, first-fit decreasing into slabs of `capacities`, and the
    bytes of one more slab (index len(capacities)) for those that fit in none (0: all fit)."""
    used = [0] * len(capacities)
    places: list[tuple[int, int]] = [(0, 0)] * len(sizes)
    extra = 0
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        nbytes = _aligned(sizes[i])
        for slab, capacity in enumerate(capacities):
            if used[slab] + nbytes <= capacity:
                places[i] = (slab, used[slab])
                used[slab] += nbytes
                break
        else:
            places[i] = (len(capacities), extra)
            extra += nbytes
    return places, extra


class SnapshotPool:
    """Host memory for one checkpoint's snapshot, kept across saves (the module's Note). Not
    thread-safe: `take`, `reserve` and `release` run on the training thread, and only while no
    snapshot taken from the pool is still being written."""

    def __init__(self, copier: Callable[[torch.device], Any] = _StreamCopier):
        self._copier_for = copier  # device -> object with copy_all(pairs) -> event or None
        self._copiers: dict[torch.device, Any] = {}
        self._slabs: list[torch.UntypedStorage] = []
        self._pinned = False
        self.num_allocations = 0  # slabs allocated so far (what "allocated once" is checked by)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes() for s in self._slabs)

    def reserve(self, obj: Any) -> None:
        """Make the pool hold the storages of `obj` (a state to be saved later), copying nothing."""
        storages = list(_storages(obj).values())
        self._fit(storages)

    def take(self, obj: Any) -> Snapshot:
        """A copy of `obj` whose tensors live in the pool (the previous snapshot's memory reused)."""
        found = _storages(obj)
        storages = list(found.values())
        slices = self._fit(storages)
        by_device: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        copies: dict[tuple, torch.UntypedStorage] = {}
        for key, src, dst in zip(found, storages, slices):
            copies[key] = dst
            if src.nbytes():
                pair = (_bytes(dst, torch.device("cpu")), _bytes(src, src.device))
                by_device.setdefault(src.device, []).append(pair)
        events = []
        for device, pairs in by_device.items():
            copier = self._copiers.get(device)
            if copier is None:
                copier = self._copiers[device] = self._copier_for(device)
            event = copier.copy_all(pairs)
            if event is not None:
                events.append(event)

        def walk(o: Any) -> Any:
            if torch.is_tensor(o):
                t = o.detach()
                out = torch.empty(0, dtype=t.dtype)
                return out.set_(copies[_key(t.untyped_storage())], t.storage_offset(), t.size(), t.stride())
            if isinstance(o, dict):
                out = copy.copy(o)  # keeps the mapping type (OrderedDict, defaultdict, ...)
                for k, v in o.items():
                    out[k] = walk(v)
                return out
            if isinstance(o, list):
                return [walk(v) for v in o]
            if isinstance(o, tuple) and not isinstance(o, torch.Size):
                return tuple(walk(v) for v in o) if type(o) is tuple else type(o)(*(walk(v) for v in o))
            return o

        return Snapshot(walk(obj), events)

    def release(self) -> None:
        """Free the pool (a later `take` allocates again)."""
        self._slabs, self._pinned = [], False

    # ------------------------------------------------------------------------------------ memory
    def _fit(self, storages: list[torch.UntypedStorage]) -> list[torch.UntypedStorage]:
        """A host slice of the pool for each storage, growing the pool if they do not fit."""
        pinned = any(s.device.type == "cuda" for s in storages)
        if pinned and not self._pinned and self._slabs:
            logger.info("checkpoint snapshot pool: re-allocated page-locked (the state now holds CUDA tensors)")
            self.release()
        sizes = [s.nbytes() for s in storages]
        places, extra = _place(sizes, [s.nbytes() for s in self._slabs])
        if extra and len(self._slabs) >= _MAX_SLABS:
            self.release()  # one slab of the whole size rather than many small ones
            places, extra = _place(sizes, [])
        if extra:
            self._pinned = self._pinned or pinned
            self._slabs.append(self._allocate(extra, self._pinned))
        return [self._slabs[slab][offset:offset + n] if n else torch.UntypedStorage(0)
                for (slab, offset), n in zip(places, sizes)]

    def _allocate(self, nbytes: int, pinned: bool) -> torch.UntypedStorage:
        start = time.perf_counter()
        # Zero-filled either way: the pages are faulted in here, not during a save's copies.
        buffer = page_locked_empty(nbytes, torch.uint8) if pinned else torch.zeros(nbytes, dtype=torch.uint8)
        self.num_allocations += 1
        logger.info("checkpoint snapshot pool: allocated %s of %shost memory in %.2f s (pool %s)",
                    human_bytes(nbytes), "page-locked " if pinned else "", time.perf_counter() - start,
                    human_bytes(self.nbytes + nbytes))
        return buffer.untyped_storage()


def _bytes(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    """A 1-D uint8 tensor over the whole of `storage`."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
