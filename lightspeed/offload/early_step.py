"""The early offloaded step: the CPU optimizer steps each bucket's range of the masters as soon as
that bucket's gradients reach host memory, while backward goes on (ZeRO-Offload's overlap of the CPU
step with the gradient transfers).

Exact only where no step-wide quantity changes the update: no gradient clipping (its coefficient
needs every gradient's norm) and no loss scaling (its overflow check needs every gradient). The step
runner (zero/step_runner.py) decides per step; otherwise the optimizer steps after backward as usual,
or (`offload_optimizer.super_offload`) early anyway, a `saver` called before each range steps (it
keeps the range's pre-step values or checks its gradient, and may hold the range back:
offload/speculative.py).

Owns: one worker thread per step, the queue of ready ranges (each with the event of its copy to the
host), and re-raising the worker's error in the caller. Must not: decide when stepping early is exact,
or issue the copies (the strategy does, on the step runner's copy stream).

Note (parameters written during backward): each stepped range goes to the device parameters at once
(the CPU optimizer's low-precision writer, on its side stream). A bucket is complete only when every
parameter in it has its gradient for this step, so backward no longer reads those parameters (a
parameter used twice, tied weights, gets its gradient once, after its last use); the forward of the
next step is ordered after the copies by the step's `end_zero_step`.
"""

from __future__ import annotations

import queue
import threading

import torch


class EarlyStep:
    """Steps ranges of `optimizer`'s params in a background thread, in the order they are submitted.
    `optimizer` is a CPU optimizer in the middle of a ZeRO step (`begin_zero_step` returned `params`);
    `finish` steps whatever no range covered (a param whose gradient never went to the host early)."""

    def __init__(self, optimizer, params: list[torch.Tensor], saver=None):
        self.optimizer = optimizer
        self.params = params
        # the speculative step: called with (param, start, end) before each range steps; False: skip it
        self.saver = saver
        self._covered: dict[int, int] = {}  # id(param) -> elements stepped
        self._queue: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self.ranges = 0
        self._thread = threading.Thread(target=self._run, name="lightspeed-early-offload-step", daemon=True)
        self._thread.start()

    def submit(self, event, param: torch.Tensor, start: int, end: int) -> None:
        """Step `param[start:end]` once `event` (the copy of its gradient to the host; None: done) is."""
        self._queue.put((event, param, start, end))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if self._error is not None:
                continue  # drain after a failure; finish() re-raises it
            event, param, start, end = item
            try:
                if event is not None:
                    event.synchronize()
                with torch.no_grad():
                    if self.saver is None or self.saver(param, start, end):
                        self.optimizer.zero_step_range(param, start, end)
                self.ranges += 1
                self._covered[id(param)] = self._covered.get(id(param), 0) + end - start
            except BaseException as err:  # re-raised by finish()
                self._error = err

    def finish(self) -> None:
        """Wait for every submitted range; then the optimizer's copies are ordered before the compute
        stream's next work (`end_zero_step`)."""
        self._queue.put(None)
        self._thread.join()
        if self._error is None:
            for p in self.params:
                done = self._covered.get(id(p), 0)
                if done == 0:
                    with torch.no_grad():
                        if self.saver is None or self.saver(p, 0, p.numel()):
                            self.optimizer.zero_step_range(p, 0, p.numel())
                elif done != p.numel():
                    self._error = RuntimeError(f"the early offloaded step covered {done} of {p.numel()} elements "
                                               "of an optimizer tensor")
        self.optimizer.end_zero_step()
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(f"the offloaded optimizer step during backward failed: {err}") from err
