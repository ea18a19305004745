"""How gradients are averaged across data-parallel ranks: DeepSpeed's prescale / predivide rules,
and the in-flight reductions the strategies wait on. Shared by every stage.

DeepSpeed: with `prescale_gradients`, divide by the world size before the sum; otherwise divide by
`gradient_predivide_factor` before and multiply by `predivide / world_size` after (skipped when
they are equal). Either way the result is the mean over ranks. With ``gradient_allreduce_op``
"sum" (`average` False) neither factor is applied: the result is the sum over ranks, whatever
prescale_gradients and gradient_predivide_factor say (DeepSpeed's allreduce_bucket, which tests
`gradient_average` before them).

Note: [sequence parallelism: what the mean is over] With Ulysses sequence parallelism (sp > 1) the
reduce group is dp x sp (an expert's: edp x sp), and each sp rank's gradient is its share of its
sequence's gradient. DeepSpeed 0.19.8 sums those shares and averages over the data-parallel ranks
only at stages 0-2 (engine.py's `_reduce_non_expert_gradients`, stage_1_and_2.py's
`gradient_reduction_w_predivide` and `average_tensor` divide by `world / sequence_parallel_size`;
the expert slices of `average_tensor` likewise), while its stage 3 (`reduce_scatter_coalesced`, the
default reduce-scatter path) divides by the whole partition group: it averages over sp too.
`sp_summed` is that rule, the one place it is written: the strategies of stages 0-2 take it through
`ReduceOptions.sp_summed`, stage 3 averages over its whole group, and the engine records it for
`sequence/loss.py` (comm/sequence_groups.py's `record_sp_gradient_mean`), whose loss backpropagates
each rank's own share (times sp where the engine averages over sp), transformers'
`deepspeed_sp_compute_loss` rule. Prescale / predivide keep their meaning with the divisor
`world / sp_summed` (DeepSpeed: predivide, then multiply by predivide / (world / sp)). Expert
gradients (group edp x sp) take the same rule, as `average_tensor`'s expert slices do. Two corners of
DeepSpeed are not copied: its stage-0 `_reduce_expert_gradients` divides by the whole world under a
sequence-parallel mpu (its `_get_data_parallel_group()` is then the world group), which would leave
experts 1/sp of the dense parameters' scale; and `gradient_reduction_w_predivide` skips the
multiplication when the predivide factor equals the whole dp x sp size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def sp_summed(stage: int, sp_size: int) -> int:
    """How many ranks of a reduce group that holds `sp_size` sequence-parallel ranks have their gradients
    summed rather than averaged, at ZeRO `stage` (see the Note): all sp at stages 0-2, none at 3."""
    return sp_size if stage < 3 else 1


def mean_ranks(world_size: int, summed: int = 1) -> int:
    """The number a gradient summed over `world_size` ranks is divided by when `summed` of them (the sp
    ranks, `sp_summed`) are summed and the rest averaged."""
    if summed < 1 or world_size % summed:
        raise ValueError(f"sequence_parallel_size={summed} does not divide the reduce group of {world_size} ranks")
    return world_size // summed


def mean_scaling(prescale: bool, predivide: float, world_size: int) -> tuple[float, float]:
    """DeepSpeed's averaging over `world_size` ranks (`mean_ranks`' result where sp ranks are summed):
    (factor before the sum, factor after it)."""
    if prescale:
        return (1.0 / world_size if world_size > 1 else 1.0), 1.0
    return 1.0 / predivide, (predivide / world_size if predivide != world_size else 1.0)


@dataclass(frozen=True)
class ReduceOptions:
    """How gradients are averaged across data-parallel ranks (DeepSpeed's semantics)."""

    bucket_numel: int = 500_000_000
    prescale_gradients: bool = False
    gradient_predivide_factor: float = 1.0
    reduce_dtype: torch.dtype | None = None  # communication_data_type; None = the gradient dtype
    overlap_comm: bool = True  # False: each sharded-stage reduction is waited on as soon as it starts
    allgather_bucket_numel: int = 500_000_000
    average: bool = True  # gradient_allreduce_op "mean"; False ("sum"): no factor before or after
    sp_summed: int = 1  # ranks of each reduce group summed, not averaged: `sp_summed(stage, sp)` (the Note)

    def mean_ranks(self, world_size: int) -> int:
        """What a gradient summed over a reduce group of `world_size` ranks is divided by ("mean")."""
        return mean_ranks(world_size, self.sp_summed)

    def scaling(self, world_size: int) -> tuple[float, float]:
        """(factor before the sum, factor after it)."""
        if not self.average:
            return 1.0, 1.0
        return mean_scaling(self.prescale_gradients, self.gradient_predivide_factor, self.mean_ranks(world_size))

    def prepare(self, grad: torch.Tensor, world_size: int) -> tuple[torch.Tensor, float]:
        """The buffer to send (cast to the reduce dtype, pre-scaled) and the factor to apply after."""
        dtype = self.reduce_dtype or grad.dtype
        buf = grad if dtype == grad.dtype else grad.to(dtype)
        pre, post = self.scaling(world_size)
        if pre != 1.0:
            buf.mul_(pre)
        return buf, post


class PendingToHost:
    """Optimizer offload: finish a reduction on the copy stream `stream` (which waits for the
    collective; the compute stream does not), then copy its destination `dev` into the host buffer
    `host` there, asynchronously from pinned memory. On CPU the stream is inline: the same steps run
    in order."""

    def __init__(self, inner: "PendingReduce", dev: torch.Tensor, host: torch.Tensor, stream):
        self.inner, self.dev, self.host, self.stream = inner, dev, host, stream
        self.done = False

    def wait(self) -> None:
        if self.done:
            return
        self.done = True
        self.stream.wait_current()
        self.stream.record(self.inner.result)
        with self.stream.context():
            self.inner.wait()
            self.host.copy_(self.dev, non_blocking=True)


class PendingReduce:
    """An in-flight reduction. `wait()` finishes it: scales the result by `post_scale`, then copies it
    into `dest` (or adds it, when `accumulate`), unless the result already is `dest`."""

    def __init__(self, handle, result: torch.Tensor, dest: torch.Tensor, post_scale: float, accumulate: bool = False):
        self.handle, self.result, self.dest, self.post_scale, self.accumulate = handle, result, dest, post_scale, accumulate

    def wait(self) -> None:
        if self.handle is None:  # already finished
            return
        self.handle.wait()
        self.handle = None
        if self.post_scale != 1.0:
            self.result.mul_(self.post_scale)
        if self.accumulate:
            self.dest.add_(self.result)
        elif self.result is not self.dest:
            self.dest.copy_(self.result)
