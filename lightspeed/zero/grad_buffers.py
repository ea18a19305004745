"""Gradient buffers that hold memory only while there are gradients: from the first gradient of a
backward to the end of the step.

Note (why the storage is released between steps): a training step's memory peaks in forward and early
backward, when the activations are alive. Gradient buffers allocated for the whole run sit under that
peak while holding nothing (they are zero between `zero_grad` and the next backward); DeepSpeed frees
its partitioned gradients after the step for the same reason. At 1.3B on one GPU the bf16 gradient
buffer is 2.45 GiB, the difference between lightspeed's and DeepSpeed's ZeRO-2 peak
(`benchmarks/offload.py`, one H200, 2026-12-02: 36.34 against 33.88 GiB without offload). So
`release()` (from the strategy's `zero_grad`) resizes each buffer's storage to zero and `ensure()`
(before the first gradient lands, and before anything reads them: the step, `wait_gradients`) brings
it back zero-filled. The tensor objects stay, so every view made of them (`param.grad` at stages 1-2,
bucket and shard slices, the step's views, `param_access` fragments) sees the new memory: only a view
read while released fails, which is why every reader goes through `ensure()` first.
`memory_breakdown()` keeps counting the buffers under "grads": it is what a backward allocates.
Host buffers (an offloaded optimizer's fp32 gradients, read by CPU threads) are never released, nor
are buffers `kept` (optimizer.cuda_graph: the captured step reads fixed addresses, zero/graphed_step.py).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterable, Iterator

import torch


class GradBuffers:
    """The storage-owning gradient tensors of one strategy (or one stage-3 group)."""

    def __init__(self, tensors: Iterable[torch.Tensor | None], on_release: Callable[[], None] | None = None):
        seen: set[int] = set()
        self._tensors: list[torch.Tensor] = []
        for t in tensors:
            if t is None or t.numel() == 0 or t.untyped_storage().data_ptr() in seen:
                continue
            if t.storage_offset() != 0 or t.numel() * t.element_size() != t.untyped_storage().nbytes():
                raise ValueError("GradBuffers takes tensors that own their whole storage")
            seen.add(t.untyped_storage().data_ptr())
            self._tensors.append(t)
        self._nbytes = [t.untyped_storage().nbytes() for t in self._tensors]
        self._on_release = on_release
        self.released = False
        self.kept = False  # storage never freed (optimizer.cuda_graph: a captured step reads fixed addresses)

    def release(self) -> None:
        """Free the storage (views stay; reading one before `ensure()` raises); while `kept`, the
        storage stays where it is and only the state changes (`ensure()` zeroes it)."""
        if self.released:
            return
        if self._on_release is not None:
            self._on_release()
        for t in self._tensors:
            if not self.kept:
                t.untyped_storage().resize_(0)
        self.released = True

    def ensure(self) -> None:
        """Allocate the storage again, zero-filled (a no-op while allocated)."""
        if not self.released:
            return
        for t, nbytes in zip(self._tensors, self._nbytes):
            if t.untyped_storage().nbytes() != nbytes:
                t.untyped_storage().resize_(nbytes)
            t.zero_()
        self.released = False

    @contextmanager
    def allocated(self) -> Iterator[None]:
        """The buffers allocated inside the block (to cut views of them), released again after it
        when they were released before."""
        was_released = self.released
        self.ensure()
        try:
            yield
        finally:
            if was_released:
                self.release()
