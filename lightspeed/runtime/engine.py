"""The training engine: orchestration only.

Owns the training-step protocol (forward, backward with loss scaling and accumulation, step at the
accumulation boundary, LR schedule, counters, logging) and wires the pieces built by `initialize()`.
Must not: know how gradients are reduced or where state lives (the sharding strategy does), nor
branch on the ZeRO stage.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

import torch

from lightspeed._utils.accelerator import get_accelerator
from lightspeed._utils.logging import get_logger
from lightspeed._utils.progress import format_duration
from lightspeed._utils.sizes import human_bytes
from lightspeed._utils.timers import ThroughputTimer, Timers
from lightspeed.checkpoint import engine_checkpoint
from lightspeed.checkpoint.atomic import atomic_torch_save
from lightspeed.checkpoint.deepspeed_writer import module_entry_names, save_as_deepspeed
from lightspeed.checkpoint.errors import CheckpointError
from lightspeed.checkpoint.integrity import verification
from lightspeed.checkpoint.module_state import check_module_state
from lightspeed.checkpoint.rng import get_rng_state, set_rng_state
from lightspeed.checkpoint.tensor_parallel import open_at_tp_size, tp_record
from lightspeed.checkpoint.universal import apply_training_state, read_training_state
from lightspeed.zero.fragments import first_names
from lightspeed.checkpoint.writer import CheckpointWriter, options_from_config
from lightspeed.comm import heartbeat
from lightspeed.comm.collectives import Communicator
from lightspeed.comm.groups import ParallelGroups
from lightspeed.comm.init import timeout_seconds
from lightspeed.monitor import MonitorMaster
from lightspeed.parallel.placement import DATA_PARALLEL, PlacementTable
from lightspeed.parallel.tensor_parallel import gather_tp_state, tp_layouts
from lightspeed.optim.schedules import scheduled_steps
from lightspeed.precision.policy import PrecisionPolicy
from lightspeed.profiling.step_profiler import StepProfiler
from lightspeed.runtime.dataloader import build_dataloader
from lightspeed.runtime.errors import UsageAssertionError
from lightspeed.runtime.module_passthrough import ModulePassthrough
from lightspeed.runtime.strategy import (DestroyedStrategy, ShardingStrategy, strategy_partitions_gradients,
                                         strategy_places_params)

logger = get_logger(__name__)


class LightspeedEngine(ModulePassthrough, torch.nn.Module):
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
        topology = groups.topology
        tp_size = topology.size("tp") if topology is not None else 1
        # the tensor-parallel group, for whole-tensor saves and the checkpoint layout (None without tp)
        self._tp_comm = Communicator(topology.group("tp"), tp_size) if tp_size > 1 else None
        # where each parameter lives on the mesh (parallel/placement.py), saved with the fragments
        self.placements = placements if placements is not None else PlacementTable.for_module(module)
        self.comm = comm
        # the ranks one checkpoint is committed over: the data-parallel ranks, or every rank of the mesh
        self._ckpt_comm = comm if self._tp_comm is None else Communicator(topology.group("tp_dp_sp"),
                                                                          topology.size("tp_dp_sp"))
        self._ckpt_rank = groups.seq_dp_rank if self._tp_comm is None else topology.rank("tp_dp_sp")
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
        """True when the current micro-step is the last of its accumulation window."""
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """Override the boundary computed from the step counter (None restores it)."""
        self._boundary_override = is_boundary

    @contextlib.contextmanager
    def no_sync(self):
        """Inside, backward accumulates gradients locally without reducing them, even at the
        accumulation boundary; the first backward at a boundary outside reduces everything accumulated.
        As DeepSpeed: refused when gradients are partitioned (ZeRO stages 2 and 3, which reduce every
        micro-step) and not re-entrant; `step()` at a boundary inside raises (gradients unreduced)."""
        if self.zero_optimization_partition_gradients():
            raise UsageAssertionError(f"no_sync() is incompatible with the gradient partitioning of ZeRO stage "
                                      f"{self.zero_optimization_stage()} (gradients are reduce-scattered every "
                                      "micro-step)")
        if self._inside_no_sync:
            raise UsageAssertionError("no_sync() is not re-entrant")
        self._inside_no_sync = True
        try:
            yield
        finally:
            self._inside_no_sync = False

    def forward(self, *inputs, **kwargs):
        self.tput_timer.start()
        self.timers.start("forward")
        if self._compiled and self.strategy.needs_eager_forward():
            with torch.compiler.set_stance("force_eager"):
                out = self.module(*inputs, **kwargs)
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
        if scale_wrt_gas and self.gradient_accumulation_steps() > 1:
            loss = loss / self.gradient_accumulation_steps()
        if self.loss_scaler is not None:
            loss = self.loss_scaler.scale_loss(loss)  # in fp32: an fp16 loss times 2**16 could overflow
        self.strategy.backward_start(self.is_gradient_accumulation_boundary() and not self._inside_no_sync)
        loss.backward(retain_graph=retain_graph)
        self.strategy.backward_end()
        self.timers.stop("backward")
        return loss

    def step(self, lr_kwargs: dict | None = None) -> None:
        """Optimizer step at the accumulation boundary (skipped on fp16 overflow); a no-op otherwise."""
        boundary = self.is_gradient_accumulation_boundary()
        if boundary:
            self._checkpoint_writer.wait_snapshot()  # a background save's copies may still read the state
            if self._inside_no_sync:
                raise UsageAssertionError("engine.step() at an accumulation boundary inside no_sync(): the gradients "
                                          "were not reduced; leave no_sync() for the boundary micro-step's backward")
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
            self.global_samples += self.train_batch_size()
            step_ms = self.timers.step_ms()
            self.monitor.after_step(global_samples=self.global_samples, lr=self.get_lr(), step_ms=step_ms,
                                    loss_scale=self.loss_scale if self.loss_scaler is not None else None)
            self.step_profiler.after_step(self.global_steps, step_ms)
            if self._reserve_after_step and result.applied:
                self._reserve_after_step = False
                self._reserve_snapshot_pool()
            self._after_step()
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

    # ------------------------------------------------------------------ checkpoints
    @heartbeat.paused()  # file I/O: the stall clock waits (comm/heartbeat.py)
    def save_checkpoint(self, save_dir, tag: str | None = None, client_state: dict | None = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:
        """Write `save_dir/<tag>/` atomically (tag defaults to `global_step<N>`), then `latest`; with
        `checkpoint.writer.decoupled` from a host snapshot in the background (see `wait_checkpoint`)."""
        tag = f"global_step{self.global_steps}" if tag is None else str(tag)
        keyed = sorted(n for n, p in self.placements.items() if p.reduced_over != DATA_PARALLEL)
        if keyed:  # their fragments repeat names across the ranks that hold other experts
            raise NotImplementedError(f"save_checkpoint: parameters reduced over another group than data parallelism "
                                      f"(expert parallelism: {keyed[0]}, ...) cannot be saved yet")
        engine_checkpoint.check_save_agreement(save_dir, tag, Communicator(None, self.world_size),
                                               self.config.checkpoint.tag_validation)
        module_state = self.strategy.module_state_dict()
        frozen: set[str] = set()
        if exclude_frozen_parameters:
            frozen = {n for n, p in self.module.named_parameters() if not p.requires_grad}
            module_state = {k: v for k, v in module_state.items() if k not in frozen}
        shared = {
            "excluded_frozen_parameters": sorted(frozen),
            "module": module_state,
            "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
            "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler is not None else None,
            "counters": {"global_steps": self.global_steps, "global_samples": self.global_samples,
                         "micro_steps": self.micro_steps, "skipped_steps": self.skipped_steps},
            "client_state": dict(client_state or {}),
            "zero_stage": self.zero_optimization_stage(),
            "dp_world_size": self.seq_dp_world_size,  # the ranks that wrote shards (dp x sp)
        }
        shared["buffer_names"], shared["frozen_param_names"] = module_entry_names(self.module)
        strategy_state = self.strategy.state_dict()
        replicated = self.strategy.state_is_replicated
        if self._tp_comm is not None:  # one tag for the whole mesh (engine_checkpoint.py's layout)
            # collective over tp (every rank calls it); only the rank that writes the model file keeps them
            module_state = self._whole_tensors(module_state, keep=self._ckpt_rank == 0)
            shared["module"] = module_state
            shared["mesh"] = {"tp": self._tp_comm.world_size, "dp_sp": self.seq_dp_world_size}
            names = {entry[0] for entry in strategy_state.get("fragments", ())}
            strategy_state = {**strategy_state, "mesh_coords": {"tp": self._tp_comm.rank},
                              "mesh_rank": self._ckpt_rank, "mesh_size": self._ckpt_comm.world_size,
                              "placements": {n: self.placements[n].as_record() for n in sorted(names)}}
            if replicated and self.groups.seq_dp_rank != 0:  # the same state as dp rank 0 of its tp column
                strategy_state = {**strategy_state, "fragments": [], "owners": [], "owner_groups": [], "state": [],
                                  "placements": {}}
            replicated = False
        engine_checkpoint.save(save_dir, tag, shared=shared, strategy_state=strategy_state,
                               strategy_replicated=replicated, comm=self._ckpt_comm,
                               dp_rank=self._ckpt_rank, save_latest=save_latest,
                               writer=self._checkpoint_writer)
        if self.config.checkpoint.format == "deepspeed":  # lightspeed's tag, converted in place by rank 0
            self._checkpoint_writer.wait(self._ckpt_comm)
            save_as_deepspeed(save_dir, tag, comm=self._ckpt_comm, rank=self._ckpt_rank,
                              stage=self.zero_optimization_stage(), world_size=self.seq_dp_world_size,
                              sub_group_size=self.config.zero_optimization.sub_group_size)
        return True

    def _tp_record(self) -> dict:
        return tp_record(self.module, self._tp_comm.world_size, self._tp_comm.rank)

    def _whole_tensors(self, state: dict, keep: bool = True) -> dict:
        """`state` with tensor-parallel slices gathered into whole tensors (collective over the tp group);
        with `keep` False this rank contributes its slices and gets `state` back."""
        if self._tp_comm is None:
            return state
        return gather_tp_state(state, tp_layouts(self.module), self._tp_comm, keep=keep)

    @heartbeat.paused()  # rank 0 copies the whole model to the host while the others go on
    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict | None:
        """The whole module state_dict gathered from the ZeRO-3 shards, parameters in the training dtype
        on CPU, on global rank 0; None on the other ranks. A collective: every rank must call it.
        ValueError when the parameters are not partitioned (DeepSpeed's rule: only for ZeRO-3)."""
        if not self.zero_optimization_partition_weights():
            raise ValueError("_zero3_consolidated_16bit_state_dict requires ZeRO stage 3 "
                             f"(got stage {self.zero_optimization_stage()})")
        state = self.strategy.module_state_dict()
        if self.global_rank != 0:
            return None
        if exclude_frozen_parameters:
            frozen = {n for n, p in self.module.named_parameters() if not p.requires_grad}
            state = {k: v for k, v in state.items() if k not in frozen}
        return {k: v.detach().cpu() if torch.is_tensor(v) else v for k, v in state.items()}

    def compile(self, backend=None, compile_kwargs: dict | None = None, schedule=None,
                compiled_autograd_enabled: bool = False) -> None:
        """torch.compile the module in place, region by region, with the strategy's hooks outside every
        compiled graph (DeepSpeed's `engine.compile`; accelerate calls it with `backend`,
        `compile_kwargs`). `backend`: a torch.compile backend name or callable (default: the
        accelerator's, "inductor"); `compile_kwargs`: torch.compile's other arguments (mode, fullgraph,
        dynamic, options). The strategy names the regions: the whole module at stages 0-2, and at
        stage 3 each innermost unit (Note: compiled regions in zero/stage3/units.py). A second call
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
        regions = self.strategy.compile_regions()
        heartbeat.pause_during_compilation()  # compiling ranks are not reported as stalled
        for region in regions:
            region.compile(backend=backend, **kwargs)  # in place: hooks and parameters stay as they are
        self._compiled = True
        logger.info("compiled %d region(s) with backend %s", len(regions),
                    backend if isinstance(backend, str) else getattr(backend, "__name__", repr(backend)))

    @property
    def is_compiled(self) -> bool:
        """Whether `compile()` (or `compile.enabled` in the config) compiled the module."""
        return self._compiled

    def _reserve_snapshot_pool(self) -> None:
        """Size a background save's host pool from the state a save snapshots (collective at ZeRO-3 and
        with tensor parallelism, like a save). client_state tensors are not known here: a save with
        some adds them to the pool."""
        module_state = self._whole_tensors(self.strategy.module_state_dict())
        self._checkpoint_writer.reserve({"module": module_state, "strategy": self.strategy.state_dict(),
                                         "rng": get_rng_state()})

    def wait_checkpoint(self) -> None:
        """Wait for a background (`checkpoint.writer.decoupled`) save to be complete on every rank;
        raises its error, if any rank's failed. Collective; returns at once when no save is pending."""
        self._checkpoint_writer.wait(self._ckpt_comm)

    @heartbeat.paused()  # rank 0 writes the file while the others wait at the barrier
    def save_16bit_model(self, save_dir, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """Write the whole module state_dict (parameters in the training dtype) to
        `save_dir/save_filename`; global rank 0 writes. A partitioned strategy gathers the parameters
        only with `zero_optimization.stage3_gather_16bit_weights_on_model_save` (DeepSpeed's rule):
        otherwise nothing is written and False is returned. Every rank must call it."""
        path = os.path.join(save_dir, save_filename)
        # strategies that hold whole parameters (stages 0-2) can always save; stage 3 says whether it may gather
        if not self.strategy.gather_16bit_weights_on_model_save:
            logger.warning("did not save the model %s: zero_optimization.stage3_gather_16bit_weights_on_model_save "
                           "is false", path)
            return False
        state = self._whole_tensors(self.strategy.module_state_dict(), keep=self.global_rank == 0)
        if exclude_frozen_parameters:
            frozen = {n for n, p in self.module.named_parameters() if not p.requires_grad}
            state = {k: v for k, v in state.items() if k not in frozen}
        if self.global_rank == 0:
            os.makedirs(save_dir, exist_ok=True)
            atomic_torch_save(state, path)
        self.comm.barrier()
        return True

    @heartbeat.paused()
    def load_checkpoint(self, load_dir, tag: str | None = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, *, verify: bool = True):
        """Restore a checkpoint written by `save_checkpoint` at any data-parallel world size, ZeRO stage
        and tensor-parallel size; returns `(path, client_state)`, or `(None, None)` when `load_dir` holds no `latest` file
        and no tag is given. Everything is read and checked on every rank before anything changes: a
        load that fails raises on every rank and leaves the engine as it was. Every file read is verified
        (lightspeed's against its checksum manifest, DeepSpeed's against its CRC-32s); `verify=False`
        reads them unchecked (e.g. a tag whose manifests were lost), with a warning."""
        self.wait_checkpoint()
        with verification(verify):
            return self._load_checkpoint(load_dir, tag, load_module_strict, load_optimizer_states,
                                         load_lr_scheduler_states, load_module_only)

    def _load_checkpoint(self, load_dir, tag, load_module_strict, load_optimizer_states, load_lr_scheduler_states,
                         load_module_only):
        try:
            trainable = [n for n, p in self.module.named_parameters() if p.requires_grad]
            self._first_name = {n: first_names(self.module)[id(p)]
                                for n, p in self.module.named_parameters(remove_duplicate=False)}
            # at another tp size (or plan) the source merges the saved slices and cuts this tp rank's
            # (checkpoint/tensor_parallel.py); the fragments path below then re-slices over dp and stage
            opened = open_at_tp_size(load_dir, tag, dp_rank=self.groups.seq_dp_rank, param_names=trainable,
                                     current=None if self._tp_comm is None else self._tp_record(),
                                     mesh_rank=self._ckpt_rank)
            read = None
            if opened is not None:
                path, source, rng = opened
                source_params = set(source.param_names())
                extra = source.extra()
                module_state = self._module_state_to_load(source, load_module_only)
                excluded = set(extra.get("excluded_frozen_parameters") or ())
                excluded |= {k for k in self.strategy.module_shapes() if k not in module_state
                             and self._first_name.get(k) in source_params}
                expected = {k: v for k, v in self.strategy.module_shapes().items() if k not in excluded}
                check_module_state(expected, module_state, strict=load_module_strict)
                counters = self._saved_counters(extra.get("counters") or {})
                if not load_module_only:
                    read = read_training_state(source, self.strategy.fragments(), self.optimizer,
                                               load_optimizer_states=load_optimizer_states)
            failed = None
        except (CheckpointError, KeyError, ValueError, RuntimeError) as err:
            failed = err
        self._agree_or_raise(failed)
        if opened is None:
            logger.warning("no checkpoint to load in %s (no 'latest' file and no tag given)", load_dir)
            return None, None
        client_state = extra.get("client_state") or {}
        self.strategy.load_module_state_dict(module_state, strict=False)  # checked above, before any change
        if load_module_only:
            self.strategy.masters_from_params()
            if rng is not None:
                set_rng_state(rng)
            return path, client_state
        apply_training_state(read, self.optimizer)
        self.strategy.masters_loaded()
        if load_lr_scheduler_states and self.lr_scheduler is not None and extra.get("lr_scheduler") is not None:
            self.lr_scheduler.load_state_dict(extra["lr_scheduler"])
        if self.loss_scaler is not None and extra.get("loss_scaler") is not None:
            self.loss_scaler.load_state_dict(extra["loss_scaler"])
        self.global_steps, self.global_samples, self.micro_steps, self.skipped_steps = counters
        saved_world = int(extra.get("dp_world_size") or 0)
        if rng is not None:
            set_rng_state(rng)
        elif self.groups.seq_dp_rank >= saved_world:
            logger.info("checkpoint %s was saved by %d ranks: ranks from %d on keep their own RNG state", path,
                        saved_world, saved_world)
        return path, client_state

    def _module_state_to_load(self, source, load_module_only: bool) -> dict[str, Any]:
        """The saved module state, less the parameters the source holds fp32 masters of whose saved entry
        is an empty placeholder (a ZeRO-3 writer keeps them partitioned): those come from the masters, or,
        for a module-only load, from the source's fp32 values one tensor at a time."""
        saved = source.module_state()
        masters = set(source.param_names())
        out: dict[str, Any] = {}
        for name in list(saved.keys()):
            value = saved[name]
            first = self._first_name.get(name)
            if first in masters and torch.is_tensor(value) and value.numel() == 0:
                if load_module_only and name == first:
                    out[name] = source.read(name)
                continue
            out[name] = value
        return out

    def _saved_counters(self, saved: dict) -> tuple[int, int, int, int]:
        """(global_steps, global_samples, micro_steps, skipped_steps) from a checkpoint's counters; what a
        writer did not record (DeepSpeed keeps no micro-step count) follows from the steps taken."""
        def get(key, default):
            value = saved.get(key)
            return int(default if value is None else value)

        steps = get("global_steps", 0)
        return (steps, get("global_samples", steps * self.train_batch_size()),
                get("micro_steps", steps * self.gradient_accumulation_steps()), get("skipped_steps", 0))

    def _agree_or_raise(self, failed: BaseException | None) -> None:
        """Every rank learns whether any rank failed to read the checkpoint, and then all raise."""
        flag = torch.tensor([0.0 if failed is None else float(self._ckpt_rank + 1)], device=self.device)
        self._ckpt_comm.all_reduce(flag, op="max")  # every rank of the mesh: a load changes all or none
        if failed is not None:
            raise failed if isinstance(failed, CheckpointError) else CheckpointError(str(failed)) from failed
        if flag.item() > 0:
            what = "data-parallel rank" if self._tp_comm is None else "rank"
            raise CheckpointError(f"load_checkpoint: {what} {int(flag.item()) - 1} could not read the "
                                  "checkpoint (its error is raised there); nothing was loaded")


def _destroyed(engine, args):
    raise RuntimeError("this engine was destroyed (engine.destroy()) and cannot be called any more; build a new "
                       "one with initialize()")
