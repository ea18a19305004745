"""How a sharded strategy runs its step with the optimizer on the device, in host memory, on NVMe, or
one step behind (``offload_optimizer.overlap_step``): one object every ZeRO stage above 0 drives.

Owns: the choice among the plain step (`sharded_step`), the swapped step (each NVMe sub-group read,
stepped, written back and swapped out in turn: `offload/swapped_step.py`), the overlapped step
(the optimizer step on a background thread: `offload/overlap.py`) and the early step (each range
stepped during backward as its gradients reach the host: `offload/early_step.py`), the speculative
step (the early step whatever the step clips or scales, rolled back when it does, by inverting the
step or restoring copies: `offload/speculative.py`, `offload_optimizer.super_offload`), or ZenFlow's
step, handed over whole (`zero/zenflow.py`); the state those carry across
calls (the side stream of the early device-to-host gradient copies and whether this step's copies
were issued, the update not yet written into the parameters); and `flush`, which every reader of the
parameters or masters calls first. Must not: know a stage or how parameters are laid out: the
strategy hands `write_back` (all stepped shards into the low-precision parameters) and
`write_sub_group(i)` (one swapped sub-group's shard), and reduces the gradients before `step`.
"""

from __future__ import annotations

from typing import Callable

import torch

from lightspeed._utils.device import Stream
from lightspeed.comm.codecs import AllReduce
from lightspeed.offload.early_step import EarlyStep
from lightspeed.offload.overlap import BackgroundStep, optimizer_snapshot
from lightspeed.offload.speculative import Rollback, rollback_mode
from lightspeed.offload.swapped_step import SwappedOptimizerState
from lightspeed.zero.sharded_step import ShardViews, StepResult, apply_step, prepare_step, sharded_step


class StepRunner:
    """Runs `views`' step for one strategy; `agree` is the all-reduce over the group whose shards differ.

    `to_host` is the stream of the early gradient copies to host memory (optimizer offload without
    `overlap_step`), `swap` the NVMe-swapped optimizer state, `overlap` the one-step-delayed update.
    `write_back()` writes every stepped master into the parameters; `write_sub_group(i)` writes the
    i-th swapped sub-group's; `after_swapped()` runs once a swapped step has written them all.
    `copied_early` are the host `master_grads` entries the strategy fills through `to_host`;
    `early_ranges`: the strategy reports each range it copies there (`host_copy_queued`), so the early
    step can run. `overlap_warmup`: with `overlap`, the first applied steps run synchronously.
    `speculative`: `offload_optimizer.super_offload`; `rollback` its `super_offload_rollback` ("inverse",
    "copy", None: inverse where the optimizer has one)."""

    def __init__(self, views: ShardViews, agree: AllReduce | None, *, write_back: Callable[[], None],
                 to_host: Stream | None = None, swap: SwappedOptimizerState | None = None, overlap: bool = False,
                 write_sub_group: Callable[[int], None] | None = None, after_swapped: Callable[[], None] | None = None,
                 copied_early: list[torch.Tensor] = (), early_ranges: bool = False, overlap_warmup: int = 0,
                 speculative: bool = False, rollback: str | None = None, zenflow=None):
        self.views = views
        self.agree = agree
        self.zenflow = zenflow  # zero/zenflow.py's ZenFlowStep: it runs every step itself
        self.to_host = to_host
        self.swap = swap
        self._write_back = write_back
        self._write_sub_group = write_sub_group
        self._after_swapped = after_swapped
        self._background = BackgroundStep() if overlap else None
        self._synchronous_left = overlap_warmup  # overlap: applied steps still to run synchronously
        self._writeback_pending = False  # overlap: an update is in the masters, not yet in the parameters
        self.host_filled = False  # this step's boundary copies to the host have been issued
        if to_host is not None:
            views.early_filled = frozenset(id(g) for g in copied_early)
        # the early step (offload/early_step.py): a CPU optimizer taking the ZeRO step by ranges, with
        # the gradients copied to the host early; exact only without clipping and loss scaling, which
        # the previous step's arguments tell (`_early_exact`; a config does not change between steps)
        self._early_possible = (early_ranges and to_host is not None and views.fused
                                and hasattr(views.optimizer, "begin_zero_step"))
        self._early_exact = False
        self._early: EarlyStep | None = None
        self._stepped = {id(t) for t in views.opt_grads}  # the optimizer's tensors (by id: no tensor ==)
        self.early_ranges = 0  # ranges stepped during backward so far (for tests and the log)
        # the speculative step (offload/speculative.py, `offload_optimizer.super_offload`): stepping during
        # backward whatever the step does to the gradients, rolled back and redone when it clips or skips
        self._rollback: Rollback | None = None
        self._spec_scale: float | None = None  # the loss scale of the coming backward (`note_loss_scale`)
        if speculative:
            if not self._early_possible:
                raise ValueError("zero_optimization.offload_optimizer.super_offload: needs a CPU optimizer stepping "
                                 "host masters through the fused ZeRO step (offload_optimizer.device \"cpu\", the "
                                 "config's Adam/AdamW/Lion/Adagrad, no overlap_step)")
            self._rollback = Rollback(views.optimizer, rollback_mode(views.optimizer, rollback, views.opt_grads))

    @property
    def rollbacks(self) -> int:
        """Speculative steps restored and redone (clipping) or undone (overflow) so far."""
        return self._rollback.rollbacks if self._rollback is not None else 0

    def note_loss_scale(self, loss_scale: float | None) -> None:
        """The loss scale the coming backward's loss was multiplied by (the speculative step unscales
        with it during backward)."""
        self._spec_scale = loss_scale

    def backward_start(self, is_boundary: bool) -> None:
        """A backward begins: at the boundary the gradient copies to the host are issued as each
        reduction completes, and NVMe reads the first sub-group while backward runs."""
        self.host_filled = is_boundary and self.to_host is not None
        if is_boundary and self.swap is not None:
            self.swap.prefetch(0)
        if is_boundary and self._early_possible and self._early is None and (self._early_exact or self._rollback):
            # speculative only where the last step clipped or scaled: an exact early step needs no copies
            speculative = self._rollback is not None and not self._early_exact
            coef = None
            if speculative and self._spec_scale is not None:
                # the synchronous step's coefficient when nothing clips: fp32 1/scale (zero/grad_clip.py)
                coef = torch.full((), 1.0 / self._spec_scale, dtype=torch.float32)
            params = self.views.optimizer.begin_zero_step(self.views.opt_grads, coef, self.views.lowp_out)
            saver = None
            if speculative:
                self._rollback.begin(params, coef, self.views.opt_grads)
                saver = self._rollback.save
            self._early = EarlyStep(self.views.optimizer, params, saver=saver)

    def host_copy_queued(self, master: torch.Tensor, start: int, end: int) -> None:
        """The strategy queued the copy of `master`'s gradient elements [start, end) to the host (at the
        boundary, on `to_host`): with the early step on, the CPU optimizer steps them once it lands."""
        if self._early is not None and id(master) in self._stepped:
            self._early.submit(self.to_host.record_event(), master, start, end)

    def step(self, loss_scale: float | None, max_norm: float, check_overflow: bool | None = None) -> StepResult:
        """One step over reduced gradients (the strategy waited for its reductions)."""
        self.views.master_grads_filled = self.host_filled
        if self.host_filled:
            self.host_filled = False
            self.to_host.make_current_wait()  # the device reads the reduced shards (overflow, norm)
            self.to_host.synchronize()  # the CPU optimizer reads the host copies
        check = check_overflow if check_overflow is not None else loss_scale is not None
        if self.zenflow is not None:
            return self.zenflow.step(loss_scale, max_norm, check)
        exact = loss_scale is None and max_norm <= 0 and not check
        self._early_exact = exact
        if self._early is not None:
            early, self._early = self._early, None
            early.finish()
            self.early_ranges += early.ranges
            if early.saver is not None:
                return self._settle(loss_scale, max_norm, check)
            if not exact:
                raise RuntimeError("the offloaded step ran during backward, but this step clips or scales the "
                                   "gradients (gradient_clipping / loss scaling changed between steps)")
            result, _ = prepare_step(self.views, None, 0.0, check_overflow=False, agree=self.agree)  # the norm
            self._write_back()
            return result
        if self._background is not None and self._synchronous_left <= 0:
            return self._overlapped(loss_scale, max_norm, check)
        if self.swap is not None:
            result, _ = prepare_step(self.views, loss_scale, max_norm, check_overflow=check, agree=self.agree)
            if result.applied and self.views.optimizer is not None:
                self.swap.step(self.views.opt_grads, self.views.optimizer, self._write_sub_group)
                if self._after_swapped is not None:
                    self._after_swapped()
            return result
        result = sharded_step(self.views, loss_scale, max_norm, check_overflow=check, agree=self.agree)
        if result.applied:
            self._write_back()
            self._synchronous_left -= 1
        return result

    def _settle(self, loss_scale: float | None, max_norm: float, check: bool) -> StepResult:
        """The speculative step's verdict: keep it when the synchronous step would have used the same
        coefficient; otherwise roll back what was stepped and redo it (clipping, or a range held back
        for a non-finite gradient without an overflow check) or leave it undone (overflow), as the
        synchronous step would have."""
        result, coef = prepare_step(self.views, loss_scale, max_norm, check_overflow=check, agree=self.agree)
        rollback = self._rollback
        if not result.applied:
            rollback.restore(self.views.lowp_out)
            self._write_back()
            return result
        wanted = 1.0 if coef is None else float(coef)
        if wanted != (1.0 if rollback.coef is None else rollback.coef) or rollback.deferred:
            rollback.restore()
            apply_step(self.views, coef)  # writes the low-precision copies again
        self._write_back()
        return result

    def _overlapped(self, loss_scale: float | None, max_norm: float, check: bool) -> StepResult:
        """Write the previous step's update into the parameters, then start this step's optimizer step
        in the background (see `offload/overlap.py`)."""
        self.flush()
        result, coef = prepare_step(self.views, loss_scale, max_norm, check_overflow=check, agree=self.agree)
        if result.applied and self.views.optimizer is not None:
            snapshot = optimizer_snapshot(self.views.optimizer)
            self._background.launch(lambda: apply_step(self.views, coef, snapshot))
            self._writeback_pending = True
        return result

    def flush(self) -> None:
        """Finish an overlapped step still running and write its update into the parameters."""
        if self.zenflow is not None:
            self.zenflow.flush()
        if self._background is None:
            return
        self._background.wait()
        if self._writeback_pending:
            self._writeback_pending = False
            self._write_back()

    def merge_state(self, state: dict) -> dict:
        """The strategy's optimizer state dict with what lives outside the optimizer (ZenFlow's device
        moments of its selected elements)."""
        return self.zenflow.merge_state(state) if self.zenflow is not None else state

    def masters_replaced(self) -> None:
        """The master shards were written from outside (a load, or the parameters): ZenFlow drops its
        device values and selects again."""
        if self.zenflow is not None:
            self.zenflow.reset()

    def zero_grad(self) -> None:
        """Before the gradient shards are zeroed: a copy to the host still reading them finishes."""
        if self.to_host is not None:
            self.to_host.make_current_wait()
            self.host_filled = False

    def masters_in(self) -> None:
        """NVMe: bring every master shard and its optimizer state into host memory."""
        if self.swap is not None:
            self.swap.all_in()

    def masters_out(self) -> None:
        if self.swap is not None:
            self.swap.all_out()

    @property
    def swap_location(self) -> Callable[[torch.Tensor], str | None] | None:
        """Where a swapped tensor lives (for the memory breakdown), None without NVMe."""
        return self.swap.swapper.location if self.swap is not None else None
