"""The speculative offloaded step (``offload_optimizer.super_offload``): the CPU optimizer steps each
range during backward as its gradients reach host memory (as the early step does) even when the step
clips or scales the gradients, and the step-wide verdicts are applied after the fact.

During backward the only known factor is the unscale coefficient ``1 / loss_scale`` (the loss scale
the backward ran with); the clip coefficient and the inf/nan verdict need every gradient. So each range
is stepped with the unscale coefficient alone, after its pre-step values (master, optimizer state) are
kept here. At the step (zero/step_runner.py): when the global norm is within the clip and no gradient
overflowed, the speculative update is exactly the synchronous one (the synchronous coefficient is then
the same fp32 number: the clip factor is ``min(1, ...)`` = 1.0); otherwise everything stepped is
restored, the step count taken back, and the step redone with the real coefficient (clipping) or
skipped (overflow), the parameters rewritten from the restored masters.

Without clipping, loss scaling or an overflow check the early step is exact (offload/early_step.py)
and runs without copies; the speculative one takes over from the step after one that clipped or
scaled (the first step is speculative: nothing is known yet).

Owns: the pre-step copies (one buffer per optimizer tensor and state, kept across steps), which ranges
were stepped, the restore, and the rollback count. Must not: decide whether to roll back (the step
runner compares the coefficients) or step anything.

Note (exact, not inverse): DeepSpeed's SuperOffload undoes an Adam step algebraically, which loses bits;
here the bytes of each stepped range are copied before the kernel runs, so a rollback restores the
masters and moments bit for bit and the redone step is the synchronous step itself. The price is host
memory: one copy of the master and of each optimizer state of what is offloaded.
"""

from __future__ import annotations

import torch

from lightspeed.ops.lowp_writer import LowpWriter


class Rollback:
    """Pre-step copies of the ranges a speculative step stepped (`save`), and their `restore`."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self._copies: dict[int, list[torch.Tensor]] = {}  # id(param) -> [param copy, state copies...]
        self._ranges: list[tuple[torch.Tensor, int, int]] = []
        self.params: list[torch.Tensor] = []  # the optimizer tensors counted one step by this step
        self.coef: float | None = None  # the coefficient the ranges were stepped with (None: 1)
        self.rollbacks = 0

    def begin(self, params: list[torch.Tensor], coef: float | None) -> None:
        self.params, self.coef, self._ranges = list(params), coef, []

    def _live(self, p: torch.Tensor) -> list[torch.Tensor]:
        state = self.optimizer.state[p]
        return [p.view(-1)] + [state[k].view(-1) for k in getattr(self.optimizer, "_state_keys", ())]

    def save(self, p: torch.Tensor, start: int, end: int) -> None:
        """Copy `p[start:end]` and its state's range before they are stepped (the worker thread)."""
        live = self._live(p)
        copies = self._copies.get(id(p))
        if copies is None or len(copies) != len(live) or any(c.dtype != t.dtype for c, t in zip(copies, live)):
            copies = self._copies[id(p)] = [torch.empty_like(t) for t in live]
        for c, t in zip(copies, live):
            c[start:end].copy_(t[start:end])
        self._ranges.append((p, start, end))

    def restore(self, lowp_out: dict[torch.Tensor, list[tuple[int, torch.Tensor]]] | None = None) -> None:
        """Put back every saved range, take back the step count of `params`, and (with `lowp_out`)
        write the restored masters into their low-precision copies."""
        writer = LowpWriter() if lowp_out else None
        with torch.no_grad():
            for p, start, end in self._ranges:
                for c, t in zip(self._copies[id(p)], self._live(p)):
                    t[start:end].copy_(c[start:end])
                if writer is not None and lowp_out.get(p):
                    writer.write(p, start, end, lowp_out[p])
            if writer is not None:
                writer.finish()
        for p in self.params:
            state = self.optimizer.state.get(p)
            if state and "step" in state:
                state["step"] -= 1
        self._ranges = []
        self.rollbacks += 1
