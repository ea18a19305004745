"""How gradients are averaged across data-parallel ranks: DeepSpeed's prescale / predivide rules,
and the in-flight reductions the strategies wait on. Shared by every stage.

DeepSpeed: with `prescale_gradients`, divide by the world size before the sum; otherwise divide by
`gradient_predivide_factor` before and multiply by `predivide / world_size` after (skipped when
they are equal). Either way the result is the mean over ranks. With ``gradient_allreduce_op``
"sum" (`average` False) neither factor is applied: the result is the sum over ranks, whatever
prescale_gradients and gradient_predivide_factor say (DeepSpeed's allreduce_bucket, which tests
`gradient_average` before them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def mean_scaling(prescale: bool, predivide: float, world_size: int) -> tuple[float, float]:
    """DeepSpeed's averaging over `world_size` ranks: (factor before the sum, factor after it)."""
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

    def scaling(self, world_size: int) -> tuple[float, float]:
        """(factor before the sum, factor after it)."""
        if not self.average:
            return 1.0, 1.0
        return mean_scaling(self.prescale_gradients, self.gradient_predivide_factor, world_size)

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
