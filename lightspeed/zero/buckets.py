"""Gradient buckets: consecutive ranges of a flat gradient buffer, reduced as soon as every parameter
in them has its gradient for this step.

Owns: readiness bookkeeping and the launch order. Must not: decide how a bucket is reduced (the
`launch` callable given by the strategy does: all-reduce for stage 0, reduce-scatter later).

Note (launch order): every rank must issue collectives in the same order, so buckets are launched in
index order only (FlatParams lays the parameters out last first, so index order is the order in which
backward completes them): a bucket that becomes ready early waits until all buckets before it have
been launched. Parameters that got no gradient in this backward (unused in forward) are launched
by `flush()` at the end of backward, again in index order. With `max_inflight`, the oldest launched
reduction is finished as soon as more are in flight, so the temporary buffers of at most that many
reductions are alive at once (stage 2's staging buffers), not every bucket's until the step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from lightspeed.zero.flat_params import FlatParams


@dataclass
class Bucket:
    index: int
    flat: FlatParams
    first: int  # first parameter index (in flat.params)
    last: int  # one past the last parameter index
    start: int  # flat-buffer element range [start, end)
    end: int
    num_pending: int = 0
    handle: Any = None
    marked: set[int] = field(default_factory=set)

    @property
    def grad(self) -> torch.Tensor:
        """This bucket's slice of the full gradient buffer (stages 0 and 1)."""
        return self.flat.grad_flat[self.start:self.end]

    @property
    def numel(self) -> int:
        return self.end - self.start


class GradBuckets:
    """Buckets over one or more FlatParams, launched in a fixed order by `launch(bucket) -> handle`."""

    def __init__(self, flats: list[FlatParams], launch: Callable[[Bucket], Any], *, max_inflight: int | None = None):
        self.launch_fn = launch
        self.max_inflight = max_inflight
        self._inflight: deque[Bucket] = deque()
        self.buckets: list[Bucket] = []
        self.where: dict[int, tuple[Bucket, int]] = {}  # id(param) -> (bucket, param index)
        for flat in flats:
            for plan in flat.buckets:
                bucket = Bucket(len(self.buckets), flat, plan.first, plan.last, plan.start,
                                plan.start + plan.padded_numel)
                self.buckets.append(bucket)
                for i in range(plan.first, plan.last):
                    self.where[id(flat.params[i])] = (bucket, i)
        self.reset()
        # nothing is pending before the first boundary backward's `reset()`: a `flush()` / `wait()` before
        # it (a gradient read inside `no_sync()`, a step without a backward) launches no reduction
        self._next = len(self.buckets)

    def reset(self) -> None:
        for b in self.buckets:
            b.num_pending = b.last - b.first
            b.handle = None
            b.marked.clear()
        self._next = 0
        self._inflight.clear()

    def mark_ready(self, param: torch.nn.Parameter) -> None:
        bucket, index = self.where[id(param)]
        if index in bucket.marked:
            raise RuntimeError("a parameter received its gradient twice in one backward pass at a gradient "
                               "accumulation boundary (reentrant checkpointing or a second backward?); "
                               "call engine.backward once per micro-step")
        bucket.marked.add(index)
        bucket.num_pending -= 1
        self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and self.buckets[self._next].num_pending == 0:
            bucket = self.buckets[self._next]
            bucket.handle = self.launch_fn(bucket)
            self._next += 1
            if self.max_inflight is not None and bucket.handle is not None:
                self._inflight.append(bucket)
                if len(self._inflight) > self.max_inflight:
                    oldest = self._inflight.popleft()
                    if oldest.handle is not None:
                        oldest.handle.wait()
                        oldest.handle = None

    def flush(self) -> None:
        """Launch every bucket not launched yet (parameters without gradients count as ready)."""
        for bucket in self.buckets[self._next:]:
            bucket.num_pending = 0
        self._launch_ready()

    def wait(self) -> None:
        self.flush()
        self.wait_launched()

    def wait_launched(self) -> None:
        """Finish the reductions launched so far (and launch none: a teardown after no backward)."""
        for bucket in self.buckets:
            if bucket.handle is not None:
                bucket.handle.wait()
                bucket.handle = None
        self._inflight.clear()
