"""`LowpWriter`: how a CPU optimizer writes the updated parameters into their low-precision copies,
piece by piece while it steps, wherever those copies live.

A CPU optimizer stepping host masters (ZeRO-Offload) ends with the updated values in host memory and
the model's low-precision parameters on the device. `lp.copy_(master)` across devices and dtypes is
the slow way: torch casts on the host into pageable memory, then copies synchronously (776 ms for the
1.3B GPT's 5.2 GB of fp32 masters on one H200, 2026-12-02, `benchmarks/offload.py --phases`). Here
each stepped piece goes to the device at once on a side stream, so its copy runs while the CPU steps
the next piece: from a page-locked master the fp32 piece is copied as it is and cast on the device
(the host's memory bandwidth, which the optimizer step is bound by, is not spent on a cast); from
pageable memory it is cast into a small page-locked staging buffer first. A target in host memory is
written directly.

Owns: the staging (one fp32 device buffer per device; a ring of page-locked buffers per dtype, each
reused only after its copy finished, told by a CUDA event), the side stream, and the ordering with the
compute stream (the copies start after the work already queued there, which may still read the
parameters; `finish` makes the compute stream wait for the last copy). Must not: step, or know which
tensor is a master.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lightspeed._utils.device import Stream

STAGING_BUFFERS = 3  # per dtype: one being filled, up to two copies in flight
#: elements per copy: 16 MiB of fp32, small enough that the copy of one piece hides behind the
#: CPU optimizer's work on the next
PIECE_ELEMS = 4 * 1024 * 1024


class LowpWriter:
    """Writes host fp32 pieces into low-precision targets given as [(offset, tensor)] per master."""

    def __init__(self, piece_numel: int = PIECE_ELEMS):
        self.piece_numel = piece_numel
        self._streams: dict[torch.device, Stream] = {}
        self._ring: dict[tuple[torch.device, torch.dtype], list[tuple[torch.Tensor, torch.cuda.Event]]] = {}
        self._next: dict[tuple[torch.device, torch.dtype], int] = {}
        self._device_bufs: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        self._started: set[torch.device] = set()

    def write(self, master: torch.Tensor, start: int, end: int, targets: Sequence[tuple[int, torch.Tensor]]) -> None:
        """Copy `master[start:end]` (flat, host) into the parts of `targets` it covers: each target
        holds the master's elements from its offset on."""
        flat = master.view(-1)
        for offset, target in targets:
            lo, hi = max(start, offset), min(end, offset + target.numel())
            if lo >= hi:
                continue
            src, dst = flat[lo:hi], target.view(-1)[lo - offset:hi - offset]
            if dst.device.type == "cpu":
                dst.copy_(src)
            else:
                self._to_device(src, dst)

    def _to_device(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        stream = self._streams.get(dst.device)
        if stream is None:
            stream = self._streams[dst.device] = Stream(dst.device)
        if dst.device not in self._started:
            # once per round: the previous round's copies have finished (the caller may be about to
            # overwrite their page-locked sources), and these start after the work queued on the
            # compute stream
            stream.synchronize()
            stream.wait_current()
            self._started.add(dst.device)
        pinned = src.is_pinned()
        for lo in range(0, src.numel(), self.piece_numel):
            hi = min(src.numel(), lo + self.piece_numel)
            if pinned and src.dtype == dst.dtype:
                with stream.context():
                    dst[lo:hi].copy_(src[lo:hi], non_blocking=True)
            elif pinned:  # copy as it is, cast on the device (the side stream orders the staging's reuse)
                staged = self._device_staging(dst.device, src.dtype)[:hi - lo]
                with stream.context():
                    staged.copy_(src[lo:hi], non_blocking=True)
                    dst[lo:hi].copy_(staged)
            else:  # pageable: cast on the host into page-locked staging, then copy
                buf, done = self._slot(dst.device, dst.dtype)
                done.synchronize()  # the copy that last read this buffer has finished
                staged = buf[:hi - lo]
                staged.copy_(src[lo:hi])
                with stream.context():
                    dst[lo:hi].copy_(staged, non_blocking=True)
                    done.record()

    def _device_staging(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        buf = self._device_bufs.get((device, dtype))
        if buf is None:
            buf = self._device_bufs[(device, dtype)] = torch.empty(self.piece_numel, dtype=dtype, device=device)
        return buf

    def _slot(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.cuda.Event]:
        key = (device, dtype)
        ring = self._ring.get(key)
        if ring is None:
            ring = self._ring[key] = [(torch.empty(self.piece_numel, dtype=dtype, pin_memory=True), torch.cuda.Event())
                                      for _ in range(STAGING_BUFFERS)]
            self._next[key] = 0
        i = self._next[key]
        self._next[key] = (i + 1) % len(ring)
        return ring[i]

    def finish(self) -> None:
        """The compute streams wait for every copy issued since the last `finish`."""
        for device in self._started:
            self._streams[device].make_current_wait()
        self._started.clear()
