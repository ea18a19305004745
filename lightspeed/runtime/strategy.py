"""The sharding-strategy protocol every ZeRO stage implements, and the one place a stage is chosen.

The engine calls these methods and never branches on the stage number.
"""

from __future__ import annotations

import contextlib
from typing import Any, Protocol

import torch

from lightspeed.comm.codecs import Collectives
from lightspeed.comm.collectives import Communicator
from lightspeed.comm.zeropp import zeropp_collectives, zeropp_enabled
from lightspeed.offload.policy import OffloadPolicy
from lightspeed.config.errors import ConfigError
from lightspeed.optim.onebit.base import ReducesOwnGradients
from lightspeed.precision.policy import PrecisionPolicy
from lightspeed.zero.reduce import ReduceOptions
from lightspeed.zero.sharded_step import StepResult
from lightspeed.zero.stage0 import Stage0Strategy
from lightspeed.zero.stage12 import ShardedStrategy


class ShardingStrategy(Protocol):
    stage: int
    state_is_replicated: bool  # True: state_dict() is the same on every rank (rank 0 writes it)

    def broadcast_from_rank0(self, module: torch.nn.Module) -> None: ...

    def backward_start(self, is_boundary: bool) -> None: ...

    def backward_end(self) -> None: ...

    def wait_gradients(self) -> None: ...

    def step(self, loss_scale: float | None, max_norm: float, check_overflow: bool | None = None) -> StepResult: ...

    def zero_grad(self) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any], load_optimizer_states: bool = True) -> None: ...

    def memory_breakdown(self) -> dict[str, dict[str, int]]: ...

    def compile_regions(self) -> list[torch.nn.Module]:
        """The modules `engine.compile()` compiles in place, each with its hooks outside its graph."""
        ...

    def needs_eager_forward(self) -> bool:
        """True when the next forward must run its compiled regions eagerly (the strategy watches it)."""
        ...

    def module_state_dict(self) -> dict[str, Any]:
        """The module's full state_dict (stage 3 gathers the partitioned parameters)."""
        ...

    def load_module_state_dict(self, state: dict[str, Any], strict: bool = True) -> None: ...

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


def reduce_options(cfg, policy: PrecisionPolicy) -> ReduceOptions:
    return ReduceOptions(bucket_numel=int(cfg.zero_optimization.reduce_bucket_size),
                         prescale_gradients=bool(cfg.prescale_gradients),
                         gradient_predivide_factor=float(cfg.gradient_predivide_factor),
                         reduce_dtype=policy.reduce_dtype,
                         overlap_comm=bool(cfg.zero_optimization.overlap_comm),
                         allgather_bucket_numel=int(cfg.zero_optimization.allgather_bucket_size))


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
                    offload: OffloadPolicy | None = None) -> ShardingStrategy:
    """The strategy of `cfg`'s ZeRO stage; `offload` (default: none) says where its state lives."""
    stage = cfg.zero_optimization.stage
    offload = offload if offload is not None else OffloadPolicy()
    if isinstance(optimizer, ReducesOwnGradients) and stage != 0:
        raise ConfigError(f"zero_optimization.stage: {type(optimizer).__name__} communicates compressed momentum "
                          f"instead of gradients and runs at ZeRO stage 0 only (got stage {stage})")
    collectives = Collectives.default(comm)
    if zeropp_enabled(cfg.zero_optimization):
        collectives = _zeropp(cfg, comm, offload)
    if stage == 0:
        return Stage0Strategy(module, optimizer, policy, comm, reduce_options(cfg, policy), collectives=collectives)
    if stage in (1, 2):
        return ShardedStrategy(module, optimizer, policy, comm, reduce_options(cfg, policy), stage=stage,
                               allow_untested_optimizer=bool(cfg.zero_allow_untested_optimizer), offload=offload,
                               collectives=collectives)
    if stage == 3:
        from lightspeed.zero.stage3 import Stage3Options, Stage3Strategy

        return Stage3Strategy(module, optimizer, policy, comm, Stage3Options.from_config(cfg, policy), device=device,
                              offload=offload, collectives=collectives)
    raise NotImplementedError(f"zero_optimization.stage={stage} is not implemented yet")


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
