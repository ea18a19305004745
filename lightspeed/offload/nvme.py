"""NVMe swapping for ZeRO-Infinity: host tensors written to swap files and their memory freed, read
back on demand, through a thread pool (no C++: `os.pwrite` / `os.preadv` release the GIL).

Owns: the swap directory (one per swapper, under the configured `nvme_path`, removed at close or at
exit), one file per registered tensor, the IO itself, and what is on disk versus in memory. Must not:
decide when to swap (the strategies do) or know what a tensor means.

Note (O_DIRECT): where the file system accepts O_DIRECT (probed once per swap directory by writing
one aligned block), files are opened with it and every request goes through page-aligned bounce
buffers of `aio.block_size * aio.queue_depth` bytes (one per IO thread), padded to whole blocks, so the
page cache is bypassed as DeepSpeed's libaio path does. Elsewhere (tmpfs, overlay file systems) plain
buffered IO straight from the tensor's memory is used, and the log says which.

Note (double buffering): a swap-out returns at once (its write runs on the pool; the tensor's
storage is freed by the write's job once the bytes are on disk; the directory goes at `close`,
when the swapper is collected, or at interpreter exit); `prefetch` starts a read, and
`ensure_in` waits for whatever is in flight for the tensor, so a caller reads the next sub-group while
it computes on this one. A tensor's storage is freed with `untyped_storage().resize_(0)` (its views,
e.g. optimizer pieces of a master shard, stay valid and see the data again after the read).
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import tempfile
import threading
from multiprocessing import util as mp_util
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from lightspeed._utils.logging import get_logger
from lightspeed._utils.sizes import human_bytes
from lightspeed.config.errors import ConfigError
from lightspeed.offload.policy import AioOptions

logger = get_logger(__name__)

PAGE = 4096


def check_nvme_path(path: str | None, key: str) -> str:
    """`path` as a directory this process can write into; a clear error naming `key` otherwise."""
    if not path:
        raise ConfigError(f'{key}: is required when device is "nvme"')
    if not os.path.isdir(path):
        raise ConfigError(f"{key}: {path!r} does not exist or is not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}: {path!r} is not writable by this process")
    return path


def _aligned(nbytes: int, align: int = PAGE) -> torch.Tensor:
    """A uint8 host tensor of `nbytes` whose data pointer is a multiple of `align`."""
    raw = torch.empty(nbytes + align, dtype=torch.uint8)
    shift = (-raw.data_ptr()) % align
    return raw[shift:shift + nbytes]


def _probe_direct(directory: str, block: int) -> bool:
    """True when an O_DIRECT file in `directory` accepts an aligned write and read."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    path = os.path.join(directory, ".probe")
    buf = _aligned(block)
    buf.fill_(7)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | flag, 0o600)
    except OSError:
        return False
    try:
        mv = _bytes(buf)
        return os.pwrite(fd, mv, 0) == block and os.preadv(fd, [mv], 0) == block
    except OSError:
        return False
    finally:
        os.close(fd)
        os.unlink(path)


def _bytes(t: torch.Tensor) -> memoryview:
    """The bytes of contiguous host tensor `t` as a writable memoryview. Through ctypes, not
    `.numpy()`: a tensor shared with numpy gets a storage that can no longer be resized (freed)."""
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


@dataclass
class _Entry:
    tensor: torch.Tensor
    path: str
    nbytes: int
    on_disk: bool = False  # the file holds the tensor's current values
    in_memory: bool = True
    pending: Future | None = None


class NvmeSwapper:
    """Swap files for the tensors registered with it, under `<nvme_path>/lightspeed-swap-*`."""

    def __init__(self, nvme_path: str, aio: AioOptions, *, key: str, name: str = "swap"):
        base = check_nvme_path(nvme_path, key)
        self.key = key
        try:
            self.directory = tempfile.mkdtemp(prefix=f"lightspeed-{name}-", dir=base)
        except OSError as err:
            raise ConfigError(f"{key}: cannot create a swap directory in {base!r}: {err.strerror}") from err
        self.block = max(int(aio.block_size), PAGE)
        self.block -= self.block % PAGE
        self.chunk = self.block * max(int(aio.queue_depth), 1)
        self.direct = _probe_direct(self.directory, self.block)
        self.pool = ThreadPoolExecutor(max(int(aio.thread_count), 1), thread_name_prefix="lightspeed-nvme")
        self._local = threading.local()
        self._entries: dict[int, _Entry] = {}
        self._count = 0
        self._closed = False
        logger.info("NVMe swap directory %s (%s IO, %d threads, %s requests)", self.directory,
                    "O_DIRECT" if self.direct else "buffered: the file system refuses O_DIRECT",
                    max(int(aio.thread_count), 1), human_bytes(self.chunk))
        # multiprocessing's finalizer runs when the swapper is collected, at interpreter exit (atexit),
        # and at the exit of a multiprocessing child (which skips atexit)
        self._finalizer = mp_util.Finalize(self, _remove_tree, (self.directory, self.pool), exitpriority=10)

    # ------------------------------------------------------------------ bookkeeping
    def require_space(self, nbytes: int) -> None:
        """Raise before training starts when the swap file system has less than `nbytes` free."""
        free = shutil.disk_usage(self.directory).free
        if free < nbytes:
            raise ConfigError(f"{self.key}: {self.directory!r} has {human_bytes(free)} free; the swap files need "
                              f"about {human_bytes(nbytes)}")

    def register(self, tensor: torch.Tensor, name: str) -> None:
        """Swap `tensor` (a contiguous host tensor owning its storage) through file `name`."""
        if id(tensor) in self._entries:
            return
        if tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.is_pinned():
            raise ValueError("NVMe swapping needs contiguous, unpinned host tensors")
        safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in name)
        self._count += 1
        path = os.path.join(self.directory, f"{self._count}_{safe}.swp")
        self._entries[id(tensor)] = _Entry(tensor, path, tensor.numel() * tensor.element_size())

    def forget(self, tensor: torch.Tensor) -> None:
        """Stop swapping `tensor` (its values are brought into memory first; its file is removed)."""
        e = self._entries.get(id(tensor))
        if e is None or e.tensor is not tensor:
            return
        self.ensure_in(tensor)
        del self._entries[id(tensor)]
        if os.path.exists(e.path):
            os.unlink(e.path)

    def mark_dirty(self, tensor: torch.Tensor) -> None:
        """`tensor` (in memory) was written: its next swap-out writes it."""
        e = self._entries.get(id(tensor))
        if e is not None and e.tensor is tensor:
            self._wait(e)
            e.on_disk = False

    def location(self, tensor: torch.Tensor) -> str | None:
        """"nvme" when `tensor` is registered and its memory is freed, "cpu" when registered and in
        memory, None when not registered."""
        e = self._entries.get(id(tensor))
        if e is None or e.tensor is not tensor:
            return None
        return "cpu" if e.in_memory else "nvme"

    def registered(self, tensor: torch.Tensor) -> bool:
        e = self._entries.get(id(tensor))
        return e is not None and e.tensor is tensor

    def bytes_on_disk_only(self) -> int:
        """Bytes of registered tensors whose memory is freed (their values live in the swap files)."""
        return sum(e.nbytes for e in self._entries.values() if not e.in_memory or e.pending is not None)

    # ------------------------------------------------------------------ swapping
    def swap_out(self, tensor: torch.Tensor, *, dirty: bool = True) -> None:
        """Free `tensor`'s memory, writing it first unless it is clean and already on disk (asynchronous)."""
        e = self._entry(tensor)
        self._wait(e)
        if not e.in_memory:
            return
        write = dirty or not e.on_disk
        e.in_memory = False
        e.pending = self.pool.submit(self._write_and_free, e, write)

    def prefetch(self, tensor: torch.Tensor) -> None:
        """Start reading `tensor` back (no-op when it is in memory or on its way)."""
        e = self._entry(tensor)
        if e.in_memory and e.pending is None:
            return
        if e.pending is not None and e.in_memory:  # a read in flight
            return
        self._wait(e)
        e.tensor.untyped_storage().resize_(e.nbytes)
        e.in_memory = True
        e.pending = self.pool.submit(self._read, e)

    def ensure_in(self, tensor: torch.Tensor) -> None:
        """Block until `tensor` holds its values in memory."""
        e = self._entries.get(id(tensor))
        if e is None or e.tensor is not tensor:
            return
        if not e.in_memory:
            self.prefetch(tensor)
        self._wait(e)

    def ensure_all_in(self) -> None:
        for e in self._entries.values():
            self.ensure_in(e.tensor)

    def _entry(self, tensor: torch.Tensor) -> _Entry:
        e = self._entries.get(id(tensor))
        if e is None or e.tensor is not tensor:
            raise KeyError("tensor not registered with this NVMe swapper")
        return e

    @staticmethod
    def _wait(e: _Entry) -> None:
        if e.pending is not None:
            fut, e.pending = e.pending, None
            fut.result()

    # ------------------------------------------------------------------ IO (pool threads)
    def _bounce(self) -> memoryview:
        buf = getattr(self._local, "buf", None)
        if buf is None:
            self._local.tensor = _aligned(self.chunk)
            buf = self._local.buf = _bytes(self._local.tensor)
        return buf

    def _spans(self, nbytes: int):
        """(offset, length, length rounded up to the O_DIRECT block) of each IO chunk of a file."""
        for pos in range(0, nbytes, self.chunk):
            n = min(self.chunk, nbytes - pos)
            yield pos, n, -(-n // self.block) * self.block

    def _open(self, path: str, write: bool) -> int:
        flags = (os.O_RDWR | os.O_CREAT) if write else os.O_RDONLY
        if self.direct:
            flags |= os.O_DIRECT
        return os.open(path, flags, 0o600)

    def _write_and_free(self, e: _Entry, write: bool) -> None:
        if write:
            src = _bytes(e.tensor)
            fd = self._open(e.path, True)
            try:
                for pos, n, padded in self._spans(e.nbytes):
                    if self.direct:
                        buf = self._bounce()
                        buf[:n] = src[pos:pos + n]
                        _full_write(fd, buf[:padded], pos)
                    else:
                        _full_write(fd, src[pos:pos + n], pos)
            except OSError as err:
                if err.errno == errno.ENOSPC:
                    raise RuntimeError(f"{self.key}: the swap file system {self.directory!r} is full") from err
                raise
            finally:
                os.close(fd)
            e.on_disk = True
        e.tensor.untyped_storage().resize_(0)

    def _read(self, e: _Entry) -> None:
        dst = _bytes(e.tensor)
        fd = self._open(e.path, False)
        try:
            for pos, n, padded in self._spans(e.nbytes):
                if self.direct:
                    buf = self._bounce()
                    _full_read(fd, buf[:padded], pos, n)
                    dst[pos:pos + n] = buf[:n]
                else:
                    _full_read(fd, dst[pos:pos + n], pos, n)
        finally:
            os.close(fd)

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Remove the swap directory (values not in memory are lost: call `ensure_all_in` first)."""
        if not self._closed:
            self._closed = True
            for e in self._entries.values():
                if e.pending is not None:
                    e.pending.exception()
                    e.pending = None
            self._finalizer()


def _full_write(fd: int, buf: memoryview, offset: int) -> None:
    done = 0
    while done < len(buf):
        done += os.pwrite(fd, buf[done:], offset + done)


def _full_read(fd: int, buf: memoryview, offset: int, need: int) -> None:
    done = 0
    while done < need:
        got = os.preadv(fd, [buf[done:]], offset + done)
        if got == 0:
            raise RuntimeError(f"swap file ended after {done} of {need} bytes")
        done += got


def _remove_tree(directory: str, pool: ThreadPoolExecutor) -> None:
    # the last reference may drop inside a pool thread (a finished IO job): that thread cannot join itself
    in_pool = threading.current_thread().name.startswith("lightspeed-nvme")
    pool.shutdown(wait=not in_pool, cancel_futures=in_pool)
    shutil.rmtree(directory, ignore_errors=True)
