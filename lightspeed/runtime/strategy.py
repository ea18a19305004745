"""The sharding-strategy protocol every ZeRO stage implements, and the one place a stage is chosen.

The engine calls these methods and never branches on the stage number. Every member anything outside
a strategy uses is declared on `ShardingStrategy` (tests/unit/runtime/test_strategy_protocol.py scans the
package for uses), so callers never probe a strategy with getattr/hasattr.
"""

from __future__ import annotations

import contextlib
import inspect
import typing
from typing import Any, Callable, Protocol, runtime_checkable

import torch

from lightspeed.comm.codecs import Collectives
from lightspeed.comm.collectives import Communicator
from lightspeed.comm.zeropp import zeropp_collectives, zeropp_enabled
from lightspeed.offload.policy import OffloadPolicy
from lightspeed.config.errors import ConfigError
from lightspeed.optim.onebit.base import ReducesOwnGradients
from lightspeed.precision.autocast import AutocastSettings
from lightspeed.precision.policy import PrecisionPolicy
from lightspeed.zero.sparse import sparse_parameters
from lightspeed.zero.reduce import ReduceOptions, sp_summed
from lightspeed.zero.reduce_groups import ReduceGroups
from lightspeed.zero.fragments import Fragment
from lightspeed.zero.graphed_step import check_graphed_step
from lightspeed.zero.optimizers import fused_step
from lightspeed.zero.param_access import ParamFragment
from lightspeed.zero.sharded_step import StepResult
from lightspeed.zero.stage0 import Stage0Strategy
from lightspeed.zero.stage12 import ShardedStrategy


@runtime_checkable
class ShardingStrategy(Protocol):
    """What the engine, `initialize()`, `zero/param_access.py` and `lightspeed.testing` use of a ZeRO
    stage, and only that: `check_strategy` verifies it when `select_strategy` builds one."""

    stage: int
    """The ZeRO stage, 0-3."""
    state_is_replicated: bool
    """True: `state_dict()` is the same on every rank (rank 0 writes it); False: every rank writes its own."""
    gather_16bit_weights_on_model_save: bool
    """True when `save_16bit_model` may write `module_state_dict()`: always where ranks hold whole parameters
    (stages 0-2); at stage 3, `zero_optimization.stage3_gather_16bit_weights_on_model_save`."""
    optimizer: torch.optim.Optimizer | None
    """The optimizer the strategy steps (its param groups hold the strategy's fp32 tensors), or None."""

    def broadcast_from_rank0(self, module: torch.nn.Module) -> None:
        """Make every rank's parameters, masters and buffers rank 0's (a collective, once at set-up)."""
        ...

    def backward_start(self, is_boundary: bool) -> None:
        """A backward begins; `is_boundary`: it ends a gradient-accumulation window (gradients are reduced)."""
        ...

    def backward_end(self) -> None:
        """The backward's autograd pass returned (reductions may still be in flight)."""
        ...

    def wait_gradients(self) -> None:
        """Wait for every reduction in flight: the gradients this rank holds are final."""
        ...

    def gradients_unreduced(self) -> bool:
        """True after a backward that was not an accumulation boundary where the reduced gradients are not
        current and each parameter's `.grad` holds this rank's accumulated gradient (stage 1 between
        micro-steps and inside `no_sync()`); False where what `fragment(p).grad` holds is current."""
        ...

    def step(self, loss_scale: float | None, max_norm: float, check_overflow: bool | None = None) -> StepResult:
        """Unscale by `loss_scale`, clip to `max_norm` (0: no clipping), step the optimizer and write the
        parameters, unless some rank's gradients hold inf/nan (`StepResult.applied` False)."""
        ...

    def zero_grad(self) -> None:
        """Zero (or release) the gradients this rank holds."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """This rank's fp32 masters and optimizer state, as fragments (`zero/fragments.py`); collective."""
        ...

    def fragments(self) -> list[Fragment]:
        """Each trainable parameter's elements this rank owns, as 1-D views of the optimizer's fp32 tensors
        (what a checkpoint saves and loads, at any stage and world size)."""
        ...

    def fragment(self, param: torch.nn.Parameter) -> ParamFragment | None:
        """Where `param`'s elements live on this rank (`zero/param_access.py`), or None when this strategy
        does not manage it."""
        ...

    def masters_loaded(self) -> None:
        """The fp32 masters were overwritten (a checkpoint load): make the parameters follow them."""
        ...

    def masters_from_params(self) -> None:
        """The parameters were overwritten (a module-only load): make the masters follow them."""
        ...

    def memory_breakdown(self) -> dict[str, dict[str, int]]:
        """This rank's bytes, {device: {category: bytes}} (`zero/memory.py`'s categories)."""
        ...

    def compile_regions(self) -> list[torch.nn.Module]:
        """The modules `engine.compile()` compiles in place, each with its hooks outside its graph."""
        ...

    def after_compile(self, regions: list[torch.nn.Module]) -> None:
        """Called by `engine.compile()` once `regions` (from `compile_regions`) are compiled."""
        ...

    def needs_eager_forward(self) -> bool:
        """True when the next forward must run its compiled regions eagerly (the strategy watches it)."""
        ...

    def module_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every module state_dict key -> its whole shape (stage 3: the unpartitioned shape)."""
        ...

    def module_state_dict(self) -> dict[str, Any]:
        """The module's full state_dict (stage 3 gathers the partitioned parameters: a collective)."""
        ...

    def load_module_state_dict(self, state: dict[str, Any], strict: bool = True) -> None:
        """Copy a full module state_dict into the parameters (stage 3: each rank its slices)."""
        ...

    def use_placements(self, placements, topology) -> None:
        """Where each parameter lives on the mesh (parallel/placement.py's table, over `topology`): the
        gradient norm counts every element once across it (zero/norm.py). Called once, after set-up."""
        ...

    def unshard(self, module: torch.nn.Module | None = None) -> None:
        """Gather `module`'s parameters (None: the whole model) once and keep them gathered across forwards
        (FSDP2's `unshard`; a no-op where parameters are whole)."""
        ...

    def reshard(self, module: torch.nn.Module | None = None) -> None:
        """Release what `unshard` gathered back to the shards (a no-op for what is not unsharded)."""
        ...

    def unsharded(self, module: torch.nn.Module | None = None) -> contextlib.AbstractContextManager:
        """`unshard(module)` for a `with` block (yielding the module), resharded on exit."""
        ...

    def empty_partition_cache(self) -> None:
        """Release what is kept gathered between forwards (stage 3's persistent groups; DeepSpeed's
        `empty_partition_cache`), gathered again on use; what a `GatheredParameters` or `unshard` holds
        stays. A no-op where parameters are whole."""
        ...

    def trace_complete(self) -> bool:
        """True while forwards follow a recorded module order (stage 3 prefetches along it); False while
        the next forward and backward record one, and always where nothing is gathered (stages 0-2)."""
        ...

    def restart_trace(self) -> None:
        """Forget the recorded module order: the next forward and backward record it again (DeepSpeed's
        `_invalidate_trace`, which TRL calls after generation). Refused during a forward or backward; a
        no-op where nothing is gathered."""
        ...

    def external_parameters(self, module: torch.nn.Module) -> list[torch.nn.Parameter]:
        """The parameters gathered around `module`'s forward and backward that are not its own (stage 3:
        tied, registered with `register_external_parameter` or found in use; DeepSpeed's
        `module.ds_external_parameters()`; stage 3 gathers a group at a time, so all of a group); none
        where nothing is gathered."""
        ...

    def forward_method(self, method: Callable[..., Any]) -> Callable[..., Any]:
        """`method` (a bound method of the model other than `forward`) made to run as a forward of the whole
        model: stage 3 gathers and releases around it what the model's forward hooks would (FSDP2's
        `register_fsdp_forward_method`); `method` itself where parameters are whole."""
        ...

    def note_loss_scale(self, loss_scale: float | None) -> None:
        """The loss scale of the coming backward (None without loss scaling), before it starts: the
        speculative offloaded step (`offload_optimizer.super_offload`) unscales with it while gradients
        land; nothing elsewhere."""
        ...

    def set_steps_per_epoch(self, n: int) -> None:
        """Optimizer steps in one pass over the engine's training data (`initialize(training_data=)`):
        ZenFlow's epoch-based column selection counts in them; nothing elsewhere."""
        ...

    def remove_hooks(self) -> None:
        """Finish the work in flight (reductions, an overlapped step), reshard what is unsharded and remove
        every hook the strategy registered on the model and its parameters (`engine.destroy`); the
        strategy is not used afterwards."""
        ...


class DestroyedStrategy:
    """What an engine holds in place of its strategy after `engine.destroy()`: using any member raises
    a RuntimeError saying the engine was destroyed."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)  # copy, pickle and the like probe dunders
        raise RuntimeError(f"this engine was destroyed (engine.destroy()) and cannot be used any more "
                           f"(strategy.{name}); build a new one with initialize()")


_MISSING = object()


def _protocol_members() -> tuple[dict[str, Any], tuple[str, ...]]:
    """The protocol's data members (name -> resolved type) and its methods."""
    data = typing.get_type_hints(ShardingStrategy)
    methods = tuple(n for n, v in vars(ShardingStrategy).items() if not n.startswith("_") and callable(v))
    return data, methods


def check_strategy(strategy: object) -> ShardingStrategy:
    """`strategy`, after checking it has every `ShardingStrategy` member (methods callable, `bool` and
    `int` members of their type); raises TypeError naming what is missing or wrong."""
    data, methods = _protocol_members()
    missing = [n for n in (*data, *methods) if inspect.getattr_static(strategy, n, _MISSING) is _MISSING]
    wrong = [f"{n} is not callable" for n in methods if n not in missing and not callable(getattr(strategy, n))]
    wrong += [f"{n} is not {t.__name__}" for n, t in data.items()
              if t in (bool, int) and n not in missing and not isinstance(getattr(strategy, n), t)]
    if missing or wrong:
        problems = ([f"missing {', '.join(missing)}"] if missing else []) + wrong
        raise TypeError(f"{type(strategy).__name__} is not a ShardingStrategy (lightspeed/runtime/strategy.py): "
                        f"{'; '.join(problems)}")
    return strategy  # type: ignore[return-value]


def reduce_options(cfg, policy: PrecisionPolicy, sp_size: int = 1) -> ReduceOptions:
    """Stages 0-2's reduction; `sp_size`: the sequence-parallel ranks each reduce group holds, whose
    gradients are summed, not averaged (zero/reduce.py's Note on sequence parallelism)."""
    return ReduceOptions(sp_summed=sp_summed(cfg.zero_optimization.stage, sp_size),
                         bucket_numel=int(cfg.zero_optimization.reduce_bucket_size),
                         prescale_gradients=bool(cfg.prescale_gradients),
                         gradient_predivide_factor=float(cfg.gradient_predivide_factor),
                         reduce_dtype=policy.reduce_dtype,
                         overlap_comm=bool(cfg.zero_optimization.overlap_comm),
                         allgather_bucket_numel=int(cfg.zero_optimization.allgather_bucket_size),
                         average=cfg.gradient_allreduce_op == "mean")


def strategy_places_params(cfg) -> bool:
    """True when the strategy itself puts the parameters on the device (stage 3 shards them there, one
    group at a time), so `initialize()` must not move the whole model first."""
    return cfg.zero_optimization.stage == 3


def strategy_partitions_gradients(cfg) -> bool:
    """True when each rank keeps only its shard of the reduced gradients, reduced at every micro-step
    (stages 2 and 3): gradients cannot stay unreduced across micro-steps (`engine.no_sync`)."""
    return cfg.zero_optimization.stage >= 2


def select_strategy(cfg, module: torch.nn.Module, optimizer, policy: PrecisionPolicy,
                    comm: Communicator, device: torch.device | None = None,
                    offload: OffloadPolicy | None = None, placements=None, topology=None) -> ShardingStrategy:
    """The strategy of `cfg`'s ZeRO stage; `offload` (default: none) says where its state lives;
    `placements` over `topology` (parallel/placement.py) say which group reduces each parameter's
    gradients (zero/reduce_groups.py: `comm`'s, unless a placement names another)."""
    stage = cfg.zero_optimization.stage
    offload = offload if offload is not None else OffloadPolicy()
    sp = topology.size("sp") if topology is not None else 1
    if isinstance(optimizer, ReducesOwnGradients) and sp > 1:
        # its compressed momentum is averaged over the whole dp x sp group, while stage 0 sums the sp
        # ranks' gradients (zero/reduce.py's Note on sequence parallelism): the two would disagree by sp
        raise NotImplementedError(f"sequence_parallel_size={sp} with {type(optimizer).__name__} (a one-bit "
                                  "optimizer, optimizer.type) is not implemented")
    if isinstance(optimizer, ReducesOwnGradients) and stage != 0:
        raise ConfigError(f"zero_optimization.stage: {type(optimizer).__name__} communicates compressed momentum "
                          f"instead of gradients and runs at ZeRO stage 0 only (got stage {stage})")
    graphed = cfg.optimizer is not None and cfg.optimizer.cuda_graph
    if graphed:  # optimizer.cuda_graph: refused where the step cannot be captured (zero/graphed_step.py)
        check_graphed_step(optimizer, fused_step(optimizer, offload if stage else None),
                           offload.enabled or offload.zenflow is not None or offload.super_offload,
                           device if device is not None else _first_param_device(module), policy.stochastic_rounding)
    collectives = Collectives.default(comm)
    autocast = AutocastSettings.from_config(cfg, device.type if device is not None else "cpu")
    # torch_autocast: ZeRO 1-3 reduce each gradient in its parameter's communication dtype (stage 0 does not)
    comm_dtypes = autocast.comm_dtypes(module) if autocast is not None and stage > 0 else None
    if zeropp_enabled(cfg.zero_optimization):
        collectives = _zeropp(cfg, comm, offload)
    groups = ReduceGroups.build(module, placements, topology, collectives)
    if groups.keyed and (zeropp_enabled(cfg.zero_optimization) or isinstance(optimizer, ReducesOwnGradients)):
        what = "ZeRO++ (zero_optimization.zero_quantized_*, zero_hpz_partition_size)" \
            if zeropp_enabled(cfg.zero_optimization) else f"{type(optimizer).__name__}"
        raise NotImplementedError(f"{what} with parameters reduced over another group than data parallelism "
                                  "(expert parameters) is not implemented")
    if stage == 0:
        strategy = Stage0Strategy(module, optimizer, policy, comm, reduce_options(cfg, policy, sp),
                                  collectives=collectives,
                                  reduce_groups=groups, sparse_params=sparse_parameters(module, cfg.sparse_gradients),
                                  graphed_step=graphed)
    elif cfg.sparse_gradients:
        raise NotImplementedError(f"sparse_gradients at zero_optimization.stage {stage} is not implemented: ZeRO "
                                  "reduce-scatters dense gradients (the sparse row all-gather is stage 0's, as "
                                  "DeepSpeed's)")
    elif stage in (1, 2):
        strategy = ShardedStrategy(module, optimizer, policy, comm, reduce_options(cfg, policy, sp), stage=stage,
                                   allow_untested_optimizer=bool(cfg.zero_allow_untested_optimizer), offload=offload,
                                   collectives=collectives, reduce_groups=groups, comm_dtypes=comm_dtypes,
                                   graphed_step=graphed)
    elif stage == 3:
        from lightspeed.zero.stage3 import Stage3Options, Stage3Strategy

        strategy = Stage3Strategy(module, optimizer, policy, comm, Stage3Options.from_config(cfg, policy),
                                  device=device, offload=offload, collectives=collectives, reduce_groups=groups,
                                  comm_dtypes=comm_dtypes, graphed_step=graphed)
    else:
        raise NotImplementedError(f"zero_optimization.stage={stage} is not implemented yet")
    return check_strategy(strategy)


def _first_param_device(module: torch.nn.Module) -> torch.device | None:
    return next((p.device for p in module.parameters()), None)


def _zeropp(cfg, comm: Communicator, offload: OffloadPolicy) -> Collectives:
    """ZeRO++'s collectives (stage 3 only, as DeepSpeed's)."""
    z = cfg.zero_optimization
    if z.stage != 3:
        keys = [k for k in ("zero_quantized_weights", "zero_quantized_nontrainable_weights", "zero_quantized_gradients")
                if getattr(z, k)] + (["zero_hpz_partition_size"] if z.zero_hpz_partition_size > 1 else [])
        raise ConfigError(f"zero_optimization.{keys[0]}: ZeRO++ needs zero_optimization.stage 3 (got stage {z.stage})")
    if z.zero_quantized_nontrainable_weights and offload.offloads_params:
        raise NotImplementedError("zero_optimization.zero_quantized_nontrainable_weights with "
                                  "zero_optimization.offload_param (quantized frozen shards in host memory) is not "
                                  "implemented")
    return zeropp_collectives(comm, z)
