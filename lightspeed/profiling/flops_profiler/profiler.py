"""`FlopsProfiler` and `get_model_profile`: DeepSpeed's flops profiler API on
`torch.utils.flop_counter.FlopCounterMode`.

Owns the forward hooks that time each module and attribute counted flops to it, and the profile
text. Must not: count flops itself (FlopCounterMode does), patch torch functions, or store anything
on the modules (all state lives in this object, keyed by module).

Note: how flops reach modules. FlopCounterMode is entered when the outermost profiled module's
forward starts and left when it returns, so only forward work is counted (DeepSpeed counts the
forward too, even when the backward runs before the profile is printed); forwards that run inside
the backward (activation checkpointing's recompute) are left out, as `recompute_fwd_factor` accounts
for them. Each module's forward
pre-hook and post-hook read the counter's running total; the difference, summed over the module's
calls, is its inclusive flop count. FlopCounterMode's own per-module table is keyed by names its
module tracker derives from whichever module it saw first (the engine wrapping the model, or a
submodule called alone) and merges a shared module under one name; the hook deltas give the same
inclusive counts keyed by the module object, whoever calls it. FlopCounterMode counts matmuls,
convolutions and attention (two flops per multiply-accumulate), not elementwise work: MACs are half
the flops, and a model's norm and activation flops are left out (DeepSpeed estimates them).
Latency is wall time between the hooks with the device synchronized at both, so small modules show
the Python overhead of the counting itself.
"""

from __future__ import annotations

import os
import time
from typing import Any, Sequence

import torch
from torch.utils.flop_counter import FlopCounterMode, flop_registry
from torch.utils.module_tracker import ModuleTracker

from lightspeed._utils.device import synchronize
from lightspeed._utils.logging import get_logger
from lightspeed.profiling.flops_profiler.report import (
    ModuleStats, aggregated, duration_to_string, flops_to_string, macs_to_string, module_tree, number_to_string,
    params_to_string,
)  # fmt: skip
from lightspeed.profiling.peak_flops import device_name, mfu, peak_tflops

logger = get_logger(__name__)

_LINE = "{:<70}  {}"


class _Record:
    """Running totals of one module while profiling (the per-call stack allows re-entrant calls)."""

    __slots__ = ("flops", "duration", "calls", "param_ids", "stack")

    def __init__(self, param_ids: list[int]):
        self.flops = 0
        self.duration = 0.0
        self.calls = 0
        self.param_ids = param_ids
        self.stack: list[tuple[float, int]] = []


_primed = False
_BACKWARD = ModuleTracker()  # only its `is_bw`: whether autograd's backward is running now


def _custom_mapping() -> dict:
    """FlopCounterMode's registry holds the CUDA attention kernels but not the CPU one that
    F.scaled_dot_product_attention dispatches to: it takes the same (q, k, v, ...) arguments, so
    the flash kernel's formula from the registry counts it."""
    cpu_flash = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    flash = torch.ops.aten._scaled_dot_product_flash_attention
    if cpu_flash is None or cpu_flash in flop_registry or flash not in flop_registry:
        return {}
    formula = flop_registry[flash]  # already takes tensors (shape-wrapped)

    def cpu_flash_flops(*args, **kwargs):
        return formula(*args, **kwargs)

    cpu_flash_flops._get_raw = True  # FlopCounterMode's marker: do not shape-wrap it a second time
    return {cpu_flash: cpu_flash_flops}


def _prime_counter() -> None:
    """Enter FlopCounterMode once on a trivial op: the first entry in a process imports much of
    torch's compiler stack (seconds), which must not land in the first profiled module's latency."""
    global _primed
    if not _primed:
        with FlopCounterMode(display=False):
            torch.zeros(1) + 1
        _primed = True


def _model_device_dtype(model: torch.nn.Module) -> tuple[torch.device, torch.dtype]:
    tensors = [t for t in model.parameters()] + [t for t in model.buffers()]
    device = tensors[0].device if tensors else torch.device("cpu")
    floating = [t.dtype for t in tensors if t.is_floating_point()]
    return device, floating[0] if floating else torch.float32


class FlopsProfiler:
    """Measures the forward flops, MACs, latency and parameters of each module of `model`.

    Usage (DeepSpeed's): `prof.start_profile()`, run forwards, read `get_total_flops()` and friends
    or `print_model_profile()`, then `prof.end_profile()`. `ds_engine` (a LightspeedEngine) adds the
    world and batch sizes to the printed profile; `recompute_fwd_factor` is the fraction of the
    forward recomputed in the backward by activation checkpointing (backward = (2 + factor) x fwd).
    """

    def __init__(self, model: torch.nn.Module, ds_engine: Any = None, recompute_fwd_factor: float = 0.0):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"FlopsProfiler: model must be a torch.nn.Module (got {type(model).__name__})")
        self.model = model
        self.ds_engine = ds_engine
        self.recompute_fwd_factor = float(recompute_fwd_factor)
        self.started = False
        self.flops = self.macs = self.params = 0
        self._handles: list[Any] = []
        self._records: dict[int, _Record] = {}  # by id(module)
        self._param_numel: dict[int, int] = {}
        self._counter: FlopCounterMode | None = None
        self._depth = 0
        self._total_flops = 0
        self._total_duration = 0.0
        self._device, self._dtype = torch.device("cpu"), torch.float32

    # ------------------------------------------------------------------ hooks
    def _enter(self, module: torch.nn.Module, record: _Record) -> None:
        if self._depth == 0 and _BACKWARD.is_bw:
            return  # activation checkpointing's recompute: recompute_fwd_factor accounts for it
        if self._depth == 0:
            self._counter = FlopCounterMode(display=False, custom_mapping=_custom_mapping())
            self._counter.__enter__()
        self._depth += 1
        # parameters gathered just before this hook (ZeRO stage 3) have their full size now
        for p in module.parameters(recurse=False):
            key = id(p)
            if key in self._param_numel and p.numel() > self._param_numel[key]:
                self._param_numel[key] = p.numel()
        synchronize(self._device)
        record.stack.append((time.perf_counter(), self._counter.get_total_flops()))

    def _exit(self, record: _Record) -> None:
        if not record.stack:  # not counted: the profile started inside this call, or a recompute
            return
        synchronize(self._device)
        start_time, start_flops = record.stack.pop()
        flops = self._counter.get_total_flops() - start_flops
        duration = time.perf_counter() - start_time
        record.flops += flops
        record.duration += duration
        record.calls += 1
        self._depth -= 1
        if self._depth == 0:
            self._total_flops += flops
            self._total_duration += duration
            counter, self._counter = self._counter, None
            counter.__exit__(None, None, None)

    def start_profile(self, ignore_list: Sequence[type] | None = None) -> None:
        """Reset the counts and hook every module (except instances of the types in `ignore_list`:
        their work counts in their parent)."""
        logger.info("flops profiler started")
        _prime_counter()
        if self._handles:
            self.stop_profile()
        self.reset_profile()
        ignore = tuple(ignore_list or ())
        for module in self.model.modules():
            if ignore and isinstance(module, ignore) and module is not self.model:
                continue
            record = self._records[id(module)]
            self._handles.append(module.register_forward_pre_hook(
                lambda m, args, record=record: self._enter(m, record)))
            self._handles.append(module.register_forward_hook(
                lambda m, args, out, record=record: self._exit(record), always_call=True))
        self.started = True

    def stop_profile(self) -> None:
        """Remove the hooks; the counts so far stay readable until `end_profile`."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._counter is not None:  # stopped inside a forward
            counter, self._counter, self._depth = self._counter, None, 0
            counter.__exit__(None, None, None)

    def reset_profile(self) -> None:
        """Zero every count (parameters are counted again)."""
        self._device, self._dtype = _model_device_dtype(self.model)
        self._param_numel = {id(p): p.numel() for p in self.model.parameters()}
        self._records = {id(m): _Record([id(p) for p in m.parameters()]) for m in self.model.modules()}
        self._total_flops, self._total_duration = 0, 0.0

    def end_profile(self) -> None:
        """Remove the hooks and drop the counts."""
        if not self.started:
            return
        self.stop_profile()
        self._records = {}
        self._param_numel = {}
        self.started = False
        logger.info("flops profiler finished")

    # ------------------------------------------------------------------ totals
    def _check_started(self, what: str) -> None:
        if not self.started:
            raise RuntimeError(f"FlopsProfiler.{what}: call it between start_profile() and end_profile()")

    def get_total_flops(self, as_string: bool = False):
        """Forward flops counted since `start_profile` (all forwards of the model, summed)."""
        self._check_started("get_total_flops")
        return number_to_string(self._total_flops) if as_string else self._total_flops

    def get_total_macs(self, as_string: bool = False):
        self._check_started("get_total_macs")
        macs = self._total_flops // 2
        return macs_to_string(macs) if as_string else macs

    def get_total_duration(self, as_string: bool = False):
        """Forward wall time in seconds since `start_profile`."""
        self._check_started("get_total_duration")
        return duration_to_string(self._total_duration) if as_string else self._total_duration

    def get_total_params(self, as_string: bool = False):
        """Parameters of the model (each tied parameter once; full sizes under ZeRO stage 3 once the
        module has run)."""
        self._check_started("get_total_params")
        params = sum(self._param_numel.values())
        return params_to_string(params) if as_string else params

    def module_stats(self) -> ModuleStats:
        """The profile as a tree of `ModuleStats` (a shared module appears under each parent)."""
        self._check_started("module_stats")

        def build(name: str, module: torch.nn.Module) -> ModuleStats:
            record = self._records.get(id(module))
            stats = ModuleStats(name=name, class_name=type(module).__name__)
            if record is not None:
                stats.params = sum(self._param_numel.get(i, 0) for i in set(record.param_ids))
                stats.flops, stats.duration, stats.calls = record.flops, record.duration, record.calls
            stats.children = [build(child_name, child) for child_name, child in module.named_children()]
            if stats.calls == 0 and stats.children:  # a container (ModuleList) never called itself
                stats.flops = sum(c.flops for c in stats.children)
                stats.duration = sum(c.duration for c in stats.children)
            return stats

        return build("", self.model)

    # ------------------------------------------------------------------ printing
    def profile_text(self, profile_step: int = 1, module_depth: int = -1, top_modules: int = 1,
                     detailed: bool = True, step_times_ms: dict[str, float] | None = None,
                     run: dict[str, int] | None = None) -> str:
        """The profile as text. `step_times_ms` (the engine's forward / backward / comm / step timers
        over the profiled step) adds backward, step and iteration throughput; `run` adds world and
        batch sizes (taken from `ds_engine` when it is given)."""
        root = self.module_stats()
        total_flops, total_params = self.get_total_flops(), self.get_total_params()
        self.flops, self.macs, self.params = total_flops, total_flops // 2, total_params
        run = dict(run or {})
        if self.ds_engine is not None:
            run.setdefault("world size", self.ds_engine.world_size)
            run.setdefault("data parallel size", self.ds_engine.dp_world_size)
            run.setdefault("batch size per GPU", self.ds_engine.train_micro_batch_size_per_gpu())
            run.setdefault("gradient accumulation steps", self.ds_engine.gradient_accumulation_steps())
            run.setdefault("samples per step", self.ds_engine.train_batch_size())
        lines = ["", "-------------------------- Flops Profiler --------------------------",
                 f"Profile Summary at step {profile_step}:"]
        lines += [_LINE.format(f"{k}: ", v) for k, v in run.items()]
        lines += [_LINE.format("params per GPU: ", params_to_string(total_params)),
                  _LINE.format(f"fwd MACs per GPU ({root.calls or 1} forward calls): ",
                               macs_to_string(total_flops // 2)),
                  _LINE.format("fwd flops per GPU: ", number_to_string(total_flops))]
        times = step_times_ms or {}
        fwd = times["forward"] / 1e3 if "forward" in times else self._total_duration
        lines += [_LINE.format("fwd latency: ", duration_to_string(fwd)),
                  _LINE.format("fwd FLOPS per GPU = fwd flops per GPU / fwd latency: ",
                               flops_to_string(total_flops / fwd if fwd else 0.0))]
        achieved, basis = (total_flops / fwd if fwd else 0.0), "fwd flops / fwd latency"
        if "backward" in times and "step" in times:
            factor = 2 + self.recompute_fwd_factor
            bwd = (times["backward"] + times.get("comm", 0.0)) / 1e3
            step = times["step"] / 1e3
            iteration = fwd + bwd + step
            lines += [
                _LINE.format("bwd latency: ", duration_to_string(bwd)),
                _LINE.format(f"bwd FLOPS per GPU = {factor:g} * fwd flops per GPU / bwd latency: ",
                             flops_to_string(factor * total_flops / bwd if bwd else 0.0)),
                _LINE.format(f"fwd+bwd FLOPS per GPU = {factor + 1:g} * fwd flops per GPU / (fwd+bwd latency): ",
                             flops_to_string((factor + 1) * total_flops / (fwd + bwd) if fwd + bwd else 0.0)),
                _LINE.format("step latency: ", duration_to_string(step)),
                _LINE.format("iter latency: ", duration_to_string(iteration)),
                _LINE.format(f"FLOPS per GPU = {factor + 1:g} * fwd flops per GPU / iter latency: ",
                             flops_to_string((factor + 1) * total_flops / iteration if iteration else 0.0)),
            ]
            achieved, basis = ((factor + 1) * total_flops / iteration if iteration else 0.0), "FLOPS per GPU"
            if "samples per step" in run and iteration:
                lines.append(_LINE.format("samples/second: ", round(run["samples per step"] / iteration, 2)))
        name = device_name(self._device)
        peak = peak_tflops(name, self._dtype)
        dtype = str(self._dtype).replace("torch.", "")
        lines.append(_LINE.format(f"peak FLOPS per GPU ({name}, {dtype} dense): ",
                                  "unknown" if peak is None else flops_to_string(peak * 1e12)))
        util = mfu(achieved, name, self._dtype)
        lines.append(_LINE.format(f"MFU ({basis} / peak): ", "unknown" if util is None else f"{100 * util:.2f}%"))
        lines += ["", "----------------------------- Aggregated Profile per GPU -----------------------------"]
        lines += aggregated(root, module_depth, top_modules)
        if detailed:
            lines += ["", "------------------------------ Detailed Profile per GPU ------------------------------",
                      "Each module: params, % of total params, MACs, % of total MACs, fwd latency, % of total fwd "
                      "latency, fwd FLOPS (inclusive of its submodules; work outside submodules makes up the "
                      "difference)"]
            lines += module_tree(root)
        lines.append("------------------------------------------------------------------------------")
        return "\n".join(lines)

    def print_model_profile(self, profile_step: int = 1, module_depth: int = -1, top_modules: int = 1,
                            detailed: bool = True, output_file: str | None = None) -> None:
        """Log the profile (or write it to `output_file`); a no-op unless profiling is started."""
        if not self.started:
            return
        emit_profile(self.profile_text(profile_step, module_depth, top_modules, detailed), output_file)


def emit_profile(text: str, output_file: str | None) -> None:
    """Write `text` to `output_file` (directories created), or log it when no file is given."""
    if output_file:
        os.makedirs(os.path.dirname(os.path.abspath(output_file)), exist_ok=True)
        with open(output_file, "w") as f:
            f.write(text + "\n")
    else:
        logger.info("%s", text)


def get_model_profile(model: torch.nn.Module, input_shape: tuple | None = None, args: Sequence = (),
                      kwargs: dict | None = None, print_profile: bool = True, detailed: bool = True,
                      module_depth: int = -1, top_modules: int = 1, warm_up: int = 1, as_string: bool = True,
                      output_file: str | None = None, ignore_modules: Sequence[type] | None = None,
                      mode: str = "forward"):
    """Profile one forward (`mode='forward'`) or one `model.generate` call (`mode='generate'`) after
    `warm_up` unprofiled ones; returns `(flops, macs, params)`, as strings when `as_string`.

    The input is `args` / `kwargs`, or with `input_shape` one tensor of ones of that shape in the
    model's dtype on its device. The model is put in eval mode and run without autograd."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"get_model_profile: model must be a torch.nn.Module (got {type(model).__name__})")
    if mode not in ("forward", "generate"):
        raise ValueError(f"get_model_profile: mode must be 'forward' or 'generate' (got {mode!r})")
    kwargs = dict(kwargs or {})
    args = list(args)
    if input_shape is not None:
        if not isinstance(input_shape, tuple) or not input_shape:
            raise ValueError(f"get_model_profile: input_shape must be a non-empty tuple (got {input_shape!r})")
        device, dtype = _model_device_dtype(model)
        args = [torch.ones(input_shape, dtype=dtype, device=device)]
    if not args and not kwargs:
        raise ValueError("get_model_profile: give input_shape, args or kwargs")
    run = model.generate if mode == "generate" else model
    prof = FlopsProfiler(model)
    model.eval()
    with torch.no_grad():
        for _ in range(warm_up):
            run(*args, **kwargs)
        prof.start_profile(ignore_list=ignore_modules)
        try:
            run(*args, **kwargs)
            flops, macs, params = prof.get_total_flops(), prof.get_total_macs(), prof.get_total_params()
            if print_profile:
                prof.print_model_profile(profile_step=warm_up, module_depth=module_depth, top_modules=top_modules,
                                         detailed=detailed, output_file=output_file)
        finally:
            prof.end_profile()
    if as_string:
        return number_to_string(flops), macs_to_string(macs), params_to_string(params)
    return flops, macs, params
