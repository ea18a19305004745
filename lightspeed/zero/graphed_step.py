"""The fused ZeRO step's launches captured once in a CUDA graph and replayed (`optimizer.cuda_graph`,
lightspeed's own key).

Owns: which configurations may capture (`check_graphed_step`: refused with a ConfigError naming the
key where the step is not the fused device step or reads per-step values the graph cannot), and
`GraphedStep`, which a strategy's `ShardViews.graphed` holds: the fp32 device scalars the captured
kernels read their hyperparameters from, the static gradient-scale scalar, the graph, and the layout
it was captured for. Must not: compute the norm, the overflow verdict or the coefficient (the shared
step does, zero/sharded_step.py, before the replay), or know a stage.

Note [what is captured]: the optimizer's launches only (ops/multi_tensor/optimizer.py's Note
[captured step]): every fused update of every group, each writing its low-precision parameter copy.
Each step runs the optimizer's host half (step counts, learning rate, bias corrections: whatever a
scheduler changed is read there), writes those values and the unscale/clip coefficient into the
scalars the graph reads, then replays. The fp16 overflow decision stays on the host before it: an
overflowing step is skipped before anything is written, as the uncaptured step is. The values are the
fp32 numbers the uncaptured kernels receive by value, so the two give the same bits.

Note [re-capture]: the layout (the addresses of parameters, states, gradients and low-precision
copies, gradient dtypes, the launch objects themselves, whether a coefficient is applied) is taken
every step. A new layout drops the graph: its first step runs the launches eagerly on a side stream
(the warm-up: plans and kernels built), its second captures and replays. A checkpoint load rebuilds
the optimizer's launches (FusedOptimizer.load_state_dict), so the next step captures again; the
launch objects are held by the layout, so a freed one's id is never taken for it. The gradient
buffers stay allocated between steps while this is on (zero/grad_buffers.py `kept`): released and
re-allocated storage would move every step.
"""

from __future__ import annotations

from typing import Callable

import torch

from lightspeed._utils.logging import get_logger
from lightspeed.config.errors import ConfigError
from lightspeed.ops.multi_tensor.optimizer import FusedOptimizer

logger = get_logger(__name__)

KEY = "optimizer.cuda_graph"
GRAPH_DEVICE_TYPES = frozenset({"cuda"})  # where a step is captured (CPU tests add their stand-in's)
_PAD = 4  # fp32 words per scalar: every scalar's address 16-byte aligned (one kernel specialisation)


class CudaGraph:
    """torch.cuda.CUDAGraph behind the three calls `GraphedStep` makes (tests replace `GRAPH`)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._graph: torch.cuda.CUDAGraph | None = None

    def warm_up(self, fn: Callable[[], None]) -> None:
        """Run `fn` once eagerly on a side stream, as torch asks before a capture."""
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            fn()
        current.wait_stream(side)

    def capture(self, fn: Callable[[], None]) -> None:
        self._graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self._graph):
            fn()

    def replay(self) -> None:
        self._graph.replay()


GRAPH: type = CudaGraph  # what GraphedStep captures with


def check_graphed_step(optimizer: torch.optim.Optimizer | None, fused: bool, offloaded: bool,
                       device: torch.device | None, stochastic_rounding: bool = False) -> None:
    """Refuse `optimizer.cuda_graph` where the step cannot be captured (one ConfigError naming it).
    `stochastic_rounding`: bf16.stochastic_rounding, which the strategy turns on after this check."""
    if offloaded:
        raise ConfigError(f"{KEY}: not with zero_optimization.offload_optimizer / offload_param (ZenFlow, "
                          "super_offload included): the offloaded step runs on the host")
    if optimizer is None or not isinstance(optimizer, FusedOptimizer) or not fused:
        raise ConfigError(f"{KEY}: needs a fused device optimizer stepping the ZeRO shards (FusedAdam, FusedLion, "
                          f"FusedAdagrad: Adam/AdamW/Lion/Adagrad); got {type(optimizer).__name__}")
    if stochastic_rounding or optimizer.stochastic_rounding:
        raise ConfigError(f"{KEY}: not with bf16.stochastic_rounding (its kernels take a new seed every step)")
    if not optimizer.graph_capturable:
        raise ConfigError(f"{KEY}: {type(optimizer).__name__}'s step cannot be captured (it reads per-step values "
                          "on the host)")
    if device is not None and device.type not in GRAPH_DEVICE_TYPES:
        raise ConfigError(f"{KEY}: needs a CUDA device (got {device})")


class GraphedStep:
    """The captured optimizer step of one strategy (module docstring). `captures` / `replays` count."""

    def __init__(self, optimizer: FusedOptimizer):
        self.optimizer = optimizer
        self._layout: tuple | None = None
        self._graph = None  # GRAPH, once captured for `_layout`
        self._slots: list[dict[str, torch.Tensor]] = []  # per launch: name -> its fp32 device scalar
        self._table: torch.Tensor | None = None  # the scalars' storage, [launches * names * _PAD]
        self._staging: torch.Tensor | None = None  # page-locked host copy of the table (CUDA)
        self._copied: torch.cuda.Event | None = None  # recorded after each staging -> table copy (CUDA)
        self._scale: torch.Tensor | None = None  # the coefficient the graph reads
        self.captures = 0
        self.replays = 0

    def step(self, opt_grads: dict, lowp_out: dict, coef: torch.Tensor | None, device: torch.device) -> None:
        """One fused optimizer step: the host half, this step's values written, then the launches
        (eager at a layout's first step, captured at its second, replayed after)."""
        if device.type not in GRAPH_DEVICE_TYPES or not self.optimizer.graph_capturable:
            raise RuntimeError(f"{KEY}: this step cannot be captured (tensors on {device}, "
                               f"graph_capturable {self.optimizer.graph_capturable})")
        layout, values = self.optimizer.graph_advance(opt_grads, lowp_out)
        names = tuple(tuple(v) for v in values)
        layout = (layout, names, coef is None)
        fresh = layout != self._layout
        if fresh:
            self._graph = None
            self._allocate(names, device)
        self._write(values, coef)
        launches = self._launch_fn(opt_grads, coef is not None)
        if fresh:
            GRAPH(device).warm_up(launches)
            self._layout = layout
        elif self._graph is None:
            graph = GRAPH(device)
            graph.capture(launches)
            self._graph = graph
            self.captures += 1
            logger.debug("%s: captured the optimizer step (%d launches)", KEY, len(values))
        if self._graph is not None:
            self._graph.replay()
            self.replays += 1

    def _launch_fn(self, opt_grads: dict, scaled: bool) -> Callable[[], None]:
        scale = self._scale if scaled else None
        return lambda: self.optimizer.graph_launches(opt_grads, scale, self._slots)

    def _allocate(self, names: tuple, device: torch.device) -> None:
        """Scalars for launches taking these argument names (a new layout: the old graph is dropped)."""
        width = sum(len(n) for n in names)
        self._table = torch.zeros(width * _PAD, dtype=torch.float32, device=device)
        self._staging = torch.zeros(width * _PAD, dtype=torch.float32, pin_memory=device.type == "cuda")
        self._copied = torch.cuda.Event() if self._staging.is_pinned() else None
        cells = iter(self._table.view(width, _PAD)[:, 0])
        self._slots = [{name: next(cells) for name in launch} for launch in names]
        self._scale = torch.zeros((), dtype=torch.float32, device=device)

    def _write(self, values: list[dict[str, float]], coef: torch.Tensor | None) -> None:
        """This step's values into the scalars, in stream order before the launches that read them."""
        pinned = self._copied is not None
        if pinned:
            self._copied.synchronize()  # the last step's copy has left the staging buffer
        flat = [float(x) for launch in values for x in launch.values()]
        self._staging.view(-1, _PAD)[:, 0].copy_(torch.tensor(flat, dtype=torch.float32))
        self._table.copy_(self._staging, non_blocking=pinned)
        if pinned:
            self._copied.record()
        if coef is not None:
            self._scale.copy_(coef.reshape(()))
