"""DeepSpeed's `checkpoint(function, *args)` (reentrant: an autograd Function whose backward reruns
`function` and back-propagates through the rerun) and `non_reentrant_checkpoint(function, *args)`
(saved-tensor hooks: the forward keeps a placeholder for every tensor autograd saves, and the first
one read in backward reruns `function` to fill them all).

Owns: running, recomputing and the random-state replay around both. Must not: decide how inputs are
kept (`saved_inputs.py`) or read the config (`settings.py` hands the options over).

Both keep the inputs as the settings say (whole, on the host, partitioned over the model-parallel
group), take a snapshot of the host and device generators and of the RNG tracker before running
`function`, and replay it for the recomputation, so dropout draws the same masks twice. Outputs follow
DeepSpeed: one output alone (a tensor, or a sequence of one element: that element), several as a
tuple of everything `function` returned; non-floating-point tensor outputs are not differentiable.

Note (recomputation under ZeRO-3): the recomputed forward runs inside the engine's backward. The
stage-3 coordinator knows that a forward hook firing between `backward_start` and `backward_end` is a
recomputation: it gathers the parameters the rerun needs without recording the rerun in the
prefetch trace (see `zero/stage3/coordinator.py`), for these functions and torch.utils.checkpoint alike.
"""

from __future__ import annotations

import time
import weakref
from typing import Any, Callable

import torch

from lightspeed._utils.accelerator import get_accelerator
from lightspeed._utils.logging import get_logger
from lightspeed.checkpointing.rng import RngSnapshot
from lightspeed.checkpointing.saved_inputs import SavedInputs
from lightspeed.checkpointing.settings import SETTINGS, CheckpointOptions

logger = get_logger(__name__)


class _Boundary:
    """`synchronize_checkpoint_boundary`: synchronize the device at the start and end of each
    checkpoint's forward and backward. `profile`: log their time (synchronized, so it is the device's)."""

    def __init__(self, options: CheckpointOptions, what: str):
        self.options, self.what, self.start = options, what, 0.0

    def __enter__(self):
        if self.options.synchronize_checkpoint_boundary or self.options.profile:
            get_accelerator().synchronize()
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.options.synchronize_checkpoint_boundary or self.options.profile:
            get_accelerator().synchronize()
        if self.options.profile and exc[0] is None:
            logger.info("activation checkpointing: %s %.3f ms", self.what, (time.perf_counter() - self.start) * 1e3)
        return False


def _keep_inputs(args: tuple) -> SavedInputs:
    options = SETTINGS.options
    contiguous = options.contiguous_memory_optimization
    return SavedInputs(args, partition=options.partition_activations, to_host=options.cpu_checkpointing,
                       mp=SETTINGS.model_parallel, contiguous=SETTINGS.contiguous if contiguous else None,
                       number_checkpoints=options.number_checkpoints)


def _check_backward_kind() -> None:
    if not torch.autograd._is_checkpoint_valid():
        raise RuntimeError("activation checkpointing: recomputation does not work under torch.autograd.grad(); "
                           "use .backward()")


def _as_sequence(outputs: Any) -> tuple:
    """`function`'s outputs as a tuple (a single tensor as a tuple of one)."""
    if torch.is_tensor(outputs):
        return (outputs,)
    if isinstance(outputs, (tuple, list)):
        return tuple(outputs)
    raise TypeError(f"activation checkpointing: the checkpointed function must return a tensor or a tuple/list "
                    f"(got {type(outputs).__name__})")


def _deepspeed_result(outputs: list | tuple) -> Any:
    """DeepSpeed's return convention: one output alone, several as a tuple."""
    return outputs[0] if len(outputs) == 1 else tuple(outputs)


class CheckpointFunction(torch.autograd.Function):
    """The reentrant checkpoint, with DeepSpeed's signature: `apply(run_function, all_outputs, *args)`
    returns the tensor outputs and appends every output of `run_function` (tensors and other objects,
    in order) to the list `all_outputs`."""

    @staticmethod
    def forward(ctx, run_function: Callable, all_outputs: list, *args):
        options = SETTINGS.options
        with _Boundary(options, "forward"):
            saved = _keep_inputs(args)
            ctx.run_function, ctx.saved, ctx.options = run_function, saved, options
            ctx.rng = RngSnapshot.take()
            with torch.no_grad():
                outputs = _as_sequence(run_function(*args))
            if options.contiguous_memory_optimization:
                # slots of shared buffers: their one version counter moves as later checkpoints fill
                # other slots, which autograd's saved-tensor check would take for an in-place change
                ctx.kept = saved.tensors
            else:
                ctx.save_for_backward(*saved.tensors)  # kept through autograd, so saved-tensor hooks see them
                ctx.kept = None
            saved.tensors = []
        all_outputs.extend(outputs)
        tensors = [o for o in outputs if torch.is_tensor(o)]
        ctx.mark_non_differentiable(*[t for t in tensors if not t.is_floating_point()])
        return tuple(tensors)

    @staticmethod
    def backward(ctx, *grads):
        _check_backward_kind()
        if ctx.saved is None:
            raise RuntimeError("activation checkpointing: a second backward through a checkpoint (retain_graph) "
                               "is not supported: the first one freed its inputs")
        options = ctx.options
        with _Boundary(options, "backward"):
            if options.contiguous_memory_optimization:
                SETTINGS.contiguous.clear()  # the next forward fills new buffers; these live on in the contexts
            inputs = ctx.saved.unpack(ctx.kept if ctx.kept is not None else ctx.saved_tensors)
            with ctx.rng.replayed(), torch.enable_grad():
                outputs = _as_sequence(ctx.run_function(*inputs))
            tensors = [o for o in outputs if torch.is_tensor(o)]
            pairs = [(o, g) for o, g in zip(tensors, grads) if o.requires_grad]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            ctx.saved = ctx.run_function = ctx.kept = None
        return (None, None, *(x.grad if torch.is_tensor(x) else None for x in inputs))


def checkpoint(function: Callable, *args) -> Any:
    """Run `function(*args)` without keeping its activations; backward reruns it (DeepSpeed's
    `deepspeed.checkpointing.checkpoint`, reentrant). Inputs are kept as `configure()` said."""
    all_outputs: list = []
    tensors = iter(CheckpointFunction.apply(function, all_outputs, *args))
    # the tensors apply returned are the ones autograd links to the checkpoint (an output that is one of the
    # inputs comes back as a new view, so all_outputs' own entry would not carry the gradient)
    return _deepspeed_result([next(tensors) if torch.is_tensor(o) else o for o in all_outputs])


class _Placeholder:
    """What autograd holds instead of a saved tensor until the recomputation fills it in."""


def non_reentrant_checkpoint(function: Callable, *args) -> Any:
    """`checkpoint` through saved-tensor hooks (DeepSpeed's `non_reentrant_checkpoint`): gradients
    reach parameters even when no input requires grad, and `torch.autograd.grad` works."""
    options = SETTINGS.options
    with _Boundary(options, "forward"):
        saved = _keep_inputs(args)
        rng = RngSnapshot.take()
        placeholders: list[weakref.ref] = []
        recomputed: "weakref.WeakKeyDictionary[_Placeholder, torch.Tensor]" = weakref.WeakKeyDictionary()
        pending = [saved]  # emptied by the recomputation

        def pack(_tensor: torch.Tensor) -> _Placeholder:
            holder = _Placeholder()
            placeholders.append(weakref.ref(holder))
            return holder

        def recompute() -> None:
            if options.contiguous_memory_optimization:
                SETTINGS.contiguous.clear()  # as the reentrant backward: the next forward fills new buffers
            kept = pending.pop()
            inputs = kept.unpack(kept.tensors)
            order = iter(placeholders)

            def replay_pack(tensor: torch.Tensor) -> None:
                ref = next(order, None)
                if ref is None:
                    raise RuntimeError("non_reentrant_checkpoint: the recomputation saved more tensors than the "
                                       "forward did; the checkpointed function must run the same operations twice")
                holder = ref()
                if holder is not None:  # still needed by the graph
                    recomputed[holder] = tensor.detach()

            def replay_unpack(_none) -> torch.Tensor:
                raise RuntimeError("non_reentrant_checkpoint: the recomputed graph is not differentiated")

            with _Boundary(options, "recompute"), rng.replayed(), torch.enable_grad(), \
                    torch.autograd.graph.saved_tensors_hooks(replay_pack, replay_unpack):
                function(*inputs)

        def unpack(holder: _Placeholder) -> torch.Tensor:
            if pending:
                recompute()
            if holder not in recomputed:
                raise RuntimeError("non_reentrant_checkpoint: a saved tensor was read after its checkpoint was "
                                   "already recomputed and freed (a second backward through the same graph?)")
            return recomputed[holder]

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            outputs = _as_sequence(function(*args))
    return _deepspeed_result(outputs)
