"""Precision policy: which dtype each role (params, compute, grad accumulation, reduction, master
copy) uses, resolved once from the config.

Owns the dtype decisions and their DeepSpeed defaults. It must not cast tensors or build buffers;
strategies read the policy and allocate accordingly.

Note: [defaults, and why bf16 accumulates in bf16]
    DeepSpeed derives everything from ``fp16.enabled`` / ``bf16.enabled`` (engine.get_data_types,
    engine.communication_data_type):

    =====  ======  ==========  =======================  ========================  ======  ============
    mode   params  compute     grad accumulation        reduction                 master  loss scaling
    =====  ======  ==========  =======================  ========================  ======  ============
    fp16   fp16    fp16        data_types or fp16       communication or fp16     fp32    yes
    bf16   bf16    bf16        data_types or bf16       communication or bf16     fp32    no
    fp32   fp32    fp32        data_types or fp32       communication or fp32     None    no
    =====  ======  ==========  =======================  ========================  ======  ============

    bf16 accumulation default: DeepSpeed releases from about 0.7 to 0.16 accumulated bf16 gradients
    in fp32 (BF16_Optimizer) *only without ZeRO*; every ZeRO stage has always accumulated in the
    model dtype, and current DeepSpeed (``get_data_types``) returns the model dtype whenever
    ``data_types.grad_accum_dtype`` is unset, for every stage. We follow current DeepSpeed: bf16
    grads accumulate in bf16 unless the config says ``"grad_accum_dtype": "fp32"``, which gives the
    fp32 accumulation buffer (the numerically safer choice for long accumulation).
    Which combinations are accepted is DeepSpeed 0.19's rule (engine._do_optimizer_sanity_check):
    with ZeRO (stages 1-3) any accumulation dtype goes with any model dtype (the buffers are
    allocated in it and gradients are added into it); without ZeRO (stage 0) it must be the model's
    dtype, and any other is refused.

Note: [low-precision masters]
    ``bf16.bf16_master_weights_and_grads`` / ``fp16.fp16_master_weights_and_grads`` make the master
    copy (and the gradients the optimizer reads) bf16 / fp16 instead of fp32: ``master_dtype`` is
    that dtype. ``bf16.bf16_optimizer_states`` keeps the optimizer state in it too
    (``state_dtype``); otherwise the state stays fp32. DeepSpeed's rules (base_optimizer's
    _configure_master_weights): the two master flags exclude each other, bf16_optimizer_states
    needs bf16_master_weights_and_grads, and a master kept in low precision with fp32 optimizer
    state (fp16 masters, or bf16 masters without bf16_optimizer_states) needs the optimizer
    offloaded to the CPU; those are checked where the offload policy is known
    (`check_master_placement`). ``bf16.stochastic_rounding`` (lightspeed's own key) writes the bf16
    master and state with stochastic rounding (``stochastic_rounding``); it needs bf16 masters.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from lightspeed.config.errors import ConfigError, ConfigNotImplementedError
from lightspeed.precision.module_dtypes import keep_in_fp32_setting

__all__ = ["PrecisionPolicy", "check_master_placement", "policy_from_config", "parse_dtype"]

# DeepSpeed's DtypeEnum spellings (runtime/config.py), plus torch dtypes themselves.
_DTYPE_NAMES = {
    torch.float16: ("fp16", "float16", "half", "torch.float16"),
    torch.bfloat16: ("bf16", "bfloat16", "bfloat", "torch.bfloat16"),
    torch.float32: ("fp32", "float32", "float", "torch.float32"),
}
_BY_NAME = {name: dtype for dtype, names in _DTYPE_NAMES.items() for name in names}


@dataclass(frozen=True)
class PrecisionPolicy:
    """The dtype of every tensor role in training. ``master_dtype`` is None when params are already
    fp32 (no master copy); ``loss_scaling`` is True only for fp16."""

    param_dtype: torch.dtype = torch.float32
    compute_dtype: torch.dtype = torch.float32
    grad_accum_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype = torch.float32
    master_dtype: torch.dtype | None = None
    loss_scaling: bool = False
    state_dtype: torch.dtype = torch.float32  # the optimizer state (bf16 with bf16_optimizer_states)
    stochastic_rounding: bool = False  # bf16.stochastic_rounding: bf16 masters and state rounded stochastically
    buffer_dtype: torch.dtype | None = None  # data_types.buffer_dtype: None keeps each buffer's (module_dtypes.py)
    keep_in_fp32: str | tuple[str, ...] = "auto"  # data_types.keep_in_fp32_modules: "auto" or name patterns

    @property
    def mixed(self) -> bool:
        """True when params are kept in a low-precision dtype with a separate master copy."""
        return self.master_dtype is not None

    @property
    def low_precision_master(self) -> bool:
        """True when the master copy is bf16/fp16 (bf16_master_weights_and_grads, fp16_master_weights_and_grads)."""
        return self.master_dtype is not None and self.master_dtype != torch.float32

    def shard_master_dtype(self) -> torch.dtype:
        """The dtype of a master shard the sharded stages keep (fp32 unless low-precision masters)."""
        return self.master_dtype if self.low_precision_master else torch.float32


def parse_dtype(value: Any, key: str) -> torch.dtype | None:
    """``None`` / a DeepSpeed dtype string / a torch dtype -> torch dtype; ``key`` names the JSON path."""
    if value is None or isinstance(value, torch.dtype) and value in _DTYPE_NAMES:
        return value
    if isinstance(value, str) and value.strip().lower() in _BY_NAME:
        return _BY_NAME[value.strip().lower()]
    raise ConfigError(f'{key}: must be one of "fp32", "fp16", "bf16" or null (got {value!r})')


def _field(cfg: Any, path: str, default: Any = None) -> Any:
    for name in path.split("."):
        if cfg is None:
            return default
        cfg = cfg.get(name) if isinstance(cfg, Mapping) else getattr(cfg, name, None)
    return default if cfg is None else cfg


def _short(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES[dtype][0]


def policy_from_config(cfg: Any) -> PrecisionPolicy:
    """Resolve the policy from a config object or dict with DeepSpeed's ``fp16``, ``bf16``,
    ``data_types.grad_accum_dtype``, ``data_types.param_dtype`` (checked, not chosen), ``data_types.buffer_dtype``,
    ``data_types.keep_in_fp32_modules`` (applied by module_dtypes.py),
    ``communication_data_type`` and, with ``sequence_parallel_size`` > 1, ``seq_parallel_communication_data_type``; missing sections mean DeepSpeed's defaults."""
    fp16 = bool(_field(cfg, "fp16.enabled", False))
    bf16 = bool(_field(cfg, "bf16.enabled", False)) or bool(_field(cfg, "bfloat16.enabled", False))
    if fp16 and bf16:
        raise ConfigError("fp16.enabled and bf16.enabled: at most one may be true (got both)")
    param = torch.float16 if fp16 else torch.bfloat16 if bf16 else torch.float32
    declared = parse_dtype(_field(cfg, "data_types.param_dtype"), "data_types.param_dtype")
    if declared is not None and declared != param:  # DeepSpeed's _assert_valid_mixed_precision_config
        raise ConfigError(f"data_types.param_dtype: must match the enabled precision mode, {_short(param)} "
                          f"(got {_short(declared)})")

    accum = parse_dtype(_field(cfg, "data_types.grad_accum_dtype"), "data_types.grad_accum_dtype") or param
    if accum != param and not int(_field(cfg, "zero_optimization.stage", 0) or 0):  # see the Note
        raise ConfigNotImplementedError(  # DeepSpeed: NotImplementedError, "unsupported mix"
            f"data_types.grad_accum_dtype: without ZeRO (zero_optimization.stage 0) gradients accumulate in the "
            f"model's dtype, {_short(param)}; other dtypes need stage 1, 2 or 3 (got {_short(accum)})")
    reduce = parse_dtype(_field(cfg, "communication_data_type"), "communication_data_type") or param
    if (_field(cfg, "sequence_parallel_size") or 1) > 1:
        # DeepSpeed's rule: with sequence parallelism the gradients are reduced in this dtype (fp32 by default)
        reduce = parse_dtype(_field(cfg, "seq_parallel_communication_data_type", "fp32"), "seq_parallel_communication_data_type")

    master = None if param == torch.float32 else torch.float32
    state = torch.float32
    fp16_master = bool(_field(cfg, "fp16.fp16_master_weights_and_grads", False))
    bf16_master = bool(_field(cfg, "bf16.bf16_master_weights_and_grads", False))
    bf16_states = bool(_field(cfg, "bf16.bf16_optimizer_states", False))
    if fp16_master and bf16_master:
        raise ConfigError("fp16.fp16_master_weights_and_grads, bf16.bf16_master_weights_and_grads: "
                          "mutually exclusive (got both true)")
    if bf16_states and not bf16_master:
        raise ConfigError("bf16.bf16_optimizer_states: needs bf16.bf16_master_weights_and_grads true (got false)")
    rounding = bool(_field(cfg, "bf16.stochastic_rounding", False))
    if rounding and not bf16_master:
        raise ConfigError("bf16.stochastic_rounding: rounds the bf16 master weights and optimizer states, so it "
                          "needs bf16.bf16_master_weights_and_grads true (got false)")
    if fp16_master or bf16_master:
        want = torch.float16 if fp16_master else torch.bfloat16
        key = "fp16.fp16_master_weights_and_grads" if fp16_master else "bf16.bf16_master_weights_and_grads"
        if param != want:
            raise ConfigError(f"{key}: needs {_short(want)}.enabled true (the parameters are {_short(param)})")
        master = want
        state = torch.bfloat16 if bf16_states else torch.float32
    return PrecisionPolicy(
        param_dtype=param,
        compute_dtype=param,
        grad_accum_dtype=accum,
        reduce_dtype=reduce,
        master_dtype=master,
        loss_scaling=fp16,
        state_dtype=state,
        stochastic_rounding=rounding,
        buffer_dtype=parse_dtype(_field(cfg, "data_types.buffer_dtype"), "data_types.buffer_dtype"),
        keep_in_fp32=keep_in_fp32_setting(_field(cfg, "data_types.keep_in_fp32_modules")),
    )


def check_master_placement(policy: PrecisionPolicy, optimizer_offloaded: bool) -> None:
    """DeepSpeed's rule for low-precision masters (see the Note): fp32 optimizer state beside a
    low-precision master is kept only by a CPU optimizer with the optimizer offloaded; bf16 state on
    the device needs no offload. Raises ConfigError naming the key."""
    if not policy.low_precision_master:
        return
    key = ("fp16.fp16_master_weights_and_grads" if policy.master_dtype == torch.float16
           else "bf16.bf16_master_weights_and_grads")
    needs_offload = policy.state_dtype == torch.float32
    if needs_offload and not optimizer_offloaded:
        extra = "" if policy.master_dtype == torch.float16 else " (or set bf16.bf16_optimizer_states true to keep " \
            "bf16 optimizer state on the device)"
        raise ConfigError(f"{key}: low-precision masters with fp32 optimizer state need "
                          f"zero_optimization.offload_optimizer.device \"cpu\" with a CPU Adam{extra}")
