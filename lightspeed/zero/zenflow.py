"""ZenFlow (``zero_optimization.zenflow``, ZeRO 1-3 with the optimizer in host memory): every step the
most important columns of each 2-D weight are updated on the device at once, with their own Adam
state there; the other elements' gradients are accumulated in host memory and stepped by the CPU
optimizer every `update_interval` steps, in the background with `overlap_step`.

Owns: the column importance (the L1 norm of each column's gradient over the whole weight, summed over
the ranks that hold parts of it), the selection and its device state (fp32 masters, moments and the
shard/parameter indices of the selected elements), the interval's gradient accumulator on the device
and the host buffers it is copied to for an update (two with `overlap_step`), the adaptive update
rule, the CPU update and the one in flight. Must not: reduce gradients, compute the step's norm or
overflow verdict (`zero/sharded_step.prepare_step` does), or all-gather parameters (the strategy's
`write_back`).

Note (the step, DeepSpeed's order): the CPU update steps every element of the shard with the
interval's accumulated (unscaled, averaged) gradient, clipped by that mean's norm, with the Adam step
count set to the number of steps taken (DeepSpeed's `step_id`); the selected elements' values it
produces are then replaced by the device's, which step with this step's gradient and its own
unscale/clip coefficient. At a selection the host masters take the device values of the previous
selection (exact: both are fp32; DeepSpeed copies the bf16 parameters back), the device moments are
zeroed and their step count goes on, as DeepSpeed's. Elements of parameters that are not 2-D are
always selected. Selection is per weight, not per shard (the column sums are all-reduced), so it does
not depend on the world size; DeepSpeed selects within each rank's part and drops columns cut by a
partition boundary.

Note (overlap_step): at an update the previous update is waited for and written into the parameters
(the host masters to the low-precision chunks, then the selected elements over them), and this
interval's update is launched on a thread over the other accumulator: the unselected elements lag one
interval behind (DeepSpeed runs it in a separate process; the bound on staleness is the same). Warm-up
updates run synchronously. Readers of the masters (`flush`) wait for it and take the device values of
the selected elements.

Note (accumulation): each step's reduced gradient is added, unscaled, to an fp32 accumulator on the
device (one per stepped shard, 4 bytes a parameter of this rank's shard, kept across the interval),
and only an update copies it to the host: one device-to-host copy per interval instead of one per
step, and no addition in host memory (at GPT 1.3B a per-step fp32 copy moved 5 GB over the bus and
15 GB through host memory, BENCHMARKS.md 2026-12-05). The strategy makes no host copy of the
gradient otherwise (`ShardViews.host_copies`); an update whose interval is this step alone copies
this step's gradient to the host instead of accumulating it. DeepSpeed, which treats
`update_interval` as accumulation steps, adds each step's gradient on the device to the interval's
sum brought back from host memory and copies the sum (bf16) back out every step.

Note (offload): with `zenflow.offload` the selected elements' moments live in host memory (page-locked
where the host masters are) and cross to the device for each device step and back after it, as
DeepSpeed's: 8 bytes of device memory less per selected element, 16 bytes over the bus per selected
element and step. The values of the selected elements stay on the device (fp32 here; DeepSpeed's
bf16 parameters).

Note (stage 3): the stage's shards come from zero/stage3/zenflow_shards.py: one per (parameter
group, optimizer group), on every rank, empty where the rank holds none of its elements (it only
joins the column sums). Parameters offloaded too (`offload_param`) are refused: the device step
writes the device's low-precision shard.

Note (checkpoints): a save holds one standard state: the host masters (with the device values of the
selected elements) and the host moments with the device moments at the selected elements, and step
count = steps taken. It loads into a run without ZenFlow; a ZenFlow run loading any checkpoint starts
a new interval and selects again at its next step.

Deviations from DeepSpeed: the selected columns keep fp32 masters and moments (DeepSpeed steps the
bf16 parameters with bf16 moments); both sides use the configured optimizer's Adam or AdamW (DeepSpeed's
device side is always AdamW); the unscale/clip coefficient applies to the device step (DeepSpeed leaves
it unclipped); the interval counts optimizer steps and keeps `gradient_accumulation_steps` (DeepSpeed
replaces the accumulation steps with `update_interval` and divides each loss by it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from lightspeed._utils.device import synchronize
from lightspeed._utils.logging import get_logger
from lightspeed._utils.pinned import page_locked_empty
from lightspeed.comm.codecs import AllReduce
from lightspeed.config.errors import ConfigError
from lightspeed.ops.adam import CPUAdam
from lightspeed.offload.overlap import BackgroundStep, optimizer_snapshot
from lightspeed.offload.zenflow_config import ZenFlowOptions
from lightspeed.ops.lowp_writer import LowpWriter
from lightspeed.zero.grad_clip import squared_norm
from lightspeed.zero.partition import Range
from lightspeed.zero.sharded_step import ShardViews, StepResult, prepare_step

logger = get_logger(__name__)


@dataclass
class ZenFlowShard:
    """One stepped master shard as ZenFlow sees it (built by the strategy)."""

    master: torch.Tensor  # host fp32 shard (the CPU optimizer's tensor); empty where this rank holds none of
    # the shard's parameters (stage 3): it then only joins the column sums' all-reduce
    master_grad: torch.Tensor  # host fp32 buffer: this step's reduced gradient, copied for an update of one step
    grad: torch.Tensor  # the device's reduced gradient shard
    lp_flat: torch.Tensor  # the device's low-precision flat buffer holding the shard's chunks
    chunks: list[tuple[Range, int]]  # (flat-buffer range, shard position) per bucket
    pieces: list[tuple[int, tuple[int, ...], int, int, int]]  # (param key, shape, start, end, shard position)
    all_reduce: AllReduce | None  # over the ranks holding the other parts of these parameters
    weights: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)  # (key, shape) of every parameter
    # of the flat buffer, on every rank (a rank may hold no piece of some: the column sums must agree)
    group: dict | None = None  # the optimizer param group stepping `master`
    # laid out once: each 2-D weight's place in the shard's vector of column sums
    cols: dict[int, tuple[int, int]] = field(default_factory=dict)  # 2-D param key -> (column offset, columns)
    ncols: int = 0


@dataclass
class _Selected:
    idx: torch.Tensor  # shard positions (device, int64, ascending)
    idx_host: torch.Tensor
    lp_idx: torch.Tensor  # positions in `lp_flat`
    master: torch.Tensor  # fp32 values (device)
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    columns: dict[int, torch.Tensor]  # 2-D param key -> selected columns


class ZenFlowStep:
    """The ZenFlow step over `shards`; `write_back()` all-gathers the written low-precision chunks."""

    def __init__(self, options: ZenFlowOptions, views: ShardViews, shards: list[ZenFlowShard],
                 agree: AllReduce | None, write_back: Callable[[], None]):
        if not isinstance(views.optimizer, CPUAdam):
            raise ConfigError("zero_optimization.zenflow: needs the Adam or AdamW optimizer (stepped by CPUAdam on "
                              f"the host and by Adam on the device; got {type(views.optimizer).__name__})")
        self.options, self.views, self.shards, self.agree = options, views, shards, agree
        self.optimizer = views.optimizer
        self._write_back = write_back
        for z in shards:
            offset = 0
            for key, shape in z.weights:
                if len(shape) == 2 and key not in z.cols:
                    z.cols[key] = (offset, shape[1])
                    offset += shape[1]
            z.ncols = offset
        self._steps_per_epoch = options.steps_per_epoch
        self._schedule = None
        self._m = 0  # steps taken (DeepSpeed's micro_step + 1)
        self._k = 0  # device steps taken
        self._sel: list[_Selected] | None = None
        self._reselect = False
        host = [z.master for z in shards]
        nacc = 2 if options.overlap_step else 1
        # the host copies of the interval's sum (Note: accumulation), page-locked as the host gradients are
        self._acc = [[page_locked_empty(t.numel(), torch.float32) if z.master_grad.is_pinned()
                      else torch.empty(t.numel(), dtype=torch.float32) for t, z in zip(host, shards)]
                     for _ in range(nacc)]
        self._cur = 0
        self._dacc = [torch.empty(z.grad.numel(), dtype=torch.float32, device=z.grad.device) for z in shards]
        self._count = 0  # steps accumulated in the current interval
        self._background = BackgroundStep() if options.overlap_step else None
        self._pending = False  # an overlapped update is in the masters, not yet in the parameters
        # the adaptive update (update_interval "auto")
        self._flag = False
        self._interval = 0
        self._critic: dict[tuple[int, int], list[float]] = {}  # (shard, key) -> [avg critic, non-critic]
        self._n2d = len({key for z in shards for key in z.cols})
        self.updates = 0  # CPU updates launched (for tests and the log)

    # ------------------------------------------------------------------ schedule
    def set_steps_per_epoch(self, n: int) -> None:
        if self._steps_per_epoch is None:
            self._steps_per_epoch = int(n)
            self._schedule = None

    @property
    def schedule(self):
        if self._schedule is None:
            self._schedule = self.options.schedule(self._steps_per_epoch)
        return self._schedule

    # ------------------------------------------------------------------ the step
    def step(self, loss_scale: float | None, max_norm: float, check: bool) -> StepResult:
        result, coef = prepare_step(self.views, loss_scale, max_norm, check_overflow=check, agree=self.agree)
        m, sch = self._m, self.schedule
        self._m += 1
        if not result.applied:
            return result
        selective = m >= sch.warm_up
        flagged, self._flag = self._flag, False
        update = sch.updates(m, flagged)
        background = self._background is not None and selective
        single = update and self._count == 0 and not background  # this step's gradient is the interval's
        if not single:
            self._accumulate(1.0 / loss_scale if loss_scale else 1.0)
        colsums = None
        if selective and (self._sel is None or self._reselect or sch.selects(m)):
            self.flush(gather=False)  # the host masters take the device values before the columns change
            colsums = self._column_sums()
            self._select(colsums)
        if selective and sch.update_interval == 0:
            self._adapt(colsums if colsums is not None else self._column_sums(), flagged)
        if update:
            self._update(m, max_norm, coef, single, background)
        if selective:
            self._device_step(coef)
        self._write_back()
        return result

    def _accumulate(self, inv_scale: float) -> None:
        """Add this step's reduced gradients (unscaled, in fp32) to the interval's sum on the device."""
        first = self._count == 0
        self._count += 1
        for z, a in zip(self.shards, self._dacc):
            if first:
                a.copy_(z.grad).mul_(inv_scale)
            else:
                a.add_(z.grad, alpha=inv_scale)

    def _to_host(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy each (device, host) pair's device tensor into its host buffer (cast on the device,
        asynchronously into page-locked memory), then wait for the copies."""
        down = False
        for dev, host in pairs:
            d = dev.device.type != "cpu"
            host.copy_(dev, non_blocking=d)
            down |= d
        if down:
            synchronize(self.views.device)

    def _interval_coef(self, max_norm: float) -> torch.Tensor:
        """1/steps of the interval, times the clip factor of the accumulated mean's global norm."""
        n = self._count
        coef = torch.full((), 1.0 / n, dtype=torch.float32)
        if max_norm > 0:
            sq = squared_norm(self._dacc).to(self.views.device)
            if self.agree is not None:
                self.agree(sq)
            norm = sq.cpu().sqrt() / n
            coef = coef * torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        return coef

    def _update(self, m: int, max_norm: float, coef: torch.Tensor | None, single: bool, background: bool) -> None:
        """The CPU update of step `m`: over this step's gradient alone with its coefficient `coef`
        (`single`), or over the interval's accumulated gradients."""
        stepped = [(z, a) for z, a in zip(self.shards, self._acc[self._cur]) if z.master.numel()]
        if single:
            self._to_host([(z.grad, z.master_grad) for z, _ in stepped])
            grads = {z.master: z.master_grad for z, _ in stepped}
        else:
            # the other host buffer may still be read by an update in flight
            self._to_host([(d, a) for z, a, d in zip(self.shards, self._acc[self._cur], self._dacc) if z.master.numel()])
            grads = {z.master: a for z, a in stepped}
            coef = self._interval_coef(max_norm)
        self._count = 0
        self.updates += 1
        self._drain(gather=False)  # the previous overlapped update reaches the parameters first
        for z, _ in stepped:  # DeepSpeed's step_id: the Adam step count is the number of steps taken
            self.optimizer._init_state(z.master)["step"] = m
        if background:
            snapshot = optimizer_snapshot(self.optimizer)
            self._background.launch(lambda: snapshot.step(grads=grads, grad_scale=coef, lowp_out={}))
            self._pending = True
            self._cur ^= 1
        else:
            self.optimizer.step(grads=grads, grad_scale=coef, lowp_out=self.views.lowp_out)

    # ------------------------------------------------------------------ selection
    def _column_sums(self) -> list[torch.Tensor]:
        """Per shard: the L1 norm of each 2-D weight's columns over this step's gradient, summed over
        the ranks holding parts of the weight."""
        out = []
        for z in self.shards:
            sums = torch.zeros(z.ncols, dtype=torch.float32, device=z.grad.device)
            for key, shape, start, end, pos in z.pieces:
                if key not in z.cols:
                    continue
                off, ncols = z.cols[key]
                g = z.grad[pos:pos + end - start].float().abs()
                col = sums[off:off + ncols]
                first_full = min(end, -(-start // ncols) * ncols)
                head = first_full - start
                if head:
                    c0 = start % ncols
                    col[c0:c0 + head] += g[:head]
                rows = (end - first_full) // ncols
                if rows:
                    col += g[head:head + rows * ncols].view(rows, ncols).sum(0)
                tail = end - first_full - rows * ncols
                if tail:
                    col[:tail] += g[g.numel() - tail:]
            if z.all_reduce is not None and sums.numel():
                z.all_reduce(sums)
            out.append(sums)
        return out

    def _select(self, colsums: list[torch.Tensor]) -> None:
        ratio = self.options.topk_ratio
        old = self._sel
        sel = []
        for i, (z, sums) in enumerate(zip(self.shards, colsums)):
            device = z.grad.device
            columns = {}
            for key, (off, ncols) in z.cols.items():
                k = int(ratio * ncols)
                top = torch.topk(sums[off:off + ncols], k).indices if k else sums.new_empty(0, dtype=torch.long)
                columns[key] = top.sort().values
            parts = []
            for key, shape, start, end, pos in z.pieces:
                if key in columns:
                    ncols = shape[1]
                    rows = torch.arange(start // ncols, (end - 1) // ncols + 1, device=device)
                    e = (rows[:, None] * ncols + columns[key][None, :]).reshape(-1)
                    e = e[(e >= start) & (e < end)]
                    parts.append(e - start + pos)
                else:
                    parts.append(torch.arange(pos, pos + end - start, device=device))
            idx = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long, device=device)
            starts = torch.tensor([p for _, p in z.chunks], device=device)
            shift = torch.tensor([r.start - p for r, p in z.chunks], device=device)
            lp_idx = idx + shift[torch.searchsorted(starts, idx, right=True) - 1] if idx.numel() else idx
            idx_host = idx.cpu()
            master = z.master.index_select(0, idx_host).to(device)
            if old is not None and old[i].exp_avg.numel() == idx.numel():
                exp_avg, exp_avg_sq = old[i].exp_avg.zero_(), old[i].exp_avg_sq.zero_()
            elif self.options.offload:  # host memory, page-locked where the host masters are (Note: offload)
                exp_avg, exp_avg_sq = (page_locked_empty(idx.numel(), torch.float32).zero_() if z.master.is_pinned()
                                       else torch.zeros(idx.numel(), dtype=torch.float32) for _ in range(2))
            else:
                exp_avg, exp_avg_sq = torch.zeros_like(master), torch.zeros_like(master)
            sel.append(_Selected(idx, idx_host, lp_idx, master, exp_avg, exp_avg_sq, columns))
        self._sel = sel
        self._reselect = False
        logger.debug("ZenFlow: %d elements selected for the device step", sum(s.idx.numel() for s in sel))

    def _adapt(self, colsums: list[torch.Tensor], flagged: bool) -> None:
        """DeepSpeed's adaptive update: after each step, count the 2-D weights whose unselected gradient
        mass since the last update reached their (scaled) average selected mass; the next step updates
        when at least `auto_ratio` of them did."""
        ratio = self.options.topk_ratio
        if flagged:  # this step updates: the counters start again
            self._interval = 0
            for v in self._critic.values():
                v[1] = 0.0
        self._interval += 1
        if not 0.0 < ratio < 1.0:
            return
        u, need = self._interval, 0
        for i, (z, sums, s) in enumerate(zip(self.shards, colsums, self._sel)):
            for key, (off, ncols) in z.cols.items():
                col = sums[off:off + ncols]
                total, critic = float(col.sum()), float(col[s.columns[key]].sum())
                v = self._critic.setdefault((i, key), [0.0, 0.0])
                v[0] = (v[0] * (u - 1) + critic) / u / (ratio * 10)
                v[1] += (total - critic) / ((1 - ratio) * 10)
                need += v[1] >= v[0]
        flag = torch.tensor(float(need >= int(self.options.auto_ratio * self._n2d)), device=self.views.device)
        if self.agree is not None:  # ranks holding other experts count other sums: every rank updates when one does
            self.agree(flag, op="max")
        self._flag = bool(flag)

    # ------------------------------------------------------------------ the device step
    def _device_step(self, coef: torch.Tensor | None) -> None:
        self._k += 1
        adamw = getattr(self.optimizer, "adam_w_mode", True)
        for z, s in zip(self.shards, self._sel):
            if not s.idx.numel():
                continue
            group = z.group
            beta1, beta2 = group["betas"]
            wd = float(group["weight_decay"])
            fn = torch._fused_adamw_ if (adamw and wd) else torch._fused_adam_
            device = s.master.device
            g = z.grad.index_select(0, s.idx).float()
            step = torch.tensor(float(self._k) if group["bias_correction"] else math.inf, device=device)
            kwargs = {} if coef is None else {"grad_scale": 1.0 / coef.to(device=device, dtype=torch.float32)}
            # zenflow.offload: the moments come over for the step and go back (Note: offload)
            moments = [t.to(device, non_blocking=True) for t in (s.exp_avg, s.exp_avg_sq)]
            fn([s.master], [g], moments[:1], moments[1:], [], [step], lr=float(group["lr"]), beta1=float(beta1),
               beta2=float(beta2), weight_decay=wd, eps=float(group["eps"]), amsgrad=False, maximize=False, **kwargs)
            for host, dev in zip((s.exp_avg, s.exp_avg_sq), moments):
                if dev is not host:
                    host.copy_(dev, non_blocking=True)
            z.lp_flat.index_copy_(0, s.lp_idx, s.master.to(z.lp_flat.dtype))
        if self.options.offload:
            synchronize(self.views.device)  # the moments are in host memory before anything reads them

    # ------------------------------------------------------------------ readers
    def flush(self, gather: bool = True) -> None:
        """Finish an overlapped update and write it into the parameters (all-gathered unless the caller
        does it next: `gather`); the host masters take the device values of the selected elements
        (what every reader of the masters sees)."""
        self._drain(gather)
        if self._sel is not None:
            for z, s in zip(self.shards, self._sel):
                z.master.index_copy_(0, s.idx_host, s.master.to("cpu"))

    def _drain(self, gather: bool) -> None:
        """Wait for the overlapped update and write it into the parameters (the selected elements keep
        the device's values)."""
        if self._background is not None:
            self._background.wait()
            if self._pending:
                self._pending = False
                writer = LowpWriter()
                for z in self.shards:
                    if not z.master.numel():
                        continue
                    writer.write(z.master, 0, z.master.numel(), self.views.lowp_out.get(z.master, ()))
                writer.finish()
                if self._sel is not None:
                    for z, s in zip(self.shards, self._sel):
                        z.lp_flat.index_copy_(0, s.lp_idx, s.master.to(z.lp_flat.dtype))
                if gather:
                    self._write_back()

    def tally(self, tally) -> None:
        """Count ZenFlow's own buffers into a `MemoryTally` (zero/memory.py): the interval's sums on
        the device and their host copies as gradients, the selected elements' values and moments as
        optimizer state."""
        for t in self._dacc + [a for acc in self._acc for a in acc]:
            tally.add_tensor("grads", t)
        for s in self._sel or ():
            for t in (s.master, s.exp_avg, s.exp_avg_sq):
                tally.add_tensor("optimizer_state", t)

    def merge_state(self, state: dict) -> dict:
        """`state` (a `fragments_state_dict` of the masters after `flush`) with the device moments at
        the selected elements and the step count of the steps taken, in copies of the host moments."""
        if self._sel is None or self.optimizer is None:
            return state
        owners = {(o.data_ptr(), o.numel()): i for i, o in enumerate(state["owners"])}  # detached views
        merged = list(state["state"])
        for z, s in zip(self.shards, self._sel):
            i = owners.get((z.master.data_ptr(), z.master.numel())) if z.master.numel() else None
            if i is None:
                continue
            entry = dict(merged[i])
            for key, dev in (("exp_avg", s.exp_avg), ("exp_avg_sq", s.exp_avg_sq)):
                if key in entry:
                    entry[key] = entry[key].clone().index_copy_(0, s.idx_host, dev.to("cpu"))
            entry["step"] = self._m
            merged[i] = entry
        return {**state, "state": merged}

    def reset(self) -> None:
        """The masters were replaced (a load): a new interval, and a new selection at the next step.
        The device values are dropped, not written back (an update in flight is waited for)."""
        if self._background is not None:
            self._background.wait()
            self._pending = False
        self._sel = None
        self._count = 0
        self._reselect = True
