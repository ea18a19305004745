"""Builds the optimizer named by the ds_config `optimizer` section, with DeepSpeed's names, defaults
and Adam/AdamW rules.

Owns: matching `optimizer.type`, validating `optimizer.params`, and one small builder per optimizer
family (`_adam`, `_lamb`, `_lion`, `_adagrad`): the seam where lightspeed's fused kernels will plug
in under the same names. Must not: wrap the optimizer for ZeRO or mixed precision, or know about the
engine.

Note [DeepSpeed optimizer names]: the DeepSpeed names (adam, adamw, lamb, lion, adagrad and the
one-bit / mup / muon ones) match case-insensitively; any other name is a torch.optim class, matched
exactly as DeepSpeed's getattr(torch.optim, name) does, and case-insensitively as a convenience.
`max_grad_norm` is rejected for every type (DeepSpeed: use the top-level `gradient_clipping`).

Note [Adam modes]: "Adam" and "AdamW" both mean DeepSpeed's FusedAdam (lightspeed.ops.adam.FusedAdam:
the Triton kernel on CUDA, its plain-PyTorch reference on CPU). `adam_w_mode` (default true) selects
decoupled weight decay and type "AdamW" forces it, so plain "Adam" is AdamW unless
`adam_w_mode: false`. FusedAdam's defaults apply (weight_decay 0, not torch AdamW's 0.01).
`torch_adam: true` passes the remaining params straight to torch.optim.Adam/AdamW with torch's
defaults, as DeepSpeed does.

Note [optimizer offload]: with `cpu_offload` (ZeRO's optimizer offloaded to host memory or NVMe) the
optimizer steps host tensors, so the families map to their CPU kernels as DeepSpeed maps them: Adam and
AdamW to CPUAdam (DeepSpeedCPUAdam), Adagrad to CPUAdagrad, Lion to CPULion; `torch_adam` still builds
torch.optim's (whose CPU path is torch's own).

Note [one-bit optimizers]: OneBitAdam, ZeroOneAdam and OneBitLamb (lightspeed.optim.onebit) take
DeepSpeed's params and a compressed all-reduce built here over the data-parallel communicator
`comm` (required for them); see lightspeed.optim.onebit for their semantics and backend keys.

Note [mup]: MuAdam, MuAdamW and MuSGD are mup's (the `mup` package, imported when named): its function
over the param groups with the remaining params, as DeepSpeed calls it; without mup installed they are
a ConfigError naming the package.

Note [Muon]: "Muon" builds lightspeed.optim.muon.Muon (DeepSpeed's MuonWithAuxAdam): parameters tagged
`use_muon` (initialize() tags hidden matrices, optim/muon.py `tag_muon_params`) take Muon with `lr` /
`muon_lr`, `momentum`, `weight_decay`, `ns_method`; the others AdamW with `lr` / `adam_lr`, `betas`,
`eps`, `weight_decay`, `adam_w_mode`. Not with the optimizer offloaded, nor `per_head_muon`.

Note [fused families]: Lamb, Lion and Adagrad build lightspeed.ops' FusedLamb / FusedLion /
FusedAdagrad (Triton on CUDA, reference on CPU). Adagrad params outside FusedAdagrad's (lr, lr_decay,
weight_decay, initial_accumulator_value, eps), e.g. `maximize` or `foreach`, build torch.optim.Adagrad
instead, and the log says so.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Iterable, Optional

import torch
from pydantic import BeforeValidator, ValidationError

from lightspeed._utils.logging import get_logger
from lightspeed.comm.collectives import Communicator
from lightspeed.comm.onebit import OneBitAllReduce
from lightspeed.config.base import Bool, Float, Int, Section, Str, problems_from, show, suggest
from lightspeed.config.errors import ConfigError
from lightspeed.ops.adagrad import CPUAdagrad, FusedAdagrad
from lightspeed.ops.adam import CPUAdam, FusedAdam
from lightspeed.ops.lamb import FusedLamb
from lightspeed.ops.lion import CPULion, FusedLion
from lightspeed.optim.muon import Muon, muon_param_groups
from lightspeed.optim.onebit import OneBitAdam, OneBitLamb, ZeroOneAdam
from lightspeed.optim.schedules import kwargs_problems, read_section

logger = get_logger(__name__)

__all__ = ["build_optimizer", "make_optimizer"]

_ONEBIT = {"onebitadam": "OneBitAdam", "zerooneadam": "ZeroOneAdam", "onebitlamb": "OneBitLamb"}
_MUP = {"muadam": "MuAdam", "muadamw": "MuAdamW", "musgd": "MuSGD"}
_DISPLAY_NAMES = ["Adam", "AdamW", "Lamb", "Lion", "Adagrad", "Muon", *_ONEBIT.values(), *_MUP.values()]


def _check_betas(value):
    def ok(b) -> bool:
        return not isinstance(b, bool) and isinstance(b, (int, float)) and math.isfinite(b) and 0 <= b < 1

    if isinstance(value, (list, tuple)) and len(value) == 2 and all(ok(b) for b in value):
        return (float(value[0]), float(value[1]))
    raise ValueError("must be a list of two numbers in [0, 1)")


Betas = Annotated[Any, BeforeValidator(_check_betas)]
NonNegFloat = Float(ge=0)


class _AdamFlags(Section):
    torch_adam: Bool = False
    adam_w_mode: Bool = True


class _FusedAdamParams(Section):
    lr: NonNegFloat = 1e-3
    bias_correction: Bool = True
    betas: Betas = (0.9, 0.999)
    eps: NonNegFloat = 1e-8
    weight_decay: NonNegFloat = 0.0
    amsgrad: Bool = False
    set_grad_none: Bool = True


class _FusedLambParams(Section):
    lr: NonNegFloat = 1e-3
    bias_correction: Bool = True
    betas: Betas = (0.9, 0.999)
    eps: NonNegFloat = 1e-8
    eps_inside_sqrt: Bool = False
    weight_decay: NonNegFloat = 0.0
    max_coeff: NonNegFloat = 10.0
    min_coeff: NonNegFloat = 0.01
    amsgrad: Bool = False


class _FusedLionParams(Section):
    lr: NonNegFloat = 1e-3
    betas: Betas = (0.9, 0.999)
    weight_decay: NonNegFloat = 0.0
    set_grad_none: Bool = True


class _OneBitCommon(Section):
    lr: NonNegFloat = 1e-3
    betas: Betas = (0.9, 0.999)
    eps: NonNegFloat = 1e-8
    eps_inside_sqrt: Bool = False
    weight_decay: NonNegFloat = 0.0
    amsgrad: Bool = False
    cuda_aware: Bool = False
    comm_backend_name: Optional[Str] = None
    bias_correction: Optional[Bool] = None


class _OneBitAdamParams(_OneBitCommon):
    freeze_step: Int(ge=0) = 100000


class _ZeroOneAdamParams(_OneBitCommon):
    var_freeze_step: Int(ge=0) = 100000
    var_update_scaler: Int(ge=1) = 16
    local_step_scaler: Int(ge=1) = 32678
    local_step_clipper: Int(ge=1) = 16


class _OneBitLambParams(_OneBitCommon):
    freeze_step: Int(ge=0) = 100000
    max_coeff: NonNegFloat = 10.0
    min_coeff: NonNegFloat = 0.01
    coeff_beta: Float(ge=0, le=1) = 0.9
    factor_max: NonNegFloat = 4.0
    factor_min: NonNegFloat = 0.5
    factor_threshold: NonNegFloat = 0.1


class _MuonParams(Section):
    """DeepSpeed's Muon keys; unset ones take MuonWithAuxAdam's per-half defaults (optim/muon.py)."""

    lr: NonNegFloat = None
    muon_lr: NonNegFloat = None
    adam_lr: NonNegFloat = None
    momentum: Float(ge=0, le=1) = None
    weight_decay: NonNegFloat = None
    ns_method: Str = None
    betas: Betas = None
    eps: NonNegFloat = None
    adam_w_mode: Bool = True
    torch_adam: Bool = False
    per_head_muon: Bool = False


_ONEBIT_PARAMS = {"onebitadam": (_OneBitAdamParams, OneBitAdam), "zerooneadam": (_ZeroOneAdamParams, ZeroOneAdam),
                  "onebitlamb": (_OneBitLambParams, OneBitLamb)}


class _TorchCommonParams(Section):
    """Types of the usual torch.optim arguments; checked only when present."""

    lr: NonNegFloat = None
    betas: Betas = None
    eps: NonNegFloat = None
    weight_decay: NonNegFloat = None
    momentum: NonNegFloat = None
    dampening: NonNegFloat = None
    lr_decay: NonNegFloat = None
    initial_accumulator_value: NonNegFloat = None
    alpha: NonNegFloat = None
    nesterov: Bool = None
    amsgrad: Bool = None
    maximize: Bool = None
    centered: Bool = None


def _validate(model: type[Section], params: dict, *, only_set: bool = False) -> dict:
    try:
        return model.model_validate(params).model_dump(exclude_unset=only_set)
    except ValidationError as error:
        raise ConfigError(problems_from(error, model, ("optimizer", "params"))) from None


# ----------------------------------------------------------------------------------------------
# One builder per family: the only place that picks the implementation.


def _adam(param_groups: list, *, adamw: bool, cpu: bool = False, **hyper):
    """DeepSpeed FusedAdam semantics; decoupled weight decay when `adamw`, else L2 into the gradient.
    `cpu`: CPUAdam (DeepSpeedCPUAdam), the same update on host tensors."""
    if cpu:
        hyper.pop("set_grad_none", None)
        return CPUAdam(param_groups, adamw_mode=adamw, **hyper)
    return FusedAdam(param_groups, adam_w_mode=adamw, **hyper)


def _lamb(param_groups: list, **hyper) -> FusedLamb:
    """DeepSpeed FusedLamb semantics (see lightspeed.ops.lamb)."""
    return FusedLamb(param_groups, **hyper)


def _lion(param_groups: list, cpu: bool = False, **hyper):
    """DeepSpeed FusedLion semantics (see lightspeed.ops.lion); CPULion with `cpu`."""
    if cpu:
        hyper.pop("set_grad_none", None)
        return CPULion(param_groups, **hyper)
    return FusedLion(param_groups, **hyper)


_FUSED_ADAGRAD_KEYS = ("lr", "lr_decay", "weight_decay", "initial_accumulator_value", "eps")


def _adagrad(param_groups: list, params: dict, cpu: bool = False):
    """FusedAdagrad (torch.optim.Adagrad's update); torch.optim.Adagrad itself for params it lacks.
    `cpu`: CPUAdagrad (DeepSpeedCPUAdagrad), which takes lr, eps and weight_decay."""
    if cpu and set(params) <= {"lr", "eps", "weight_decay"}:
        checked = _validate(_TorchCommonParams, params, only_set=True) if params else {}
        return CPUAdagrad(param_groups, **{**params, **checked})
    if set(params) <= set(_FUSED_ADAGRAD_KEYS):
        checked = _validate(_TorchCommonParams, params, only_set=True) if params else {}
        return FusedAdagrad(param_groups, **{**params, **checked})
    logger.info(f"optimizer: Adagrad params {sorted(set(params) - set(_FUSED_ADAGRAD_KEYS))} are not "
                "FusedAdagrad's; building torch.optim.Adagrad")
    return _torch_optimizer(torch.optim.Adagrad, param_groups, params)


def _muon(param_groups: list, params: dict, cpu: bool = False) -> Muon:
    """DeepSpeed's MuonWithAuxAdam over the `use_muon` halves of `param_groups` (see optim/muon.py)."""
    hyper = _validate(_MuonParams, params, only_set=True)
    if hyper.pop("per_head_muon", False):
        raise ConfigError("optimizer.params.per_head_muon: per-head Muon is not built in lightspeed")
    if hyper.pop("torch_adam", False):
        raise ConfigError("optimizer.params.torch_adam: Muon's Adam half is its own inline AdamW in lightspeed; "
                          "torch.optim's is not built for it")
    if cpu:
        raise ConfigError("zero_optimization.offload_optimizer: Muon with the optimizer offloaded is not built "
                          "in lightspeed")
    if hyper.get("ns_method", "gram") not in ("gram", "standard"):
        raise ConfigError(f"optimizer.params.ns_method: must be \"gram\" or \"standard\", got "
                          f"{show(hyper['ns_method'])}")
    adam_w_mode = hyper.pop("adam_w_mode", True)
    return Muon(muon_param_groups(param_groups, hyper), adam_w_mode=adam_w_mode)


def _mup(display: str, param_groups: list, params: dict):
    """mup's MuAdam / MuAdamW / MuSGD (the `mup` package): a torch.optim optimizer whose groups mup
    rescales by each parameter's width multiplier (the model's `set_base_shapes`)."""
    try:
        import mup
    except ImportError:
        raise ConfigError(f"optimizer.type: {display} is mup's optimizer and needs the `mup` package, which is not "
                          "installed (pip install mup)") from None
    common = {k: v for k, v in params.items() if k in _TorchCommonParams.model_fields}
    params = {**params, **_validate(_TorchCommonParams, common, only_set=True)}
    return getattr(mup, display)(param_groups, **params)


def _torch_optimizer(cls: type, param_groups: list, params: dict):
    problems = kwargs_problems(cls, params, "optimizer.params", skip=("params",))
    common = {k: v for k, v in params.items() if k in _TorchCommonParams.model_fields}
    try:
        params = {**params, **_validate(_TorchCommonParams, common, only_set=True)}
    except ConfigError as error:
        problems += error.problems
    if problems:
        raise ConfigError(problems)
    return cls(param_groups, **params)


def _torch_class(type_name: str) -> type:
    """torch.optim.<type_name>, matched exactly first, then case-insensitively."""
    names = [
        n
        for n in dir(torch.optim)
        if n != "Optimizer" and isinstance(getattr(torch.optim, n), type)
        and issubclass(getattr(torch.optim, n), torch.optim.Optimizer)
    ]
    if type_name in names:
        return getattr(torch.optim, type_name)
    by_lower = {n.lower(): n for n in names}
    if type_name.lower() in by_lower:
        return getattr(torch.optim, by_lower[type_name.lower()])
    hint = suggest(type_name, _DISPLAY_NAMES + names)
    raise ConfigError(f"optimizer.type: unknown optimizer {show(type_name)}{hint}")


def _onebit(name: str, param_groups: list, params: dict, comm: Communicator | None):
    """A one-bit optimizer over a compressed all-reduce on `comm` (the data-parallel communicator)."""
    model, cls = _ONEBIT_PARAMS[name]
    if comm is None:
        raise ConfigError(f"optimizer.type: {_ONEBIT[name]} communicates by itself and needs the data-parallel "
                          "communicator (build_optimizer(..., comm=...); initialize() passes it)")
    hyper = _validate(model, params)
    return cls(param_groups, codec=OneBitAllReduce(comm), group_backend=comm.backend, **hyper)


def build_optimizer(optimizer_config, model_parameters: Iterable, cpu_offload: bool = False,
                    comm: Communicator | None = None) -> torch.optim.Optimizer:
    """The optimizer named by `optimizer_config` (`.type`/`.params`, or a dict) over
    `model_parameters` (tensors or param-group dicts, whose own keys override the params). `comm` is
    the data-parallel communicator, needed by the one-bit optimizers only; `cpu_offload` builds the CPU
    kernels (see Note [optimizer offload]).

    Bad types and params raise ConfigError naming `optimizer.type` / `optimizer.params.<key>`, as do
    MuAdam/MuAdamW/MuSGD without the `mup` package.
    """
    optimizer = make_optimizer(optimizer_config, model_parameters, cpu_offload, comm)
    logger.info(f"optimizer: {read_section(optimizer_config, 'optimizer')[0]} -> "
                f"{type(optimizer).__module__}.{type(optimizer).__qualname__}")
    return optimizer


def make_optimizer(optimizer_config, model_parameters: Iterable, cpu_offload: bool = False,
                   comm: Communicator | None = None) -> torch.optim.Optimizer:
    """`build_optimizer` without the log line."""
    type_name, params = read_section(optimizer_config, "optimizer")
    param_groups = list(model_parameters)
    if not param_groups:
        raise ValueError("build_optimizer: model_parameters is empty")
    if "max_grad_norm" in params:
        raise ConfigError(
            "optimizer.params.max_grad_norm: not supported as an optimizer parameter; "
            "use the top-level gradient_clipping"
        )
    name = type_name.lower()
    try:
        return _onebit(name, param_groups, params, comm) if name in _ONEBIT else _build(
            name, type_name, param_groups, params, cpu_offload)
    except (TypeError, ValueError) as error:
        if isinstance(error, ConfigError):
            raise
        raise ConfigError(f"optimizer.params: {type_name} rejected them: {error}") from error


def _build(name: str, type_name: str, param_groups: list, params: dict, cpu: bool = False):
    if name in ("adam", "adamw"):
        flags = _validate(_AdamFlags, {k: params.pop(k) for k in list(params) if k in _AdamFlags.model_fields})
        adamw = name == "adamw" or flags["adam_w_mode"]
        if flags["torch_adam"]:
            return _torch_optimizer(torch.optim.AdamW if adamw else torch.optim.Adam, param_groups, params)
        hyper = _validate(_FusedAdamParams, params)
        if hyper.pop("amsgrad"):
            raise ConfigError(
                "optimizer.params.amsgrad: FusedAdam does not support the AMSGrad variant "
                "(set torch_adam: true to use torch.optim's)"
            )
        return _adam(param_groups, adamw=adamw, cpu=cpu, **hyper)
    if name == "lamb":
        hyper = _validate(_FusedLambParams, params)
        if hyper.pop("amsgrad"):
            raise ConfigError("optimizer.params.amsgrad: FusedLamb does not support the AMSGrad variant")
        return _lamb(param_groups, **hyper)
    if name == "lion":
        return _lion(param_groups, cpu=cpu, **_validate(_FusedLionParams, params))
    if name == "adagrad":
        return _adagrad(param_groups, params, cpu)
    if name == "muon":
        return _muon(param_groups, params, cpu)
    if name in _MUP:
        return _mup(_MUP[name], param_groups, params)
    return _torch_optimizer(_torch_class(type_name), param_groups, params)
