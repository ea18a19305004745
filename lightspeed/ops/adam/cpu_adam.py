"""CPUAdam: DeepSpeedCPUAdam's behaviour on torch's vectorized CPU kernels (no C++ build step).

Route (measured in benchmarks/optimizers.py): fp32 params with fp32 states go through torch's fused
multi-tensor CPU kernel (``torch._fused_adam_`` / ``torch._fused_adamw_``: one pass over p, g, m, v,
vectorized, parallelized with at::parallel_for so ``torch.set_num_threads`` is respected).
bf16/fp16 params (or states) are processed in cache-sized chunks: each chunk is upcast into fp32
scratch buffers, updated by the same kernel, and written back (and to the optional low-precision copy
of ``step(fp16_param_groups=...)``) while hot. For fp32 params the copy is one extra pass after the
kernel (measured faster than chunking the fp32 path: 81.7 vs 87.3 ms at 100M, 2 threads).
Without bias correction the kernel is given step=inf, so 1 - beta**step == 1 exactly.

The ZeRO step (``step(grads=, grad_scale=, lowp_out=)``, the protocol of lightspeed's fused device
optimizers): ZeRO-Offload hands the host gradient of each master, the unscale/clip coefficient and the
model's low-precision copies (usually on the device). The masters are stepped in pieces of
``PIECE_ELEMS``; the coefficient is applied inside the kernel where it takes one (CPUAdam: torch's
``grad_scale``) or to the piece of the gradient just before it; each stepped piece goes to its
low-precision copies at once (`ops/lowp_writer.py`), so the host-to-device copies overlap the rest of
the step instead of following it.

Note [the gradient is read, not written]: torch's fused CPU Adam, given ``grad_scale``, stores the
unscaled gradient back into its gradient argument, and the families that take no coefficient
(Lion, Adagrad) were handed a gradient multiplied in place. Nothing reads the host gradient after
the update (the speculative step's redo reads it again and needs it as handed in), so the ZeRO step
with a coefficient stages each cache-sized chunk of the gradient in a scratch buffer and lets the
kernel write there: host traffic of the fp32 step per parameter goes from 32 bytes (read master,
gradient, exp_avg, exp_avg_sq; write all four) to 28 (the gradient is not written back; the copy
into the scratch reads it once, the kernel then reads the scratch from cache). The results are
bitwise those of one kernel call per piece (tests/ops/test_cpu_optimizers.py). Without a coefficient
the kernel reads the gradient only and is called on the whole piece, as before.

Note [low-precision masters and state]: bf16/fp16 masters (``*_master_weights_and_grads``) and bf16
state (``bf16.bf16_optimizer_states``, state created in the master's dtype) take the plain
reference path in the ZeRO step, DeepSpeedCPUAdam's numbers bit for bit, run chunk by chunk
(``CHUNK_ELEMS``) so its fp32 temporaries stay cache-sized instead of several times the range.
The state stays bf16 on the host: 2 + 2 + 2 + 2 bytes per parameter (master, gradient, moments)
where fp32 masters and state hold 4 + 4 + 4 + 4.

Note [stochastic rounding]: with `stochastic_rounding` (bf16.stochastic_rounding; zero/optimizers.py
sets it and `rounding_seed`) the bf16 masters and state are stepped chunk by chunk on fp32 copies in
the scratch buffers (the same fp32 values the reference computes in place) and written back through
`ops/rounding.round_in_place`: 16 random bits per element from ``torch.randint`` with a generator
seeded from `rounding_seed`, the step, the parameter's index in the optimizer and the chunk's first
element, so a fixed seed repeats a run whatever ranges the ZeRO step is split into (chunks start at
multiples of CHUNK_ELEMS from the range's start; the ZeRO-Offload ranges are the same every step).
"""
from __future__ import annotations

import math
from typing import Callable, Iterable, Sequence

import torch

from lightspeed._utils.logging import get_logger

from ..lowp_writer import PIECE_ELEMS, LowpWriter
from ..rounding import mix_seed, round_in_place
from .inverse import adam_undo_
from .reference import adam_step

logger = get_logger(__name__)

#: elements per chunk on the chunked (mixed-precision / copy-writing) path; 4 fp32 scratch buffers of
#: this size (4 MiB total) stay in L2/L3.
CHUNK_ELEMS = 256 * 1024
#: elements per chunk of the gradient staged by the fp32 ZeRO step with a coefficient (4 MiB of fp32
#: scratch; measured faster than 256K per chunk on a 2-core host: fewer kernel calls, 9.5 vs 11.1 ms
#: over 16M parameters, one thread)
STAGE_ELEMS = 1024 * 1024


class CPUOptimizerBase(torch.optim.Optimizer):
    """Shared plumbing of the CPU optimizers: state init, step bookkeeping, low-precision copies."""

    _state_keys: tuple[str, ...] = ()
    #: the ZeRO step protocol (see the module docstring): ZeRO hands the coefficient and the copies
    fuses_lowp_out = True
    #: the family's `_kernel` takes `grad_scale` (a divisor, torch's convention) itself
    _kernel_scales = False
    #: bf16 masters and state written with stochastic rounding (Note [stochastic rounding])
    stochastic_rounding: bool = False
    #: the base of the per-chunk rounding seeds
    rounding_seed: int = 0

    def __init__(self, params, defaults: dict, fp32_optimizer_states: bool = True):
        super().__init__(params, defaults)
        self.fp32_optimizer_states = fp32_optimizer_states
        self._scratch: list[torch.Tensor] = []
        self._writer: LowpWriter | None = None
        # the ZeRO step in progress: param -> (group, grad, step, scale, targets, index of the param)
        self._spans: dict = {}

    def __setstate__(self, state):
        super().__setstate__(state)
        self.__dict__.setdefault("_scratch", [])
        self.__dict__.setdefault("fp32_optimizer_states", True)
        self.__dict__.setdefault("_writer", None)
        self.__dict__.setdefault("_spans", {})

    def __getstate__(self):
        state = super().__getstate__()
        state.pop("_writer", None)  # pinned staging and CUDA streams are rebuilt on use
        state.pop("_spans", None)
        return state

    # -- helpers ---------------------------------------------------------------------------------
    def _buffers(self, count: int, n: int) -> list[torch.Tensor]:
        while len(self._scratch) < count:
            self._scratch.append(torch.empty(0, dtype=torch.float32))
        for i in range(count):
            if self._scratch[i].numel() < n:
                self._scratch[i] = torch.empty(n, dtype=torch.float32)
        return self._scratch[:count]

    @staticmethod
    def _normalize_lowp(fp16_param_groups, n_groups: int):
        """DeepSpeed indexes the copies as ``fp16_param_groups[group_id][param_id]``; a flat list of
        tensors is accepted for a single group."""
        if fp16_param_groups is None:
            return [None] * n_groups
        groups = list(fp16_param_groups)
        if n_groups == 1 and groups and isinstance(groups[0], torch.Tensor):
            groups = [groups]
        if len(groups) != n_groups:
            raise ValueError(f"fp16_param_groups has {len(groups)} groups, optimizer has {n_groups}")
        return groups

    def _init_state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if len(state) == 0:
            state["step"] = 0
            dtype = torch.float32 if self.fp32_optimizer_states else p.dtype
            for key in self._state_keys:
                state[key] = torch.zeros_like(p, dtype=dtype, memory_format=torch.contiguous_format)
        return state

    def _chunked(self, p: torch.Tensor, g: torch.Tensor, states: Sequence[torch.Tensor],
                 lowp: torch.Tensor | None, kernel: Callable[[list[torch.Tensor]], None]) -> None:
        """Run ``kernel([p, g, *states])`` on fp32 chunks; write results back (and into ``lowp``)."""
        tensors = [p.view(-1), g.view(-1)] + [s.view(-1) for s in states]
        lowp_flat = lowp.view(-1) if lowp is not None else None
        n = tensors[0].numel()
        need = [t.dtype != torch.float32 for t in tensors]
        bufs = self._buffers(sum(need), min(n, CHUNK_ELEMS))
        for start in range(0, n, CHUNK_ELEMS):
            end = min(n, start + CHUNK_ELEMS)
            views = [t[start:end] for t in tensors]
            work, bi = [], 0
            for v, nd in zip(views, need):
                if nd:
                    work.append(bufs[bi][: end - start].copy_(v))
                    bi += 1
                else:
                    work.append(v)
            kernel(work)
            for i, (v, w) in enumerate(zip(views, work)):
                if i != 1 and w is not v:
                    v.copy_(w)
            if lowp_flat is not None:
                lowp_flat[start:end].copy_(work[0])

    def _rounds(self, p: torch.Tensor, states: Sequence[torch.Tensor]) -> bool:
        """Whether `p`'s step goes through `_step_rounded` (stochastic rounding and a bf16 tensor to write)."""
        return self.stochastic_rounding and any(t.dtype == torch.bfloat16 for t in (p, *states))

    def _step_rounded(self, p: torch.Tensor, g: torch.Tensor, states: Sequence[torch.Tensor], step: int, group: dict,
                      index: int, start: int, end: int, scale: torch.Tensor | None) -> None:
        """Elements [start, end) of the flat `p` and `states` stepped by the family's reference on fp32
        copies, chunk by chunk, and written back rounded stochastically (Note [stochastic rounding])."""
        if not all(t.is_contiguous() for t in (p, g, *states)):
            raise ValueError(f"{type(self).__name__}: stochastic rounding needs contiguous parameters, "
                             "gradients and state")
        flat = [p.view(-1), g.view(-1)] + [x.view(-1) for x in states]
        for lo in range(start, end, CHUNK_ELEMS):
            hi = min(end, lo + CHUNK_ELEMS)
            pr, gr, *sr = (t[lo:hi] for t in flat)
            if scale is not None:
                gr = gr * scale.to(g.device)
            targets = [pr, *sr]
            bufs = iter(self._buffers(sum(t.dtype != torch.float32 for t in targets), hi - lo))
            work = [t if t.dtype == torch.float32 else next(bufs)[: hi - lo].copy_(t) for t in targets]
            self._reference(work[0], gr, work[1:], step, group, None)
            gen = torch.Generator().manual_seed(mix_seed(self.rounding_seed, step, index, lo))
            for dst, value in zip(targets, work):
                if value is not dst:
                    round_in_place(dst, value, gen)

    @staticmethod
    def _fast_ok(p: torch.Tensor, g: torch.Tensor, states: Sequence[torch.Tensor]) -> bool:
        ts = [p, g, *states]
        return all(t.device.type == "cpu" and t.is_contiguous() for t in ts) and all(
            t.dtype in (torch.float32, torch.bfloat16, torch.float16) for t in ts)

    # -- step ------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable | None = None, fp16_param_groups=None, *, grads=None, grad_scale=None,
             lowp_out=None):
        """One update of every param with a grad. ``fp16_param_groups[group_id][param_id]`` (optional):
        low-precision tensors that receive a copy of the updated params in the same pass.

        The ZeRO step (keyword-only, see the module docstring): ``grads`` maps a param to its gradient
        (instead of ``.grad``), ``grad_scale`` multiplies every gradient (a number or 0-dim tensor),
        ``lowp_out`` maps a param to [(offset, tensor)]: each tensor receives the updated param's
        elements from its offset on, in its own dtype and on its own device."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if grads is not None or grad_scale is not None or lowp_out is not None:
            if fp16_param_groups is not None:
                raise ValueError("fp16_param_groups and lowp_out are two ways to ask for the copies: pass one")
            self._zero_step(grads, grad_scale, lowp_out or {})
            return loss
        lowp_groups = self._normalize_lowp(fp16_param_groups, len(self.param_groups))
        index = -1  # the param's index in the optimizer (a rounding seed's part)
        for group, lowp_group in zip(self.param_groups, lowp_groups):
            self._check_group(group)
            fast: list[tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], int]] = []
            copies: list[tuple[torch.Tensor, torch.Tensor]] = []
            for i, p in enumerate(group["params"]):
                index += 1
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
                state = self._init_state(p)
                state["step"] += 1
                step = state["step"]
                states = [state[k] for k in self._state_keys]
                lowp = lowp_group[i] if lowp_group is not None else None
                if lowp is not None and lowp.numel() != p.numel():
                    raise ValueError(f"fp16 copy of param {i} has {lowp.numel()} elements, param {p.numel()}")
                g = p.grad
                if p.numel() == 0:
                    continue
                if self._rounds(p, states):
                    self._step_rounded(p, g, states, step, group, index, 0, p.numel(), None)
                    if lowp is not None:
                        lowp.view(-1).copy_(p.view(-1))
                elif not self._fast_ok(p, g, states) or (lowp is not None and not lowp.is_contiguous()):
                    self._reference(p, g, states, step, group, lowp)
                elif all(t.dtype == torch.float32 for t in (p, g, *states)):
                    # one multi-tensor kernel call; a low-precision copy is written after it (measured
                    # faster on this path than chunking, whose per-chunk calls cost more than the re-read)
                    fast.append((p, g, states, step))
                    if lowp is not None:
                        copies.append((lowp, p))
                else:
                    self._chunked(p, g, states, lowp, lambda w, s=step: self._kernel(
                        [w[0]], [w[1]], [[t] for t in w[2:]], [s], group))
            if fast:
                ps, gs, sts, steps = zip(*fast)
                self._kernel(list(ps), list(gs), [list(x) for x in zip(*sts)], list(steps), group)
            for lowp, p in copies:
                lowp.view(-1).copy_(p.view(-1))
        return loss

    def _zero_step(self, grads, grad_scale, lowp_out) -> None:
        """The ZeRO step: fp32 params stepped piece by piece, each piece written out as it is done."""
        spans = self.begin_zero_step(grads, grad_scale, lowp_out)
        for p in spans:
            self.zero_step_range(p, 0, p.numel())
        self.end_zero_step()

    def begin_zero_step(self, grads, grad_scale=None, lowp_out=None) -> list[torch.Tensor]:
        """Start a ZeRO step that `zero_step_range` then applies range by range (ZeRO-Offload steps
        each bucket's range as its gradient reaches the host): every param with a gradient in `grads`
        counts one step now. Returns those params; `end_zero_step` finishes the copies."""
        if self._writer is None:
            self._writer = LowpWriter(PIECE_ELEMS)
        scale = None if grad_scale is None else torch.as_tensor(grad_scale, dtype=torch.float32).to("cpu").reshape(())
        lowp_out = lowp_out or {}
        self._spans = {}
        index = -1
        for group in self.param_groups:
            self._check_group(group)
            for p in group["params"]:
                index += 1
                g = grads.get(p) if grads is not None else p.grad
                if g is None or p.numel() == 0:
                    continue
                if g.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
                state = self._init_state(p)
                state["step"] += 1
                self._spans[p] = (group, g, state["step"], scale, lowp_out.get(p, ()), index)
        return list(self._spans)

    def zero_step_range(self, p: torch.Tensor, start: int, end: int) -> None:
        """Step elements [start, end) of `p` (flat) in the ZeRO step `begin_zero_step` started and
        copy them to their low-precision targets; each element once per step. The gradient is only
        read (see the module's Note [the gradient is read, not written])."""
        group, g, step, scale, targets, index = self._spans[p]
        state = self.state[p]
        states = [state[k] for k in self._state_keys]
        if self._rounds(p, states):
            self._step_rounded(p, g, states, step, group, index, start, end, scale)
            self._writer.write(p, start, end, targets)
            return
        flat = [p.view(-1), g.view(-1)] + [x.view(-1) for x in states]
        if not (self._fast_ok(p, g, states) and all(t.dtype == torch.float32 for t in (p, g, *states))):
            # mixed precision (bf16/fp16 masters, low-precision state) or odd layouts: the plain path,
            # chunk by chunk so its fp32 temporaries stay cache-sized instead of the range's size
            for lo in range(start, end, CHUNK_ELEMS):
                hi = min(end, lo + CHUNK_ELEMS)
                pr, gr, *sr = (t[lo:hi] for t in flat)
                if scale is not None:
                    gr = gr * scale.to(g.device)
                self._reference(pr, gr, sr, step, group, None)
            self._writer.write(p, start, end, targets)
            return
        kwargs = {"grad_scale": 1.0 / scale} if scale is not None and self._kernel_scales else {}
        for lo in range(start, end, PIECE_ELEMS):
            hi = min(end, lo + PIECE_ELEMS)
            pp, gp, *sp = (t[lo:hi] for t in flat)
            if scale is None:  # the kernel reads the gradient only
                self._kernel([pp], [gp], [[x] for x in sp], [step], group)
            else:
                self._scaled_piece(pp, gp, sp, step, group, scale, kwargs)
            self._writer.write(p, lo, hi, targets)

    def _scaled_piece(self, p: torch.Tensor, g: torch.Tensor, states: Sequence[torch.Tensor], step: int,
                      group: dict, scale: torch.Tensor, kwargs: dict) -> None:
        """One fp32 piece of the ZeRO step with a coefficient: each cache-sized chunk of the gradient
        is staged in a scratch buffer (multiplied by `scale` there when the kernel takes no
        coefficient), so what the kernel writes into its gradient argument lands in cache, not in
        the host gradient. Bitwise the values of stepping the piece in one call: the kernel is
        elementwise and the chunks are whole vector widths."""
        buf = self._buffers(1, min(g.numel(), STAGE_ELEMS))[0]
        for lo in range(0, g.numel(), STAGE_ELEMS):
            hi = min(g.numel(), lo + STAGE_ELEMS)
            work = buf[: hi - lo]
            if self._kernel_scales:
                work.copy_(g[lo:hi])
            else:
                torch.mul(g[lo:hi], scale, out=work)
            self._kernel([p[lo:hi]], [work], [[x[lo:hi]] for x in states], [step], group, **kwargs)

    def end_zero_step(self) -> None:
        """The copies of this ZeRO step are ordered before the compute stream's next work."""
        self._spans = {}
        self._writer.finish()

    def load_state_dict(self, state_dict: dict) -> None:
        """As torch's, but the state keeps the dtype this optimizer creates it in (fp32 with
        `fp32_optimizer_states`, else the parameter's), not torch's cast to the parameter's dtype."""
        saved_groups = state_dict["param_groups"]
        super().load_state_dict(state_dict)
        for saved, group in zip(saved_groups, self.param_groups):
            for pid, p in zip(saved["params"], group["params"]):
                for key, value in state_dict["state"].get(pid, {}).items():
                    if isinstance(value, torch.Tensor) and key in self._state_keys:
                        dtype = torch.float32 if self.fp32_optimizer_states else p.dtype
                        self.state[p][key] = value.to(device=p.device, dtype=dtype, copy=True)

    # -- the inverse step (offload/speculative.py's "inverse" rollback) -------------------------------
    def inverse_unsupported(self, grads=None) -> str | None:
        """Why `undo_zero_step_range` cannot undo this optimizer's ZeRO step (None: it can); `grads`:
        the gradients the step will read, checked too when given."""
        return f"{type(self).__name__} has no inverse step (Adam/AdamW only)"

    def undo_zero_step_range(self, p: torch.Tensor, start: int, end: int, grad: torch.Tensor,
                             grad_scale: torch.Tensor | None) -> None:
        """Undo the ZeRO step of elements [start, end) of `p` (flat): the step `state["step"]` counts,
        taken from `grad` with the coefficient `grad_scale` (None: none). The step count is the caller's."""
        raise NotImplementedError(self.inverse_unsupported())

    # -- per family ------------------------------------------------------------------------------
    def _check_group(self, group: dict) -> None:
        pass

    def _kernel(self, params, grads, states, steps, group) -> None:  # fp32 lists
        raise NotImplementedError

    def _reference(self, p, g, states, step, group, lowp) -> None:
        raise NotImplementedError


class CPUAdam(CPUOptimizerBase):
    """DeepSpeedCPUAdam: Adam (L2 weight decay) or AdamW (decoupled, ``adamw_mode=True``) on CPU."""

    _state_keys = ("exp_avg", "exp_avg_sq")

    def __init__(self, model_params: Iterable, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0,
                 amsgrad: bool = False, adamw_mode: bool = True, fp32_optimizer_states: bool = True):
        if amsgrad:
            raise RuntimeError("CPUAdam does not support the AMSGrad variant.")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, amsgrad=amsgrad)
        super().__init__(model_params, defaults, fp32_optimizer_states)
        self.adam_w_mode = adamw_mode
        logger.debug("CPUAdam: torch fused CPU kernel, adamw_mode=%s, fp32 states=%s", adamw_mode,
                     fp32_optimizer_states)

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("amsgrad", False)
            group.setdefault("bias_correction", True)

    _kernel_scales = True

    def _check_group(self, group):
        if group.get("amsgrad", False):
            raise RuntimeError("CPUAdam does not support the AMSGrad variant.")

    def _kernel(self, params, grads, states, steps, group, grad_scale: torch.Tensor | None = None):
        beta1, beta2 = group["betas"]
        if group["bias_correction"]:
            step_ts = [torch.tensor(float(s)) for s in steps]
        else:
            step_ts = [torch.tensor(math.inf) for _ in steps]
        wd = float(group["weight_decay"])
        fn = torch._fused_adamw_ if (self.adam_w_mode and wd) else torch._fused_adam_
        fn(params, grads, states[0], states[1], [], step_ts, lr=float(group["lr"]), beta1=float(beta1),
           beta2=float(beta2), weight_decay=wd, eps=float(group["eps"]), amsgrad=False, maximize=False,
           grad_scale=grad_scale)

    def inverse_unsupported(self, grads=None) -> str | None:
        if any(group.get("amsgrad", False) for group in self.param_groups):
            return "AMSGrad's running max has no inverse"
        # the tensors the ZeRO step will step (`grads`' keys: a strategy may hand the optimizer its
        # masters after this check), else the optimizer's own
        pairs = list(grads.items()) if grads else [(p, None) for g in self.param_groups for p in g["params"]]
        for p, g in pairs:
            if p.dtype != torch.float32 or (g is not None and g.dtype != torch.float32):
                got = p.dtype if g is None else f"{p.dtype} masters, {g.dtype} gradients"
                return f"the inverse step needs fp32 masters and gradients (got {got})"
            if not (p.device.type == "cpu" and p.is_contiguous()):
                return "the inverse step needs contiguous host masters"
        return None

    def undo_zero_step_range(self, p, start, end, grad, grad_scale):
        group = next(g for g in self.param_groups if any(q is p for q in g["params"]))
        state = self.state[p]
        beta1, beta2 = group["betas"]
        adam_undo_(p.view(-1)[start:end], grad.view(-1)[start:end], state["exp_avg"].view(-1)[start:end],
                   state["exp_avg_sq"].view(-1)[start:end], step=int(state["step"]), lr=float(group["lr"]),
                   beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
                   weight_decay=float(group["weight_decay"]), adamw=self.adam_w_mode,
                   bias_correction=group["bias_correction"],
                   grad_scale=None if grad_scale is None else 1.0 / grad_scale)

    def _reference(self, p, g, states, step, group, lowp):
        beta1, beta2 = group["betas"]
        adam_step(p, g, states[0], states[1], step=step, lr=group["lr"], beta1=beta1, beta2=beta2,
                  eps=group["eps"], weight_decay=group["weight_decay"], adamw=self.adam_w_mode,
                  bias_correction=group["bias_correction"], param_lowp_out=lowp)


DeepSpeedCPUAdam = CPUAdam
