"""The overlapped offload step (``offload_optimizer.overlap_step``): the CPU optimizer step of step t
runs on a background thread while the forward and backward of step t+1 run.

Owns: the one background step in flight, and the snapshot of the optimizer's hyperparameters that step
uses. Must not: decide what the step does (the strategy hands a callable) or write parameters.

Note (the one-step delay): the strategy waits for step t-1's update at step t, writes it into the
device parameters, then prepares step t (overflow, norm, clip on the gradients of step t, which were
computed with the parameters of update t-2) and launches its optimizer step here. The forward of step
t+1 therefore sees update t-1: the parameters lag one step behind the gradients (the delayed parameter
update of the ZeRO-Offload paper). The CPU kernels release the GIL, so the step overlaps the Python
and device work of the main thread.

Note (hyperparameters): the engine steps the LR schedule right after the strategy's step returns,
while the background step may still be reading ``group["lr"]``. The background step therefore runs a
shallow clone of the optimizer whose param groups are copies taken at launch (the same tensors, the
same state dict), so it uses the hyperparameters of its own step, as the synchronous step does.
"""

from __future__ import annotations

import threading
from typing import Callable

import torch


def optimizer_snapshot(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """A shallow clone of `optimizer`: the same parameters, state and attributes, with param-group
    dicts copied now, so later edits of `optimizer.param_groups` (an LR schedule) do not reach it."""
    clone = object.__new__(type(optimizer))
    clone.__dict__.update(optimizer.__dict__)
    clone.param_groups = [dict(group) for group in optimizer.param_groups]
    return clone


class BackgroundStep:
    """At most one step running on a daemon thread; `wait()` joins it and re-raises its error."""

    def __init__(self):
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None

    def launch(self, fn: Callable[[], None]) -> None:
        self.wait()

        def run():
            try:
                with torch.no_grad():
                    fn()
            except BaseException as err:  # re-raised in the main thread by wait()
                self._error = err

        self._thread = threading.Thread(target=run, name="lightspeed-offload-step", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        if self._thread is None:
            return
        self._thread.join()
        self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError("the overlapped offload optimizer step failed") from err
