"""A CPU stand-in for the CUDA graph of the captured optimizer step (zero/graphed_step.py), so its logic
runs in CI on the Triton kernels under TRITON_INTERPRET=1.

It keeps what a CUDA graph keeps of a capture: the kernel launches, each with the arguments it was
launched with (numbers as they were then, tensors by reference, read again at every replay). Capture
records the launches without running them and fails on any torch op that writes a tensor (a captured
step must leave nothing to do but its launches); replay runs the recorded launches, no Python of the
step. `use_standin(monkeypatch)` puts it in place and lets CPU tensors capture.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from triton.runtime.interpreter import InterpretedFunction

from lightspeed.zero import graphed_step

_run = InterpretedFunction.run


class _NoWrites(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments):
            raise AssertionError(f"the captured step wrote a tensor with {func}")
        return func(*args, **(kwargs or {}))


class StandinGraph:
    made: list["StandinGraph"] = []  # every graph captured, in order (use_standin empties it)

    def __init__(self, device: torch.device):
        self.launches: list = []
        self.replays = 0

    def warm_up(self, fn) -> None:
        fn()

    def capture(self, fn) -> None:
        def record(kernel, *args, grid, warmup, **kwargs):
            self.launches.append((kernel, args, grid, kwargs))

        InterpretedFunction.run = record
        try:
            with _NoWrites():
                fn()
        finally:
            InterpretedFunction.run = _run
        assert self.launches, "nothing was captured"
        StandinGraph.made.append(self)

    def replay(self) -> None:
        self.replays += 1
        for kernel, args, grid, kwargs in self.launches:
            _run(kernel, *args, grid=grid, warmup=False, **kwargs)


def use_standin(monkeypatch) -> None:
    StandinGraph.made = []
    monkeypatch.setattr(graphed_step, "GRAPH", StandinGraph)
    monkeypatch.setattr(graphed_step, "GRAPH_DEVICE_TYPES", frozenset({"cuda", "cpu"}))
    monkeypatch.setenv("LIGHTSPEED_OPS_BACKEND", "triton")  # the fused optimizers take the kernels on CPU
