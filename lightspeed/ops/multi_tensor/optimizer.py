"""FusedOptimizer: the torch.optim.Optimizer base of FusedAdam, FusedLamb, FusedLion, FusedAdagrad.

Owns: collecting each group's parameters with gradients into segments (a parameter, or a piece of
one), state creation (fp32 whatever the parameter dtype, unless `state_dtype` says bf16), grouping segments into launches of one
(step, dtypes, alignment) each, the choice of backend, and the two extras the ZeRO engine passes to
`step`:
  * `grad_scale`: a float or 0-dim tensor every gradient is multiplied by inside the kernel (the
    1/loss_scale unscale times the clip coefficient), so no pass over the gradients is spent on it
    and no host synchronisation is needed to learn it;
  * `lowp_out`: {param: [(offset, out), ...]}: after the update, elements [offset, offset+numel) of
    the flattened param are also written, rounded, to `out` (the bf16/fp16 parameter copy).
  * `grads`: {param: gradient} used instead of `param.grad`; the gradient may have another dtype
    than its parameter (the bf16 gradient shard of an fp32 master shard), which torch does not allow
    to assign to `.grad`.

Note [stochastic rounding]: with `stochastic_rounding` (bf16.stochastic_rounding; zero/optimizers.py
sets it and `rounding_seed`) every bf16 parameter and state the step writes is rounded stochastically
(ops/rounding.py) instead of to nearest. Each launch draws from its own seed, mixed from
`rounding_seed`, the step, the group and the launch's index, so a run with a fixed seed repeats
itself and no two steps or launches share draws. The Triton kernels take the seed (Philox per
element); the reference path steps fp32 copies of the segments with the family's reference and
writes them back through `rounding.round_in_place` (torch.randint from a generator with that seed).
The two paths draw different bits: the same distribution, not the same numbers.

Note [captured step]: a step splits into its host half (`graph_advance`: the launch cache checked or
rebuilt, the step counts, each launch's float arguments from `_kernel_hyper`) and its device half
(`graph_launches`: the cached launches, each reading its arguments from fp32 device scalars, the
kernels' HYPER_IN_MEMORY variant). zero/graphed_step.py captures the device half once in a CUDA graph
and, every step, runs the host half, writes its values into the scalars the graph reads, and replays.
`step` launches the same kernels in the same order with the same fp32 values passed by value, so the
two give the same bits. Families with `_kernel_hyper` and no stochastic rounding (its seed changes
every step) are `graph_capturable`.

Backends: "triton" (the family's multi-tensor kernel; on CUDA, or on CPU under TRITON_INTERPRET=1 in
the tests), "reference" (the family's plain-PyTorch step, one segment at a time), "auto" (triton for
CUDA tensors, reference otherwise). The environment variable LIGHTSPEED_OPS_BACKEND replaces "auto"
(e.g. "reference" to rule the kernels out while debugging, "triton" to test them inside the engine). Must not: communicate, or know about ZeRO's buffers.
"""
from __future__ import annotations

import os
from typing import Iterable, Mapping, Sequence

import torch

from lightspeed.ops.multi_tensor import Plan, plan
from lightspeed.ops.rounding import mix_seed, round_in_place

__all__ = ["FusedOptimizer", "Launch", "Segment"]

_BACKENDS = ("auto", "triton", "reference")


class Segment:
    """A contiguous run [start, end) of one parameter: flat views of the param, each state and the
    optional low-precision output; the gradient view is bound for the duration of one step only."""

    __slots__ = ("param", "grad", "states", "out", "owner", "start", "end")

    def __init__(self, param, states, out, owner, start: int, end: int):
        self.param, self.grad, self.states, self.out, self.owner = param, None, states, out, owner
        self.start, self.end = start, end


class Launch:
    """The segments updated by one kernel launch (one step value, device and dtype combination),
    with their tensor lists and launch plans built once. Gradients change from step to step (autograd
    allocates new ones after zero_grad(set_to_none=True)), so they are bound per step and released
    after it: a cached launch never keeps a gradient alive, and gradients at new addresses cost one
    small offsets table (from their data pointers, no views), not a rebuild."""

    __slots__ = ("owner", "device", "segments", "_static", "_grad_of", "_plans")

    def __init__(self, owner: torch.Tensor, device: torch.device):
        self.owner, self.device, self.segments = owner, device, []
        self._static, self._grad_of, self._plans = None, None, {}

    def bind_grads(self, grad_of: Mapping[int, torch.Tensor]) -> None:
        """This step's gradients: {id(param): contiguous gradient}."""
        self._grad_of = grad_of

    def release_grads(self) -> None:
        self._grad_of = None
        for seg in self.segments:
            seg.grad = None

    def _grad_slice(self, seg: Segment) -> torch.Tensor:
        return self._grad_of[id(seg.owner[0])].view(-1)[seg.start:seg.end]

    def arrays(self, with_out: bool = True) -> list[list[torch.Tensor]]:
        """[params, grads, *states, (outs, when the segments have them and `with_out`)], with every
        segment's gradient view (the reference path, and a plan's first build)."""
        if self._static is None:
            segs = self.segments
            self._static = [[s.param for s in segs]] + [[s.states[i] for s in segs] for i in range(len(segs[0].states))]
            if segs[0].out is not None:
                self._static.append([s.out for s in segs])
        for seg in self.segments:
            seg.grad = self._grad_slice(seg)
        arrays = [self._static[0], [seg.grad for seg in self.segments], *self._static[1:]]
        has_out = self.segments[0].out is not None
        return arrays if with_out or not has_out else arrays[:-1]

    def kernel_arrays(self, block: int, with_out: bool = True) -> tuple[list[list[torch.Tensor]], Plan]:
        """(arrays, plan) for a Triton launch. The plan is built once; when this step's gradients
        live elsewhere than the plan's, only its gradient offsets are recomputed. The gradient row of
        `arrays` holds just the base tensor (kernels read `plan.bases(arrays)`; offsets do the rest)."""
        key = (block, with_out)
        grad_of, segs = self._grad_of, self.segments
        size = grad_of[id(segs[0].owner[0])].element_size()
        ptrs = tuple(grad_of[id(seg.owner[0])].data_ptr() + seg.start * size for seg in segs)
        cached = self._plans.get(key)
        if cached is None:
            arrays = self.arrays(with_out)
            built = plan(arrays, block)
            self._plans[key] = (built, ptrs)
            return arrays, built
        built = cached[0] if cached[1] == ptrs else cached[0].with_row(1, ptrs, size)
        self._plans[key] = (built, ptrs)
        static = self._static if with_out or segs[0].out is None else self._static[:-1]
        grads = [self._grad_slice(segs[built.base_index])] * len(segs)
        return [static[0], grads, *static[1:]], built


class FusedOptimizer(torch.optim.Optimizer):
    """Base class; families set `_state_keys` and implement `_launch_triton` / `_launch_reference`."""

    _state_keys: tuple[str, ...] = ()
    #: whether step(lowp_out=...) is supported (the ZeRO engine then skips its own copy pass)
    fuses_lowp_out = True
    #: the dtype new state is created in: fp32, or bf16 when ZeRO keeps bf16 masters and optimizer
    #: state (bf16.bf16_optimizer_states: zero/optimizers.py sets it); the kernels compute in fp32
    #: whatever the state dtype and round the state once per step
    state_dtype: torch.dtype = torch.float32
    #: bf16 parameters and state written with stochastic rounding (Note [stochastic rounding])
    stochastic_rounding: bool = False
    #: the base of the per-launch rounding seeds
    rounding_seed: int = 0
    #: whether the family's kernels take a rounding seed (FusedLamb's do not)
    supports_stochastic_rounding: bool = False

    def __init__(self, params: Iterable, defaults: dict, *, set_grad_none: bool = True, backend: str = "auto"):
        if backend == "auto":
            backend = os.environ.get("LIGHTSPEED_OPS_BACKEND", "auto")
        if backend not in _BACKENDS:
            raise ValueError(f"backend (or LIGHTSPEED_OPS_BACKEND) must be one of {_BACKENDS}, got {backend!r}")
        super().__init__(params, defaults)
        self.set_grad_none = bool(set_grad_none)
        self.backend = backend
        self._scale_cache: dict[tuple, torch.Tensor] = {}
        self._launch_cache: dict[int, tuple] = {}  # group index -> (signature, launches)
        self._round_seed: int | None = None  # the launch in progress: its rounding seed (None: to nearest)

    def __setstate__(self, state):
        super().__setstate__(state)
        self.__dict__.setdefault("set_grad_none", True)
        self.__dict__.setdefault("backend", "auto")
        self.__dict__.setdefault("_scale_cache", {})
        self.__dict__.setdefault("_launch_cache", {})
        self.__dict__.setdefault("_round_seed", None)

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)

    # ------------------------------------------------------------------------------------------
    def _use_triton(self, device: torch.device) -> bool:
        if self.backend == "reference":
            return False
        if self.backend == "triton":
            if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
                raise RuntimeError(f"{type(self).__name__}(backend='triton') on {device} needs CUDA or TRITON_INTERPRET=1")
            return True
        return device.type == "cuda"

    def _init_state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if len(state) == 0:
            state["step"] = 0
            for key in self._state_keys:
                state[key] = torch.zeros(p.shape, dtype=self.state_dtype, device=p.device)
            self._init_extra_state(p, state)
        return state

    def _init_extra_state(self, p: torch.Tensor, state: dict) -> None:
        """Hook for families whose state does not start at zero (Adagrad's initial accumulator)."""

    def scale_tensor(self, grad_scale, device: torch.device) -> torch.Tensor | None:
        """`grad_scale` as a 0-dim fp32 tensor on `device` (None when there is none)."""
        if grad_scale is None:
            return None
        if isinstance(grad_scale, torch.Tensor):
            return grad_scale.to(device=device, dtype=torch.float32).reshape(())
        if float(grad_scale) == 1.0:
            return None
        key = (device, float(grad_scale))
        if key not in self._scale_cache:
            self._scale_cache.clear()
            self._scale_cache[key] = torch.tensor(float(grad_scale), dtype=torch.float32, device=device)
        return self._scale_cache[key]

    @staticmethod
    def _pieces(numel: int, pieces: Sequence[tuple[int, torch.Tensor]] | None):
        """(start, length, out or None) covering [0, numel), split at the low-precision pieces."""
        if not pieces:
            return [(0, numel, None)]
        runs, cursor = [], 0
        for offset, out in sorted(pieces, key=lambda item: item[0]):
            length = out.numel()
            if offset < cursor or offset + length > numel:
                raise ValueError(f"lowp_out pieces overlap or exceed the parameter ({offset}+{length} of {numel})")
            if offset > cursor:
                runs.append((cursor, offset - cursor, None))
            if length:
                runs.append((offset, length, out.reshape(-1)))
            cursor = offset + length
        if cursor < numel:
            runs.append((cursor, numel - cursor, None))
        return runs

    def _live(self, group: dict, grads: Mapping | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(param, gradient) of the group's parameters that have a gradient this step."""
        live = []
        for p in group["params"]:
            grad = grads.get(p, p.grad) if grads is not None else p.grad
            if grad is not None:
                live.append((p, grad))
        for p, grad in live:
            if grad.is_sparse:
                raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
        return live

    def _signature(self, live, lowp_out: Mapping | None) -> tuple | None:
        """What the cached launches of a group depend on: the addresses of the tensors they keep
        (params, states, low-precision outputs) and each gradient's dtype, flattened into one tuple
        (this runs every step: kept lean). Gradient addresses are not part of it (bound per step).
        None (no caching) when a parameter or gradient is not contiguous (those are copied) or a
        parameter has no state yet."""
        keys, state_of, sig = self._state_keys, self.state, []
        add = sig.append
        for p, g in live:
            st = state_of.get(p)
            if not st or not p.is_contiguous() or not g.is_contiguous():
                return None
            add(p.data_ptr())
            add(g.dtype)
            for k in keys:
                add(st[k].data_ptr())
            if lowp_out:
                for off, out in lowp_out.get(p, ()):
                    add(off)
                    add(out.data_ptr())
                    add(out.numel())
                    add(out.dtype)
            add(None)  # separator: a piece list of one parameter cannot pass for another's
        return tuple(sig)

    def _build_launches(self, live, lowp_out: Mapping | None) -> list["Launch"]:
        """Group the segments of `live` into launches of one (step, device, dtypes) each."""
        launches: dict[tuple, Launch] = {}
        for p, grad in live:
            if grad.numel() != p.numel():
                raise ValueError(f"{type(self).__name__}: gradient of {grad.numel()} elements for a parameter "
                                 f"of {p.numel()}")
            state = self._init_state(p)
            work = p if p.is_contiguous() else p.detach().contiguous()
            flat_p = work.view(-1)
            flat_states = [state[k].view(-1) for k in self._state_keys]
            pieces = lowp_out.get(p) if lowp_out is not None else None
            for start, length, out in self._pieces(p.numel(), pieces):
                if length == 0 and p.numel():
                    continue  # (an empty parameter keeps its one empty segment: FusedLamb reports its ratio)
                end = start + length
                seg = Segment(flat_p[start:end], [s[start:end] for s in flat_states], out, (p, work), start, end)
                key = (state["step"], p.device, p.dtype, grad.dtype, None if out is None else out.dtype)
                if key not in launches:
                    launches[key] = Launch(p, p.device)
                launches[key].segments.append(seg)
        return list(launches.values())

    @torch.no_grad()
    def step(self, closure=None, *, grads: Mapping[torch.Tensor, torch.Tensor] | None = None,
             grad_scale: float | torch.Tensor | None = None,
             lowp_out: Mapping[torch.Tensor, Sequence[tuple[int, torch.Tensor]]] | None = None):
        """One update of every parameter with a gradient. See the module docstring for the extras.

        Note [launch cache]: building the segments costs Python time per parameter (views, tables),
        which on a model of hundreds of tensors is longer than the kernel. Each group keeps its
        launches and reuses them while the signature (addresses of params, states and low-precision
        outputs; gradient dtypes) is unchanged; gradients are bound per step (see Launch).
        load_state_dict clears the cache."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.stochastic_rounding and not self.supports_stochastic_rounding:
            raise ValueError(f"{type(self).__name__} does not round stochastically (its kernels take no rounding seed)")
        for index, group in enumerate(self.param_groups):
            self._before_group(group, grads)
            live = self._live(group, grads)
            sig = self._signature(live, lowp_out)
            cached = self._launch_cache.get(index)
            if sig is not None and cached is not None and cached[0] == sig:
                launches = cached[1]
            else:
                launches = self._build_launches(live, lowp_out)
                self._launch_cache[index] = (self._signature(live, lowp_out), launches)
            state_of = self.state
            flat_grads = {}
            for p, g in live:
                state_of[p]["step"] += 1
                flat_grads[id(p)] = g if g.is_contiguous() else g.contiguous()
            for launch_index, launch in enumerate(launches):
                step = self.state[launch.owner]["step"]
                scale = self.scale_tensor(grad_scale, launch.device)
                self._round_seed = (mix_seed(self.rounding_seed, step, index, launch_index)
                                    if self.stochastic_rounding else None)
                launch.bind_grads(flat_grads)
                try:
                    if self._use_triton(launch.device):
                        self._launch_triton(group, step, launch, scale)
                    else:
                        launch.arrays()  # binds each segment's gradient view
                        if self._round_seed is None:
                            self._launch_reference(group, step, launch.segments, scale)
                        else:
                            self._reference_rounded(group, step, launch.segments, scale)
                finally:
                    launch.release_grads()
                    self._round_seed = None
                for seg in launch.segments:
                    p, work = seg.owner
                    if work is not p:
                        p.copy_(work)
        return loss

    def load_state_dict(self, state_dict) -> None:
        self._launch_cache.clear()
        super().load_state_dict(state_dict)

    def _reference_rounded(self, group: dict, step: int, segments: list[Segment], scale) -> None:
        """The reference step with stochastic rounding (Note [stochastic rounding]): the family's
        reference steps fp32 copies of each segment's parameter and state (the same fp32 values it
        computes in place), which are then written back rounded; the low-precision copy receives
        the parameter's stored value."""
        gen = torch.Generator(device=segments[0].param.device).manual_seed(self._round_seed)
        proxies = []
        for seg in segments:
            proxy = Segment(seg.param.to(torch.float32, copy=True),
                            [x.to(torch.float32, copy=True) for x in seg.states], None, seg.owner, seg.start, seg.end)
            proxy.grad = seg.grad
            proxies.append(proxy)
        self._launch_reference(group, step, proxies, scale)
        for seg, proxy in zip(segments, proxies):
            round_in_place(seg.param, proxy.param, gen)
            for dst, value in zip(seg.states, proxy.states):
                round_in_place(dst, value, gen)
            if seg.out is not None:
                seg.out.copy_(seg.param.view_as(seg.out))

    def _before_group(self, group: dict, grads: Mapping | None) -> None:
        """Hook run once per group before its launches (FusedLamb resets its coefficients)."""

    # the captured step (zero/graphed_step.py) ------------------------------------------------------
    @property
    def graph_capturable(self) -> bool:
        """Whether the step's launches can be captured once and replayed (Note [captured step])."""
        return type(self)._kernel_hyper is not FusedOptimizer._kernel_hyper and not self.stochastic_rounding

    def graph_advance(self, grads: Mapping[torch.Tensor, torch.Tensor],
                      lowp_out: Mapping | None) -> tuple[tuple, list[dict[str, float]]]:
        """The host half of one step (Note [captured step]): counts the step of every parameter with a
        gradient, as `step` does, and returns (the layout the launches depend on: addresses, dtypes,
        launch order; each launch's kernel hyperparameters of this step, in launch order)."""
        layout, values = [], []
        for index, group in enumerate(self.param_groups):
            live = self._live(group, grads)
            sig = self._signature(live, lowp_out)
            cached = self._launch_cache.get(index)
            if sig is None or cached is None or cached[0] != sig:
                if any(not p.is_contiguous() or not g.is_contiguous() for p, g in live):
                    raise ValueError(f"{type(self).__name__}: a captured step needs contiguous parameters and "
                                     "gradients")
                launches = self._build_launches(live, lowp_out)
                sig = self._signature(live, lowp_out)
                self._launch_cache[index] = (sig, launches)
            launches = self._launch_cache[index][1]
            layout.append((sig, tuple((g.data_ptr(), g.dtype) for _, g in live), tuple(map(id, launches))))
            for p, _ in live:
                self.state[p]["step"] += 1
            values.extend(self._kernel_hyper(group, self.state[launch.owner]["step"]) for launch in launches)
        return tuple(layout), values

    def graph_launches(self, grads: Mapping[torch.Tensor, torch.Tensor], grad_scale: torch.Tensor | None,
                       hyper: Sequence[dict[str, torch.Tensor]]) -> None:
        """The device half of one step (Note [captured step]): every cached launch, in `step`'s order,
        reading its hyperparameters from `hyper`'s tensors and the scale from `grad_scale`; no host
        state is read or changed. `graph_advance` built the launches."""
        slots = iter(hyper)
        for index, group in enumerate(self.param_groups):
            launches = self._launch_cache[index][1]
            flat_grads = {id(p): g for p, g in self._live(group, grads)}
            for launch in launches:
                if not self._use_triton(launch.device):
                    raise RuntimeError(f"{type(self).__name__}: a captured step runs the Triton kernels "
                                       f"(backend {self.backend!r} on {launch.device})")
                launch.bind_grads(flat_grads)
                try:
                    self._launch_kernel(launch, self.scale_tensor(grad_scale, launch.device), next(slots))
                finally:
                    launch.release_grads()

    # families implement these --------------------------------------------------------------------
    def _launch_triton(self, group: dict, step: int, launch: "Launch", scale: torch.Tensor | None) -> None:
        """One launch of the family's kernel with this step's hyperparameters (families with
        `_kernel_hyper` need not override it)."""
        self._launch_kernel(launch, scale, self._kernel_hyper(group, step))

    def _kernel_hyper(self, group: dict, step: int) -> dict[str, float]:
        """The kernel's float arguments for `group` at `step` (Note [captured step])."""
        raise NotImplementedError

    def _launch_kernel(self, launch: "Launch", scale: torch.Tensor | None, hyper: dict) -> None:
        """Launch the kernel over `launch` with `hyper` (floats, or fp32 device scalars it reads)."""
        raise NotImplementedError

    def _launch_reference(self, group: dict, step: int, segments: list[Segment], scale: torch.Tensor | None) -> None:
        raise NotImplementedError
