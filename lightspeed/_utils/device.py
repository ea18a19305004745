"""The accelerator seen by this process: `cpu` or `cuda`. Streams and events become no-ops on CPU so
callers never branch on the device type."""

from __future__ import annotations

import contextlib
import os

import torch


def default_device(local_rank: int | None = None) -> torch.device:
    """cuda:<local_rank> when CUDA is available (and not disabled by LIGHTSPEED_ACCELERATOR=cpu), else cpu."""
    if os.environ.get("LIGHTSPEED_ACCELERATOR", "").lower() == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
    return torch.device("cuda", local_rank % max(torch.cuda.device_count(), 1))


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Stream:
    """A side CUDA stream, or a stand-in that runs work inline on CPU."""

    def __init__(self, device: torch.device):
        self.device = device
        self._stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None

    def context(self):
        return torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()

    def wait_current(self) -> None:
        """Make this stream wait for work already queued on the current stream."""
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))

    def make_current_wait(self) -> None:
        """Make the current stream wait for work queued on this stream."""
        if self._stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._stream)

    def record(self, tensor: torch.Tensor) -> None:
        """`tensor`, allocated on another stream, is used on this one: the allocator must not reuse
        its memory before this stream's work on it is done."""
        if self._stream is not None and tensor.is_cuda:
            tensor.record_stream(self._stream)

    def record_event(self):
        """An event marking the work queued on this stream so far (None on CPU, where it is done)."""
        if self._stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self._stream)
        return event

    def synchronize(self) -> None:
        """Block the host until the work queued on this stream is done."""
        if self._stream is not None:
            self._stream.synchronize()
