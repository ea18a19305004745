"""The pipeline schedule driver: one batch of micro-batches through `torch.distributed.pipelining`'s
schedules, with the ZeRO strategy told where each backward begins and ends.

Owns: the schedule names of lightspeed's `pipeline.schedule` config key and the torch classes behind
them, the `PipelineStage` subclass that brackets each backward for the strategy, the loss wrapper
(the micro-batch's labels, the accumulation and loss-scale factors, the recorded losses) and the
`PipelineDriver` that runs a batch. Must not: step the optimizer or reduce gradients (the engine and
its strategy do).

Note: [micro-batches by index] torch's schedules split one whole batch into micro-batches along
dim 0. DeepSpeed's `train_batch` instead pulls each micro-batch from an iterator, and a micro-batch
may be any structure of tensors. So the driver hands the schedule the micro-batch indices (an
arange) as the first stage's input and as the loss target; the first stage's chunk looks its inputs
up by index, the loss wrapper its labels. The micro-batches are used as given, bit for bit.

Note: [shapes] A stage must know the shapes of what it receives and sends before the first batch.
torch infers them in its own first step, by a forward on whatever its version makes up (empty
tensors, meta tensors) and a loss on the result; that runs the strategy's hooks and the loss on
made-up values. The driver instead runs the first micro-batch once through every stage, without
gradients, sending the real activations on, and hands each stage its input and output examples
(torch's static metadata), so no stage infers anything.

Note: [backward brackets] A ZeRO strategy accumulates each gradient as autograd writes it (post-
accumulate-grad hooks) and reduces at the accumulation boundary. The driver brackets every
backward that writes parameter gradients with `backward_start` / `backward_end`: a full backward,
or the weight half of a zero-bubble schedule's split backward. At stages 0 and 1 every micro-batch's
backward accumulates locally and one empty boundary backward after the schedule reduces everything
(with several stages per rank no single micro-batch backward is the last for all of them). At stages 2
and 3, which reduce every micro-step, the last gradient-writing backward is the boundary. torch's
split weight backward (`stage_backward_weight`) assigns `param.grad` itself rather than through
autograd's accumulation, so the strategy's hooks do not run: the stage runs them for each parameter
holding a gradient afterwards, as autograd would have.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from lightspeed.comm.pipelining import BracketedStage, as_tuple, example_of, recv_tensors, schedule_class, send_tensors
from lightspeed.parallel.pipeline.module import PipelineModule


@dataclass(frozen=True)
class ScheduleKind:
    name: str
    torch_class: str
    multi: bool  # several stages per rank
    order: str  # "loop" or "v" (module.py's Note on stages)
    split_backward: bool  # input and weight gradients computed apart


SCHEDULES = {
    "1f1b": ScheduleKind("1f1b", "Schedule1F1B", False, "loop", False),
    "gpipe": ScheduleKind("gpipe", "ScheduleGPipe", False, "loop", False),
    "interleaved_1f1b": ScheduleKind("interleaved_1f1b", "ScheduleInterleaved1F1B", True, "loop", False),
    "interleaved_zero_bubble": ScheduleKind("interleaved_zero_bubble", "ScheduleInterleavedZeroBubble", True, "loop",
                                            True),
    "zbv_zero_bubble": ScheduleKind("zbv_zero_bubble", "ScheduleZBVZeroBubble", True, "v", True),
}


def schedule_kind(name: str) -> ScheduleKind:
    kind = SCHEDULES.get(str(name).lower())
    if kind is None:
        raise ValueError(f"pipeline.schedule: {name!r} is not a schedule (expected one of {', '.join(SCHEDULES)})")
    return kind


class PipelineDriver:
    """Runs batches of `n_microbatches` through `module`'s local stages with the schedule `kind`.

    `backward_start(is_boundary)` / `backward_end()` are the strategy's; `reduces_every_step`: the
    strategy reduces at every micro-step (ZeRO 2-3), see the Note on brackets."""

    def __init__(self, module: PipelineModule, kind: ScheduleKind, group, pp_size: int, device: torch.device,
                 backward_start: Callable[[bool], None], backward_end: Callable[[], None], reduces_every_step: bool,
                 global_rank_of: Callable[[int], int]):
        self.module, self.kind, self.group, self.pp_size, self.device = module, kind, group, pp_size, device
        self._global_rank_of = global_rank_of  # pipeline rank -> global rank
        self._backward_start, self._backward_end = backward_start, backward_end
        self._every_step = reduces_every_step
        self.num_stages = pp_size * module.virtual_stages
        self._schedules: dict[tuple[int, bool], object] = {}
        self._stages: dict[tuple[int, bool], list[BracketedStage]] = {}
        self._labels: list = []
        self._loss: Callable | None = None
        self._losses: dict[int, torch.Tensor] = {}
        self._examples: dict[int, tuple] | None = None  # stage -> (input example, output example)
        self._grad_calls = self._grad_total = 0

    @property
    def losses(self) -> list[torch.Tensor]:
        """The unscaled loss of each micro-batch of the last batch (on the rank holding the last stage)."""
        return [self._losses[i] for i in sorted(self._losses)]

    def _owner(self, stage: int) -> int:
        """The pipeline rank holding `stage` (module.py's Note on stages)."""
        p = self.pp_size
        if self.kind.order == "v":
            return stage if stage < p else 2 * p - 1 - stage
        return stage % p

    def _probe(self, first_inputs) -> dict[int, tuple]:
        """Every local stage's input and output examples, from the first micro-batch (the Note on shapes)."""
        mine = {c.stage: c for c in self.module.chunks}
        examples, carried = {}, None
        # forked RNG: a probe through dropout draws no numbers the first training step would have drawn
        with torch.no_grad(), torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            for stage in range(self.num_stages):
                if stage not in mine:
                    continue
                chunk = mine[stage]
                if stage == 0:
                    x = (torch.zeros(1, dtype=torch.int64, device=self.device),)
                    chunk.inputs = [first_inputs]
                elif stage - 1 in mine:
                    x = carried
                else:
                    x = tuple(example_of(t) for t in recv_tensors(self._global_rank_of(self._owner(stage - 1)),
                                                                  self.device))
                try:
                    y = as_tuple(chunk(*x))
                finally:
                    chunk.inputs = None
                examples[stage] = (x, tuple(example_of(t) for t in y))
                carried = examples[stage][1]
                if stage + 1 < self.num_stages and stage + 1 not in mine:
                    send_tensors(y, self._global_rank_of(self._owner(stage + 1)))
        return examples

    @property
    def holds_first(self) -> bool:
        return any(c.stage == 0 for c in self.module.chunks)

    @property
    def holds_last(self) -> bool:
        return any(c.stage == self.num_stages - 1 for c in self.module.chunks)

    # ------------------------------------------------------------------ backward brackets
    def backward_begin(self) -> None:
        self._grad_calls += 1
        self._backward_start(self._every_step and self._grad_calls == self._grad_total)

    def backward_done(self) -> None:
        self._backward_end()

    # ------------------------------------------------------------------ the loss
    def _loss_of(self, output, index: torch.Tensor) -> torch.Tensor:
        if self._loss is None:
            return torch.zeros((), device=self.device)
        labels = self._labels[int(index.reshape(-1)[0])]
        loss_fn = self.module.loss_fn
        loss = output if loss_fn is None else loss_fn(output, labels)
        if not torch.is_tensor(loss) or loss.numel() != 1:
            raise ValueError("the pipeline's loss (loss_fn(outputs, labels), or the last layer's output without "
                             "a loss_fn) must be a scalar tensor")
        self._losses[int(index.reshape(-1)[0])] = loss.detach().float().reshape(())
        return self._loss(loss)

    def reset_shapes(self) -> None:
        """Forget the probed stage examples and the schedules built on them: the next batch probes its
        first micro-batch again (activations of another shape). Every pipeline rank calls it together."""
        self._examples = None
        self._schedules.clear()
        self._stages.clear()

    # ------------------------------------------------------------------ schedules
    def _schedule(self, n: int, train: bool):
        key = (n, train)
        if key not in self._schedules:
            stages = [BracketedStage(chunk, chunk.stage, self.num_stages, self.device, self.group, self,
                                     *self._examples[chunk.stage]) for chunk in self.module.chunks]
            cls = schedule_class(self.kind.torch_class, self.group)
            target = stages if self.kind.multi else stages[0]
            self._schedules[key] = cls(target, n, loss_fn=self._loss_of, scale_grads=False)
            self._stages[key] = stages
        return self._schedules[key]

    def run(self, inputs: list | None, labels: list | None, *, train: bool,
            scale_loss: Callable[[torch.Tensor], torch.Tensor] | None, n_microbatches: int):
        """One batch: `inputs` (first stage) and `labels` (last stage) are the micro-batches, None where
        this rank holds neither stage. Returns the last stage's merged outputs when not `train` (None
        elsewhere and in training); the micro-batch losses are in `losses` on the rank holding the last
        stage."""
        self._losses = {}
        if self._examples is None:
            self._examples = self._probe(inputs[0] if inputs else None)
        self._labels = labels if labels is not None else []
        self._loss = scale_loss if (train or labels is not None) else None
        schedule = self._schedule(n_microbatches, train)
        first = self.module.chunks[0] if self.holds_first else None
        for chunk in self.module.chunks:
            chunk.inputs = inputs if chunk.stage == 0 else None
        index = torch.arange(n_microbatches, device=self.device)
        args = (index,) if first is not None else ()
        kwargs = {"target": index} if self.holds_last else {}
        self._grad_calls, self._grad_total = 0, n_microbatches * len(self.module.chunks)
        try:
            if train:  # no outputs kept: the schedule would hold every micro-batch's and concatenate them
                out = schedule.step(*args, return_outputs=False, **kwargs)
            else:
                out = schedule.eval(*args, **kwargs)
        finally:
            for chunk in self.module.chunks:
                chunk.inputs = None
            self._labels = []
        if train and not self._every_step:  # the one boundary reduction (the Note on brackets)
            self._backward_start(True)
            self._backward_end()
        return out
