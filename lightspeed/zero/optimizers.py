"""Which optimizers ZeRO steps on flat shards, and whether one fuses the ZeRO step.

Owns: the list of optimizers whose update is elementwise (so stepping one flat shard that holds
pieces of many parameters gives the same result as stepping the parameters), the check that refuses
others unless `zero_allow_untested_optimizer` is set (DeepSpeed's rule) or they know the shards' pieces
(Muon, attached to the strategy's fragments at initialize: optim/muon.py), and `fused_step`: whether
the optimizer takes `step(grad_scale=..., lowp_out=...)` (lightspeed.ops' fused optimizers), so the
strategies hand it low-precision gradients, the unscale/clip coefficient and the parameter copy to
write, instead of spending passes on them; and `low_precision_masters`, the dtype of the master
shards (bf16/fp16_master_weights_and_grads), which also turns on the optimizer's stochastic rounding
of its bf16 writes (bf16.stochastic_rounding) or refuses it where the optimizer cannot. With the
optimizer offloaded to host memory the CPU optimizers take the same call (`ops/adam/cpu_adam.py`):
they apply the coefficient inside their kernel and copy each stepped piece to the device while
stepping the next.
"""
from __future__ import annotations

import torch

from lightspeed.config.errors import ConfigAssertionError, ConfigError
from lightspeed.offload.policy import OffloadPolicy
from lightspeed.precision.policy import PrecisionPolicy, check_master_placement
from lightspeed.ops.adagrad import CPUAdagrad, FusedAdagrad
from lightspeed.ops.adam import CPUAdam, FusedAdam
from lightspeed.ops.adam.cpu_adam import CPUOptimizerBase
from lightspeed.ops.lion import CPULion, FusedLion
from lightspeed.ops.multi_tensor.optimizer import FusedOptimizer
from lightspeed.ops.rounding import mix_seed
from lightspeed.optim.muon import Muon

ELEMENTWISE_OPTIMIZERS = (
    FusedAdam, FusedLion, FusedAdagrad, CPUAdam, CPUAdagrad, CPULion,
    torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad, torch.optim.RMSprop,
    torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.Rprop,
)


# optimizers that step shards knowing which pieces of which parameter they hold (attached to fragments)
SHARD_AWARE_OPTIMIZERS = (Muon,)


def check_optimizer(optimizer: torch.optim.Optimizer | None, allow_untested: bool, stage: int) -> None:
    if optimizer is None or allow_untested or type(optimizer) in ELEMENTWISE_OPTIMIZERS + SHARD_AWARE_OPTIMIZERS:
        return
    # DeepSpeed asserts here: an AssertionError as well as a ConfigError
    raise ConfigAssertionError(f"zero_allow_untested_optimizer: ZeRO stage {stage} steps {type(optimizer).__name__} "
                               "on flat shards holding pieces of many parameters, which is tested only for elementwise "
                               f"optimizers ({', '.join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)}); set "
                               '"zero_allow_untested_optimizer": true to use it anyway')


def fused_step(optimizer: torch.optim.Optimizer | None, offload: OffloadPolicy | None = None) -> bool:
    """True when the strategy hands `optimizer.step(grads=, grad_scale=, lowp_out=)` the step: a fused
    device optimizer without offload, or a CPU optimizer stepping host masters (`offload` says where
    they live). Not with NVMe (the swapped step writes each sub-group itself), partial offload (some
    masters on the device), parameters on NVMe (their host lp shards come and go), or the overlapped
    step (its update reaches the parameters one step later, at `flush`)."""
    if offload is None or not offload.enabled:
        return isinstance(optimizer, FusedOptimizer) and optimizer.fuses_lowp_out
    return (isinstance(optimizer, CPUOptimizerBase) and optimizer.fuses_lowp_out and offload.optimizer == "cpu"
            and offload.param != "nvme" and offload.ratio == 1.0 and not offload.overlap_step)


def low_precision_masters(policy: PrecisionPolicy, optimizer: torch.optim.Optimizer | None,
                          offload: OffloadPolicy | None, rank: int = 0) -> torch.dtype:
    """The dtype of the master shards a sharded stage keeps, after DeepSpeed's rules for bf16/fp16
    masters (precision/policy.py's Note) are checked; makes a fused optimizer keep its state in the
    master dtype when `policy.state_dtype` says so (torch's optimizers create state like the master,
    which is that dtype already), and turns on its stochastic rounding with `policy.stochastic_rounding`
    (`rank`, the data-parallel rank, is mixed into the seed: each rank's shard draws its own bits)."""
    offloaded = offload is not None and offload.offloads_optimizer
    check_master_placement(policy, offloaded)
    if not policy.low_precision_master:
        return torch.float32
    key = ("fp16.fp16_master_weights_and_grads" if policy.master_dtype == torch.float16
           else "bf16.bf16_master_weights_and_grads")
    if offloaded:
        # DeepSpeed: host masters in low precision are stepped by DeepSpeedCPUAdam only, its moments
        # in bf16 with bf16_optimizer_states (it overrides fp32_optimizer_states), else in fp32
        if optimizer is not None and not isinstance(optimizer, CPUAdam):
            raise ConfigError(f"{key}: with zero_optimization.offload_optimizer the optimizer must be the CPU Adam "
                              f"(DeepSpeedCPUAdam's rule; got {type(optimizer).__name__})")
        if optimizer is not None and not fused_step(optimizer, offload):
            raise NotImplementedError(f"{key} with offload_optimizer on NVMe, a partial offload ratio, overlap_step "
                                      "or offload_param on NVMe is not implemented yet")
        if optimizer is not None:
            if optimizer.state:
                raise ValueError("the optimizer already has state; pass a freshly constructed optimizer")
            optimizer.fp32_optimizer_states = policy.state_dtype == torch.float32
    elif isinstance(optimizer, FusedOptimizer):
        optimizer.state_dtype = policy.state_dtype
    elif isinstance(optimizer, CPUOptimizerBase):
        raise NotImplementedError(f"{key} with a CPU optimizer stepping device tensors is not implemented")
    if policy.stochastic_rounding and optimizer is not None:
        _round_stochastically(optimizer, rank)
    return policy.master_dtype


def _round_stochastically(optimizer: torch.optim.Optimizer, rank: int) -> None:
    """bf16.stochastic_rounding: the optimizer rounds its bf16 writes stochastically, its draws seeded
    from torch's initial seed (what torch.manual_seed set) and `rank`; optimizers that cannot are refused."""
    rounds = isinstance(optimizer, CPUOptimizerBase) or (
        isinstance(optimizer, FusedOptimizer) and optimizer.supports_stochastic_rounding)
    if not rounds:
        raise ConfigError("bf16.stochastic_rounding: the optimizer must write its bf16 masters and state itself "
                          "(FusedAdam, FusedLion, FusedAdagrad, or the CPU Adam with offload_optimizer; got "
                          f"{type(optimizer).__name__})")
    optimizer.stochastic_rounding = True
    optimizer.rounding_seed = mix_seed(torch.initial_seed(), rank)
