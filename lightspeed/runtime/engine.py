"""The training engine: orchestration only.

Owns the training-step protocol (forward, backward with loss scaling and accumulation, step at the
accumulation boundary, LR schedule, counters, logging) and wires the pieces built by `initialize()`.
Must not: know how gradients are reduced or where state lives (the sharding strategy does), nor
branch on the ZeRO stage.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch

from lightspeed._utils.accelerator import get_accelerator
from lightspeed._utils.logging import get_logger
from lightspeed._utils.progress import format_duration
from lightspeed._utils.sizes import human_bytes
from lightspeed._utils.timers import ThroughputTimer, Timers
from lightspeed.checkpoint.writer import CheckpointWriter, options_from_config
from lightspeed.comm import heartbeat
from lightspeed.comm.collectives import Communicator
from lightspeed.comm.groups import ParallelGroups
from lightspeed.comm.init import timeout_seconds
from lightspeed.monitor import MonitorMaster
from lightspeed.parallel.experts.names import ExpertNames, expert_names
from lightspeed.parallel.placement import PlacementTable, keyed_placements
from lightspeed.optim.schedules import scheduled_steps
from lightspeed.precision.autocast import AutocastSettings
from lightspeed.precision.policy import PrecisionPolicy
from lightspeed.profiling.step_profiler import StepProfiler
from lightspeed.runtime.autotuning_probe import AutotuningProbe
from lightspeed.runtime.dataloader import build_dataloader
from lightspeed.runtime.engine_accessors import EngineAccessors, EngineSettingAccessors
from lightspeed.runtime.engine_checkpoints import EngineCheckpoints
from lightspeed.runtime.errors import UsageAssertionError
from lightspeed.runtime.module_passthrough import ModulePassthrough
from lightspeed.runtime.strategy import (DestroyedStrategy, ShardingStrategy, strategy_partitions_gradients,
                                         strategy_places_params)

logger = get_logger(__name__)


class LightspeedEngine(EngineCheckpoints, EngineAccessors, EngineSettingAccessors, ModulePassthrough,
                       torch.nn.Module):
    """DeepSpeed's engine API: `engine(*inputs)`, `engine.backward(loss)`, `engine.step()`, checkpoints;
    a name the engine lacks is the wrapped module's (module_passthrough.py)."""

    def __init__(self, *, module: torch.nn.Module, config, groups: ParallelGroups, comm: Communicator,
                 device: torch.device, policy: PrecisionPolicy, strategy: ShardingStrategy,
                 optimizer: torch.optim.Optimizer | None, lr_scheduler: Any, loss_scaler: Any,
                 monitor: MonitorMaster, step_profiler: StepProfiler, placements: PlacementTable | None = None):
        super().__init__()
        self.module = module
        self.config = config
        self.groups = groups
        self._autocast = AutocastSettings.from_config(config, device.type)  # torch_autocast: the forward's
        topology = groups.topology
        tp_size = topology.size("tp") if topology is not None else 1
        # the tensor-parallel group, for whole-tensor saves and the checkpoint layout (None without tp)
        self._tp_comm = Communicator(topology.group("tp"), tp_size) if tp_size > 1 else None
        # where each parameter lives on the mesh (parallel/placement.py), saved with the fragments
        self.placements = placements if placements is not None else PlacementTable.for_module(module)
        self.comm = comm
        pp_size = topology.size("pp") if topology is not None else 1
        # the pipeline group, for the stages' module-state files of a mesh save (None without pp)
        self._pp_comm = Communicator(topology.group("pp"), pp_size) if pp_size > 1 else None
        # the experts' names in a checkpoint (parallel/experts/names.py), and the ep group that gathers
        # their module state for a save (None without expert parallelism)
        ep_size = topology.size("ep") if topology is not None else 1
        self._expert_names = expert_names(module, topology.rank("ep") if ep_size > 1 else 0) \
            if topology is not None else ExpertNames((), ())  # no mesh: no expert was placed
        self._ep_comm = Communicator(topology.group("ep"), ep_size) if ep_size > 1 else None
        # a save over the whole mesh (engine_checkpoint.py's layout) when a model dim splits the model, or
        # some parameter (an expert) is reduced over another group than data parallelism
        self._mesh_save = self._tp_comm is not None or self._pp_comm is not None or bool(self._expert_names) \
            or bool(keyed_placements(self.placements))
        # the ranks one checkpoint is committed over: the data-parallel ranks, or every rank of the mesh
        mesh_group = "world" if self._pp_comm is not None else "tp_dp_sp"
        self._ckpt_comm = Communicator(topology.group(mesh_group), topology.size(mesh_group)) \
            if self._mesh_save else comm
        self._ckpt_rank = topology.rank(mesh_group) if self._mesh_save else groups.seq_dp_rank
        self.device = device
        self.policy = policy
        self.strategy = strategy
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.loss_scaler = loss_scaler
        self.global_steps = 0
        self.global_samples = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self._boundary_override: bool | None = None
        # managed_gradient_accumulation false (Note: [unmanaged accumulation]): step() is the boundary
        self._managed = bool(config.managed_gradient_accumulation)
        self._in_step = False
        self._unmanaged_backwards = 0  # backwards since the last step(), for global_samples
        self._inside_no_sync = False
        self._step_applied = False
        self._grad_norm: torch.Tensor | None = None
        self._loss_sum: torch.Tensor | None = None
        self._loss_count = 0
        self._last_print = (time.perf_counter(), 0)
        self._total_steps: int | None = None
        self._memory_logged = False
        self._compiled = False
        self.monitor = monitor  # DeepSpeed's engine.monitor: write_events([(name, value, step)])
        self.step_profiler = step_profiler
        self.flops_profiler = step_profiler.profiler  # DeepSpeed's engine.flops_profiler (None when off)
        # DeepSpeed's rule: the flops profiler turns the wall-clock breakdown on
        self.timers = Timers(device, enabled=bool(config.wall_clock_breakdown or config.flops_profiler.enabled))
        self.tput_timer = ThroughputTimer(config.timers.throughput, self.train_batch_size(), device)
        self.comm.stats.reset()  # per-step volume counts training traffic, not initialize()'s broadcast
        self.training_dataloader = None
        self._checkpoint_writer = CheckpointWriter(options_from_config(config.checkpoint, timeout_seconds()))
        # `checkpoint.writer.snapshot_pool: startup`: sized now, and topped up once the first applied step
        # has created the optimizer state (torch optimizers create theirs lazily)
        self._reserve_after_step = self._checkpoint_writer.options.snapshot_pool == "startup"
        if self._reserve_after_step:
            self._reserve_snapshot_pool()
        # `autotuning.enabled`: this run is one autotuning experiment (autotuning_probe.py)
        self._autotuning = AutotuningProbe(self) if config.autotuning.enabled else None

    # ------------------------------------------------------------------ configuration accessors
    def train_batch_size(self) -> int:
        return self.config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def zero_optimization_stage(self) -> int:
        return self.config.zero_optimization.stage

    def fp16_enabled(self) -> bool:
        return bool(self.config.fp16.enabled)

    def bfloat16_enabled(self) -> bool:
        return bool(self.config.bf16.enabled)

    def gradient_clipping(self) -> float:
        return float(self.config.gradient_clipping)

    def steps_per_print(self) -> int | None:
        return self.config.steps_per_print  # None: never

    def zero_optimization_partition_gradients(self) -> bool:
        return strategy_partitions_gradients(self.config)

    def zero_optimization_partition_weights(self) -> bool:
        return strategy_places_params(self.config)

    def sparse_gradients_enabled(self) -> bool:
        return bool(self.config.sparse_gradients)

    @property
    def sparse_tensor_module_names(self) -> set[str]:
        """DeepSpeed's set of the weights whose gradients are exchanged sparse: each Embedding's and
        EmbeddingBag's `<module>.weight` when `sparse_gradients` is on, else empty."""
        if not self.sparse_gradients_enabled():
            return set()
        return {f"{name}.weight" for name, m in self.module.named_modules()
                if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag))}

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """`zero_optimization.stage3_gather_16bit_weights_on_model_save`: whether a whole 16-bit model may
        be gathered to save it (read by accelerate and the HF Trainer before `save_16bit_model`)."""
        return bool(self.config.zero_optimization.stage3_gather_16bit_weights_on_model_save)

    @property
    def global_rank(self) -> int:
        return self.groups.world_rank

    @property
    def local_rank(self) -> int:
        return self.groups.local_rank

    @property
    def world_size(self) -> int:
        return self.groups.world_size

    @property
    def dp_world_size(self) -> int:
        """Data-parallel replicas (ranks of one sequence-parallel group count once)."""
        return self.groups.dp_world_size

    @property
    def seq_dp_world_size(self) -> int:
        """Ranks ZeRO reduces gradients and partitions state over: dp x sp."""
        return self.groups.seq_dp_world_size

    @property
    def sequence_parallel_size(self) -> int:
        return self.groups.sp_world_size

    @property
    def seq_parallel_group(self):
        """The Ulysses group (None without sequence parallelism), DeepSpeed's engine attribute."""
        return self.groups.sp_group if self.groups.sp_world_size > 1 else None

    def set_total_steps(self, num_steps: int | None) -> None:
        """How many optimizer steps this run takes (None: unknown), for the ETA in the step log line.
        Without it the LR scheduler's own total is used (WarmupDecayLR / WarmupCosineLR
        `total_num_steps`, torch's OneCycleLR `total_steps`)."""
        if num_steps is not None and (isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1):
            raise ValueError(f"set_total_steps: num_steps must be a positive integer or None (got {num_steps!r})")
        self._total_steps = num_steps

    @property
    def total_steps(self) -> int | None:
        """The run's number of optimizer steps, when known (see `set_total_steps`)."""
        return self._total_steps if self._total_steps is not None else scheduled_steps(self.lr_scheduler)

    # ------------------------------------------------------------------ training step
    def is_gradient_accumulation_boundary(self) -> bool:
        """True when the current micro-step is the last of its accumulation window (with
        managed_gradient_accumulation false: only while step() runs)."""
        if not self._managed:
            return self._in_step
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """Override the boundary computed from the step counter (None restores it)."""
        if not self._managed:
            raise UsageAssertionError("set_gradient_accumulation_boundary() is not supported with "
                                      "managed_gradient_accumulation false: step() is the boundary")
        self._boundary_override = is_boundary

    @contextlib.contextmanager
    def no_sync(self):
        """Inside, backward accumulates gradients locally without reducing them, even at the
        accumulation boundary; the first backward at a boundary outside reduces everything accumulated.
        As DeepSpeed: refused when gradients are partitioned (ZeRO stages 2 and 3, which reduce every
        micro-step) and not re-entrant; `step()` at a boundary inside raises (gradients unreduced)."""
        if self.zero_optimization_partition_gradients():
            raise UsageAssertionError(f"no_sync context manager is incompatible with gradient partitioning logic of "
                                      f"ZeRO stage {self.zero_optimization_stage()} (gradients are reduce-scattered "
                                      "every micro-step)")
        if self._inside_no_sync:
            raise UsageAssertionError("no_sync context manager reentry is unsupported (no_sync() is not re-entrant)")
        self._inside_no_sync = True
        try:
            yield
        finally:
            self._inside_no_sync = False

    def _as_forward(self, method):
        """A `forward_*` method of the module, reached through the engine (module_passthrough.py's Note:
        [forward methods]), run as a forward by the strategy."""
        return self.strategy.forward_method(method)

    def forward(self, *inputs, **kwargs):
        self.tput_timer.start()
        self.timers.start("forward")
        with self._autocast.forward_context() if self._autocast is not None else contextlib.nullcontext():
            if self._compiled and self.strategy.needs_eager_forward():
                with torch.compiler.set_stance("force_eager"):
                    out = self.module(*inputs, **kwargs)
            elif self._autotuning is not None:
                out = self._autotuning.forward(lambda: self.module(*inputs, **kwargs), inputs, kwargs)
            else:
                out = self.module(*inputs, **kwargs)
        self.timers.stop("forward")
        return out

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backward of `loss` (divided by the accumulation steps and multiplied by the loss scale)."""
        if not torch.is_tensor(loss) or loss.numel() != 1:
            raise ValueError("engine.backward expects a scalar loss tensor")
        detached = loss.detach().float()
        self._loss_sum = detached if self._loss_sum is None else self._loss_sum + detached
        self._loss_count += 1
        self.monitor.record_loss(detached, self.global_samples)
        self.timers.start("backward")
        self._unmanaged_backwards += not self._managed
        if scale_wrt_gas and self.gradient_accumulation_steps() > 1:
            loss = loss / self.gradient_accumulation_steps()
        if self.loss_scaler is not None:
            loss = self.loss_scaler.scale_loss(loss)  # in fp32: an fp16 loss times 2**16 could overflow
        # the speculative offloaded step unscales during backward
        self.strategy.note_loss_scale(self.loss_scaler.loss_scale if self.loss_scaler is not None else None)
        self.strategy.backward_start(self.is_gradient_accumulation_boundary() and not self._inside_no_sync)
        loss.backward(retain_graph=retain_graph)
        self.strategy.backward_end()
        self.timers.stop("backward")
        return loss

    def step(self, lr_kwargs: dict | None = None) -> None:
        """Optimizer step at the accumulation boundary (skipped on fp16 overflow); a no-op otherwise.
        With managed_gradient_accumulation false every call is the boundary."""
        if not self._managed:
            self._in_step = True
            try:
                self._unmanaged_reduce()
                self._step(lr_kwargs)
            finally:
                self._in_step = False
            return
        self._step(lr_kwargs)

    def _unmanaged_reduce(self) -> None:
        """Note: [unmanaged accumulation] With managed_gradient_accumulation false (DeepSpeed's
        engine.step), every backward accumulates locally and step() is the boundary: stages 0 and 1
        reduce the accumulated gradients here, stages 2 and 3 reduced each backward's already."""
        if self._inside_no_sync:
            raise UsageAssertionError("It is illegal to call Engine.step() inside no_sync context manager: the "
                                      "gradients were not reduced")
        if not strategy_partitions_gradients(self.config):
            self.strategy.backward_start(True)  # a boundary backward that reaches no parameter:
            self.strategy.backward_end()  # every bucket of accumulated gradients is reduced

    def _step(self, lr_kwargs: dict | None) -> None:
        boundary = self.is_gradient_accumulation_boundary()
        if boundary:
            self._checkpoint_writer.wait_snapshot()  # a background save's copies may still read the state
            if self._inside_no_sync:
                raise UsageAssertionError("It is illegal to call Engine.step() inside no_sync context manager at an "
                                          "accumulation boundary: the gradients were not reduced; leave no_sync() "
                                          "for the boundary micro-step's backward")
            self.timers.start("comm")
            self.strategy.wait_gradients()
            self.timers.stop("comm")
            self.timers.start("step")
            scale = self.loss_scaler.loss_scale if self.loss_scaler is not None else None
            check = scale is not None or (self.bfloat16_enabled() and bool(self.config.bf16.check_grad_overflow))
            result = self.strategy.step(scale, self.gradient_clipping(), check_overflow=check)
            self._step_applied = result.applied
            if self.loss_scaler is not None:
                self.loss_scaler.update_scale(not result.applied)
            if result.applied:
                self._grad_norm = result.grad_norm
                if self.lr_scheduler is not None:
                    self.lr_scheduler.step(**(lr_kwargs or {}))
            else:
                self.skipped_steps += 1
            self.strategy.zero_grad()
            self.timers.stop("step")
            self.global_steps += 1
            if self._managed:
                self.global_samples += self.train_batch_size()
            else:  # the micro-batches actually run since the last step (DeepSpeed's count)
                self.global_samples += self.train_batch_size() // self.gradient_accumulation_steps() \
                    * self._unmanaged_backwards
                self._unmanaged_backwards = 0
            step_ms = self.timers.step_ms()
            self.monitor.after_step(global_samples=self.global_samples, lr=self.get_lr(), step_ms=step_ms,
                                    loss_scale=self.loss_scale if self.loss_scaler is not None else None)
            self.step_profiler.after_step(self.global_steps, step_ms)
            if self._reserve_after_step and result.applied:
                self._reserve_after_step = False
                self._reserve_snapshot_pool()
            self._after_step()
            if self._autotuning is not None:
                self._autotuning.after_step()  # ends the process after the profile window
        self.tput_timer.stop(global_step=boundary)
        self.micro_steps += 1

    def zero_grad(self) -> None:
        self.strategy.zero_grad()

    def was_step_applied(self) -> bool:
        return self._step_applied

    def get_lr(self) -> list[float]:
        if self.optimizer is None:
            return []
        return [group["lr"] for group in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """L2 norm of the unscaled gradients of the last applied step, before clipping."""
        return None if self._grad_norm is None else float(self._grad_norm)

    @property
    def loss_scale(self) -> float:
        return float(self.loss_scaler.loss_scale) if self.loss_scaler is not None else 1.0

    def memory_breakdown(self) -> dict[str, dict[str, int]]:
        """This rank's bytes of lp_params, master_params, grads and optimizer_state, by where they live:
        the device type ("cuda", "cpu": host memory, where offload keeps them) or "nvme" (swap files).
        "grads" is what a backward allocates (stages 1-3 release it between steps)."""
        return self.strategy.memory_breakdown()

    def unshard(self, module: torch.nn.Module | None = None) -> None:
        """Gather the parameters of `module` (None: the whole model) once and keep them gathered, so
        forwards (generation, exports) run with no gather or release each (FSDP2's `unshard`; ZeRO-3
        only, a no-op at stages 0-2). A collective. `step()` is refused until `reshard()`."""
        self.strategy.unshard(module)

    def reshard(self, module: torch.nn.Module | None = None) -> None:
        """Release what `unshard` gathered under `module` (None: all) back to the shards."""
        self.strategy.reshard(module)

    def unsharded(self, module: torch.nn.Module | None = None):
        """Context manager: `unshard(module)`, yielding the module (None: the whole model); resharded on
        exit, also on an exception."""
        return self.strategy.unsharded(module)

    def empty_partition_cache(self) -> None:
        """DeepSpeed's: release the parameters ZeRO stage 3 keeps gathered between forwards (persistent
        ones included; gathered again on use) and the allocator's cache; a no-op at stages 0-2."""
        self.strategy.empty_partition_cache()
        get_accelerator().empty_cache()

    def destroy(self) -> None:
        """DeepSpeed's `engine.destroy()`: wait for a background checkpoint save (a collective, as every
        rank calls destroy) and free its host snapshot pool, finish the work in flight and remove the
        hooks the engine put on the model
        and its parameters. The engine cannot be used afterwards: calling it or its training methods
        raises RuntimeError (the model itself stays usable, with stage 3's parameters still sharded).
        A second call does nothing."""
        if isinstance(self.strategy, DestroyedStrategy):
            return
        self._checkpoint_writer.close(self._ckpt_comm)  # waits for a background save, frees the snapshot pool
        self.strategy.remove_hooks()
        self.strategy = DestroyedStrategy()
        self.register_forward_pre_hook(_destroyed)

    # ------------------------------------------------------------------ logging
    def _after_step(self) -> None:
        if not self._memory_logged:
            self._memory_logged = True
            parts = [f"{dev}: " + ", ".join(f"{k} {human_bytes(v)}" for k, v in sorted(cats.items()))
                     for dev, cats in self.memory_breakdown().items()]
            logger.info("memory after first step (this rank): %s", "; ".join(parts))
        if self.steps_per_print() is None or self.global_steps % self.steps_per_print() != 0:
            return
        now = time.perf_counter()
        then, samples_then = self._last_print
        self._last_print = (now, self.global_samples)
        steps = self.steps_per_print()
        loss = float(self._loss_sum / self._loss_count) if self._loss_count else float("nan")
        self._loss_sum, self._loss_count = None, 0
        norm = self.get_global_grad_norm()
        lrs = ", ".join(f"{lr:.4g}" for lr in self.get_lr())
        msg = (f"step {self.global_steps}: loss {loss:.4f} lr [{lrs}] loss_scale {self.loss_scale:g} "
               f"grad_norm {norm if norm is None else f'{norm:.4f}'} "
               f"samples/s {(self.global_samples - samples_then) / max(now - then, 1e-9):.1f} "
               f"ms/step {(now - then) * 1e3 / steps:.1f}")
        if self.skipped_steps:
            msg += f" skipped_steps {self.skipped_steps}"
        total = self.total_steps
        if total is not None and total > self.global_steps:
            msg += f" eta {format_duration((total - self.global_steps) * (now - then) / steps)}"
        logger.info(msg)
        if self.timers.enabled:
            times = self.timers.elapsed_ms()
            parts = " ".join(f"{k} {v / steps:.2f}" for k, v in sorted(times.items()))
            stats = self.comm.stats
            by_op = ", ".join(f"{op} {human_bytes(n / steps)}" for op, n in sorted(stats.bytes.items()) if n)
            comm_bytes = stats.total_bytes() / steps
            stats.reset()
            logger.info("time per step (ms): %s | communication %s per step%s", parts, human_bytes(comm_bytes),
                        f" ({by_op})" if by_op else "")

    # ------------------------------------------------------------------ data
    def deepspeed_io(self, dataset, batch_size: int | None = None, route=None, pin_memory: bool = True,
                     data_sampler=None, collate_fn=None, num_local_io_workers: int | None = None):
        return build_dataloader(dataset, batch_size=batch_size or self.train_micro_batch_size_per_gpu(),
                                dp_rank=self.groups.dp_rank, dp_world_size=self.groups.dp_world_size,
                                collate_fn=collate_fn, data_sampler=data_sampler,
                                num_workers=num_local_io_workers or 0,
                                drop_last=bool(getattr(self.config, "dataloader_drop_last", False)),
                                pin_memory=pin_memory and self.device.type == "cuda")

    def compile(self, backend=None, compile_kwargs: dict | None = None, schedule=None,
                compiled_autograd_enabled: bool = False) -> None:
        """torch.compile the module in place, region by region, with the strategy's hooks outside every
        compiled graph (DeepSpeed's `engine.compile`; accelerate calls it with `backend`,
        `compile_kwargs`). `backend`: a torch.compile backend name or callable (default: the
        accelerator's, "inductor"); `compile_kwargs`: torch.compile's other arguments (mode, fullgraph,
        dynamic, options). The strategy names the regions: the whole module at stages 0-2 (a PipelineModule's
        layers, since the pipeline schedule calls them and never the module), and at stage 3 each
        innermost unit (Note: compiled regions in zero/stage3/units.py). A second call
        logs a warning and changes nothing. `schedule` (DeepCompile's pass schedule) and
        `compiled_autograd_enabled` are refused: DeepCompile and compiled autograd are not built."""
        if schedule is not None:
            raise NotImplementedError("engine.compile(schedule=...): DeepCompile's pass schedule (compile.deepcompile) "
                                      "is not implemented")
        if compiled_autograd_enabled:
            raise NotImplementedError("engine.compile(compiled_autograd_enabled=True): compiled autograd is not "
                                      "implemented (the backward runs the compiled regions' backward graphs)")
        if compile_kwargs is not None and not isinstance(compile_kwargs, dict):
            raise TypeError(f"engine.compile: compile_kwargs must be a dict (got {type(compile_kwargs).__name__})")
        kwargs = dict(compile_kwargs or {})
        if "backend" in kwargs:
            raise ValueError("engine.compile: give the backend as `backend`, not inside compile_kwargs")
        if self._compiled:
            logger.warning("engine.compile(): the module is already compiled; nothing changed")
            return
        backend = backend or get_accelerator().get_compile_backend() or "inductor"
        # a PipelineModule is never called whole (the schedule runs its layers): its layers are the regions
        regions = [r for region in self.strategy.compile_regions()
                   for r in (list(region.children()) if getattr(region, "holds_layers", False) else [region])]
        heartbeat.pause_during_compilation()  # compiling ranks are not reported as stalled
        for region in regions:
            region.compile(backend=backend, **kwargs)  # in place: hooks and parameters stay as they are
        self.strategy.after_compile(regions)
        self._compiled = True
        logger.info("compiled %d region(s) with backend %s", len(regions),
                    backend if isinstance(backend, str) else getattr(backend, "__name__", repr(backend)))

    @property
    def is_compiled(self) -> bool:
        """Whether `compile()` (or `compile.enabled` in the config) compiled the module."""
        return self._compiled



def _destroyed(engine, args):
    raise RuntimeError("this engine was destroyed (engine.destroy()) and cannot be called any more; build a new "
                       "one with initialize()")
