"""What a `wq_matmul` launch needs besides its kernel: the per-device scratch buffers of split-K and
stream-K (`workspace`, `counter`) and launch plans (`Plan`, `plan_key`, `keep`). Imports triton (its
launcher's driver and hooks); like `triton.py`, import it lazily.

Note: launch plans. An eager decode step is bound by the host: through triton's autotuner and launcher a
call took 100-140 us of CPU on the H200's host against 23-25 us for F.linear
(docs/benchmark-notes/decode.md, "Launch plans", 2026-11-30), which made transformers' eager generate
2-4x slower with quantized layers than in fp16. So the first tuned call of each `plan_key` class keeps
its compiled kernel, grid and arguments (`Plan`), and later calls of the class pass the tensors'
addresses, as integers, straight to the compiled kernel's launcher: no tuner lookup, argument binding,
specialization, or driver query per pointer (27-28 us a call). A plan holds the scratch buffers it ran
with, so growing one drops every plan. The grouped (MoE experts) kernel keeps plans the same way, in the
same dict (`grouped.py`, keys tagged "grouped").
"""

from __future__ import annotations

import torch
from triton import knobs
from triton.runtime.driver import driver

from lightspeed.ops.wquant.reference import QuantizedWeight

MAX_PLANS = 4096  # plan_key classes kept; all are dropped when full
plans: dict = {}
workspaces: dict = {}
counters: dict = {}


def workspace(device: torch.device, numel: int) -> torch.Tensor:
    """A grow-only fp32 scratch buffer per device for split-K partials (kernels overwrite, never
    accumulate into it, so it needs no zeroing)."""
    ws = workspaces.get(device)
    if ws is None or ws.numel() < numel:
        ws = torch.empty(max(numel, 1), device=device, dtype=torch.float32)
        workspaces[device] = ws
        plans.clear()  # they hold the old buffer: let it go
    return ws


def counter(device: torch.device, numel: int) -> torch.Tensor:
    """A grow-only int32 buffer of zeros per device: the split-K arrival counters (each output tile's
    last program resets its counter, so it is zero between calls)."""
    cnt = counters.get(device)
    if cnt is None or cnt.numel() < numel:
        cnt = torch.zeros(max(numel, 1024), device=device, dtype=torch.int32)
        counters[device] = cnt
        plans.clear()
    return cnt


def plan_key(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None, reduce: int) -> tuple:
    """What a plan's compiled kernel and arguments depend on besides the tensors' addresses: the shapes, M,
    dtypes, x's row stride and the 16-byte alignment of every pointer (triton specializes on these), the
    format, group size and split-K reduction."""
    w, s = qw.planes[0], qw.scales
    return (driver.active.get_current_device(), x.dtype, x.shape[0], x.stride(0), x.data_ptr() % 16,
            qw.format, qw.shape, qw.group_size, qw.tile, w.shape, w.dtype, w.is_contiguous(), w.data_ptr() % 16,
            s.dtype, s.is_contiguous(), s.data_ptr() % 16,
            None if bias is None else (bias.dtype, bias.shape, bias.stride(), bias.data_ptr() % 16), reduce)


class Plan:
    """A kept launch: the compiled kernel, its grid, the launch arguments by position (the kernel's
    parameters, constexprs included; the first six, x, w, w2, scales, bias, out, are set per call) and
    the config it ran with."""

    __slots__ = ("kernel", "grid", "args", "config")

    def __init__(self, kernel, grid: tuple, args: list, config: dict):
        self.kernel, self.grid, self.args, self.config = kernel, grid, args, config

    def launch(self, x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
        """`wq_matmul`'s call: the first six arguments are this call's."""
        out = torch.empty((x.shape[0], qw.shape[0]), device=x.device, dtype=x.dtype)
        args = self.args.copy()
        w = qw.planes[0].data_ptr()  # the w units and fp6's lo bytes are views of one tensor
        s = qw.scales.data_ptr()
        args[:6] = (x.data_ptr(), w, w, s, s if bias is None else bias.data_ptr(), out.data_ptr())
        self.run(args)
        return out

    def run(self, args: list) -> None:
        """Launch the kept kernel on the current stream with `args` (the plan's, with this call's set)."""
        kernel, (g0, g1, g2) = self.kernel, self.grid
        stream = driver.active.get_current_stream(driver.active.get_current_device())
        kernel.run(g0, g1, g2, stream, kernel.function, kernel.packed_metadata,
                   kernel.launch_metadata(self.grid, stream, *args), knobs.runtime.launch_enter_hook,
                   knobs.runtime.launch_exit_hook, *args)


def keep(key: tuple, plan: Plan, per_call=range(6)) -> None:
    """Keep `plan` under `key`; the arguments at `per_call` are set by each call (holding the first call's
    tensors there would keep them alive)."""
    for i in per_call:
        plan.args[i] = None
    if len(plans) >= MAX_PLANS:
        plans.clear()
    plans[key] = plan
