"""The speculative offloaded step (``offload_optimizer.super_offload``): the CPU optimizer steps each
range during backward as its gradients reach host memory (as the early step does) even when the step
clips or scales the gradients, and the step-wide verdicts are applied after the fact.

During backward the only known factor is the unscale coefficient ``1 / loss_scale`` (the loss scale
the backward ran with); the clip coefficient and the inf/nan verdict need every gradient. So each range
is stepped with the unscale coefficient alone. At the step (zero/step_runner.py): when the global norm
is within the clip and no gradient overflowed, the speculative update is exactly the synchronous one
(the synchronous coefficient is then the same fp32 number: the clip factor is ``min(1, ...)`` = 1.0);
otherwise everything stepped is rolled back, the step count taken back, and the step redone with the
real coefficient (clipping) or skipped (overflow), the parameters rewritten from the rolled-back
masters.

Without clipping, loss scaling or an overflow check the early step is exact (offload/early_step.py)
and runs without rollback; the speculative one takes over from the step after one that clipped or
scaled (the first step is speculative: nothing is known yet).

Note (two rollbacks, ``offload_optimizer.super_offload_rollback``, lightspeed's own key):
- ``"inverse"`` (DeepSpeed SuperOffload's way; the default where the optimizer has an inverse): nothing
  is copied before a range steps; a rollback undoes each stepped range algebraically from the gradient
  the step read, which stays in its host buffer until the step, only read (ops/adam/cpu_adam.py's
  Note [the gradient is read, not written]; `CPUAdam.undo_zero_step_range`, ops/adam/inverse.py). Not
  bit-exact: each rolled-back value is within a few fp32 roundings of the stepped value it comes from,
  and the stepped moments hold the unclipped gradient: with the clip factor c the second moment's
  history comes back within about eps32 / c^2 of itself, the first moment's within eps32 / c, and the
  redone step lands that close to the synchronous one (tests/distributed/test_speculative_offload.py,
  INVERSE_TOL: 1e-5 of the masters, 2e-4 of the second moments at c ~ 0.05); a step kept is still
  bitwise the synchronous step. A range whose gradient is not
  finite (inf/nan, or a sum of squares past fp32's range) is not stepped during backward, since no
  inverse could recover from it: the step then rolls back whatever was stepped and redoes or skips the
  whole step as the synchronous step would. Adam/AdamW with fp32 masters and state only.
- ``"copy"`` (bitwise): the bytes of each range (master and every optimizer state, 12 bytes per
  parameter for fp32 Adam) are copied before the kernel runs, so a rollback restores them bit for bit
  and the redone step is the synchronous step itself. The price is one copy of what is offloaded in
  host memory, and the copies' time every speculative step (on a 16-core H100 host, GPT 1.3B ZeRO-2,
  2026-12-05: 722.5 ms per speculative step against 466.8 ms for the plain offloaded one, about
  263 ms of it the copies). Any CPU optimizer of the ZeRO step (Lion, Adagrad: the default there).

Owns: the pre-step copies (copy mode: one buffer per optimizer tensor and state, kept across steps),
the finiteness check of each range (inverse mode), which ranges were stepped, the rollback, and the
rollback count. Must not: decide whether to roll back (the step runner compares the coefficients) or
step anything.
"""

from __future__ import annotations

import math

import torch

from lightspeed._utils.logging import get_logger
from lightspeed.ops.lowp_writer import LowpWriter

logger = get_logger(__name__)


#: the values of ``offload_optimizer.super_offload_rollback``
MODES = ("inverse", "copy")


def rollback_mode(optimizer: torch.optim.Optimizer, requested: str | None, grads=None) -> str:
    """The rollback the speculative step uses: `requested` (the config key; None: "inverse" where
    `optimizer` has an exact-enough inverse, else "copy"), checked against the optimizer."""
    unsupported = getattr(optimizer, "inverse_unsupported", None)
    reason = unsupported(grads) if unsupported is not None else f"{type(optimizer).__name__} has no inverse step"
    if requested is None:
        mode = "copy" if reason else "inverse"
        logger.info("offload_optimizer.super_offload: the %s rollback%s", mode, f" ({reason})" if reason else "")
        return mode
    if requested not in MODES:
        raise ValueError(f"zero_optimization.offload_optimizer.super_offload_rollback: must be one of {MODES}, "
                         f"got {requested!r}")
    if requested == "inverse" and reason:
        raise NotImplementedError(f'zero_optimization.offload_optimizer.super_offload_rollback "inverse": {reason}; '
                                  'use "copy"')
    return requested


class Rollback:
    """The ranges a speculative step stepped (`save`, called before each one steps; False: do not step
    it now) and their `restore` (copy mode) or inversion (inverse mode): the module's Note."""

    def __init__(self, optimizer: torch.optim.Optimizer, mode: str = "copy"):
        if mode not in MODES:
            raise ValueError(f"zero_optimization.offload_optimizer.super_offload_rollback: must be one of {MODES}")
        self.optimizer = optimizer
        self.mode = mode
        self._copies: dict[int, list[torch.Tensor]] = {}  # id(param) -> [param copy, state copies...]
        self._ranges: list[tuple[torch.Tensor, int, int]] = []
        self.params: list[torch.Tensor] = []  # the optimizer tensors counted one step by this step
        self.coef: float | None = None  # the coefficient the ranges were stepped with (None: 1)
        self._coef_t: torch.Tensor | None = None  # the same, as the optimizer was handed it
        self._grads: dict = {}  # inverse mode: optimizer tensor -> the gradient its step reads
        self.deferred = False  # inverse mode: a range was left unstepped (its gradient is not finite)
        self.held_back = 0  # inverse mode: ranges left unstepped so far (for tests and the log)
        self.rollbacks = 0

    def begin(self, params: list[torch.Tensor], coef: torch.Tensor | None, grads: dict | None = None) -> None:
        """A speculative step starts: `params` counted one step, stepped with `coef` (a 0-dim fp32
        tensor; None: none) from `grads` (optimizer tensor -> gradient; inverse mode)."""
        self.params, self._ranges, self.deferred = list(params), [], False
        self._coef_t = coef
        self.coef = None if coef is None else float(coef)
        self._grads = dict(grads or {})

    def _live(self, p: torch.Tensor) -> list[torch.Tensor]:
        state = self.optimizer.state[p]
        return [p.view(-1)] + [state[k].view(-1) for k in getattr(self.optimizer, "_state_keys", ())]

    def save(self, p: torch.Tensor, start: int, end: int) -> bool:
        """Before `p[start:end]` steps (the worker thread): copy it and its state's range (copy mode),
        or check that its gradient is finite (inverse mode). False: leave the range unstepped."""
        if self.mode == "inverse":
            g = self._grads[p].view(-1)[start:end]
            if not math.isfinite(float(torch.dot(g, g))):
                self.deferred = True
                self.held_back += 1
                return False
            self._ranges.append((p, start, end))
            return True
        live = self._live(p)
        copies = self._copies.get(id(p))
        if copies is None or len(copies) != len(live) or any(c.dtype != t.dtype for c, t in zip(copies, live)):
            copies = self._copies[id(p)] = [torch.empty_like(t) for t in live]
        for c, t in zip(copies, live):
            c[start:end].copy_(t[start:end])
        self._ranges.append((p, start, end))
        return True

    def restore(self, lowp_out: dict[torch.Tensor, list[tuple[int, torch.Tensor]]] | None = None) -> None:
        """Roll back every stepped range (copy mode: put back its copies; inverse mode: undo its step),
        take back the step count of `params`, and (with `lowp_out`) write the rolled-back masters into
        their low-precision copies."""
        writer = LowpWriter() if lowp_out else None
        with torch.no_grad():
            for p, start, end in self._ranges:
                if self.mode == "inverse":
                    self.optimizer.undo_zero_step_range(p, start, end, self._grads[p], self._coef_t)
                else:
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
        self._ranges, self._grads, self.deferred = [], {}, False
        self.rollbacks += 1
