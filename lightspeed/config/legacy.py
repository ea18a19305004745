"""Rewrites legacy and alias key names to the current ones, with a warning for the deprecated ones,
before the models see the dict. Mirrors DeepSpeed's mappings:

- top level ``bfloat16`` -> ``bf16``;
- ``"zero_optimization": true|false`` (the pre-dict format) -> ``{"stage": 1|0}``, with a top-level
  ``allgather_size`` becoming ``allgather_bucket_size``;
- ``zero_optimization.cpu_offload`` -> ``offload_optimizer: {"device": "cpu"}``,
  ``cpu_offload_param`` -> ``offload_param: {"device": "cpu"}``, ``cpu_offload_use_pin_memory`` ->
  ``pin_memory`` on both offload blocks (DeepSpeed only warns about the last one; mapping it is what
  the user meant);
- ``zero_optimization.stage3_gather_fp16_weights_on_model_save`` ->
  ``stage3_gather_16bit_weights_on_model_save``;
- DeepSpeed's unprefixed field names of the stage-3 knobs (``prefetch_bucket_size``, ...) -> their
  ``stage3_`` JSON names (accepted silently, as DeepSpeed does: they are aliases, not deprecations);
- ``optimizer.torch_adam`` (beside ``type``, not in ``params``), which DeepSpeed ignores, is dropped with a
  warning naming ``optimizer.params.torch_adam``.

An old and a new name given together with different values is a problem; with equal values the old
one is dropped with the warning. Must not validate anything else.
"""

from __future__ import annotations

import copy

from lightspeed._utils.logging import get_logger
from lightspeed.config.base import show
from lightspeed.config.zero import STAGE3_ALIASES

logger = get_logger(__name__)


def _rename(section: dict, old: str, new: str, where: str, problems: list[str], deprecated: bool) -> None:
    if old not in section:
        return
    value = section.pop(old)
    old_path, new_path = f"{where}{old}", f"{where}{new}"
    if new in section and section[new] != value:
        problems.append(
            f"{old_path}: legacy name of {new_path}; both are given with different values "
            f"({show(value)} and {show(section[new])}), keep only {new_path}"
        )
        return
    section[new] = value
    if deprecated:
        logger.warning(f"config: {old_path} is deprecated, read as {new_path}")


def _offload_flag(zero: dict, old: str, new: str, problems: list[str]) -> None:
    """cpu_offload / cpu_offload_param (bool) -> offload_optimizer / offload_param device."""
    if old not in zero:
        return
    value = zero.pop(old)
    path = f"zero_optimization.{old}"
    if not isinstance(value, bool):
        problems.append(f"{path}: must be true or false (got {show(value)})")
        return
    block = zero.get(new)
    device = block.get("device", "none") if isinstance(block, dict) else "none"
    if value:
        if isinstance(block, dict) and "device" in block and device != "cpu":
            problems.append(
                f'{path}: legacy name of zero_optimization.{new}.device="cpu"; both are given with '
                f"different values (true and {show(device)}), keep only zero_optimization.{new}"
            )
            return
        zero[new] = {**block, "device": "cpu"} if isinstance(block, dict) else {"device": "cpu"}
        logger.warning(f'config: {path} is deprecated, read as zero_optimization.{new}.device="cpu"')
    else:
        if device != "none":
            problems.append(
                f"{path}: false contradicts zero_optimization.{new}.device={show(device)}; "
                f"keep only zero_optimization.{new}"
            )
            return
        logger.warning(f"config: {path} is deprecated (false means no offload); use zero_optimization.{new}")


def _pin_memory(zero: dict, problems: list[str]) -> None:
    if "cpu_offload_use_pin_memory" not in zero:
        return
    value = zero.pop("cpu_offload_use_pin_memory")
    path = "zero_optimization.cpu_offload_use_pin_memory"
    if not isinstance(value, bool):
        problems.append(f"{path}: must be true or false (got {show(value)})")
        return
    targets = [name for name in ("offload_optimizer", "offload_param") if isinstance(zero.get(name), dict)]
    for name in targets:
        block = zero[name]
        if "pin_memory" in block and block["pin_memory"] != value:
            problems.append(
                f"{path}: legacy name of zero_optimization.{name}.pin_memory; both are given with "
                f"different values ({show(value)} and {show(block['pin_memory'])}), keep only the latter"
            )
            continue
        zero[name] = {**block, "pin_memory": value}
    if targets:
        shown = " and ".join(f"zero_optimization.{name}.pin_memory" for name in targets)
        logger.warning(f"config: {path} is deprecated, read as {shown}")
    else:
        logger.warning(f"config: {path} is deprecated and has no effect without an offload block")


def map_legacy(config: dict) -> tuple[dict, list[str]]:
    """A copy of `config` with legacy names rewritten, and the problems found while doing so."""
    out = copy.deepcopy(config)
    problems: list[str] = []
    _rename(out, "bfloat16", "bf16", "", problems, deprecated=True)

    zero = out.get("zero_optimization")
    if isinstance(zero, bool):
        mapped = {"stage": 1 if zero else 0}
        if zero and "allgather_size" in out:
            mapped["allgather_bucket_size"] = out.pop("allgather_size")
        out["zero_optimization"] = mapped
        logger.warning(
            f'config: "zero_optimization": {show(zero)} is the deprecated format, read as '
            f"{show(mapped)}; write zero_optimization as an object with a stage"
        )
    elif isinstance(zero, dict):
        for field_name, json_name in STAGE3_ALIASES.items():
            _rename(zero, field_name, json_name, "zero_optimization.", problems, deprecated=False)
        _rename(
            zero,
            "stage3_gather_fp16_weights_on_model_save",
            "stage3_gather_16bit_weights_on_model_save",
            "zero_optimization.",
            problems,
            deprecated=True,
        )
        _offload_flag(zero, "cpu_offload", "offload_optimizer", problems)
        _offload_flag(zero, "cpu_offload_param", "offload_param", problems)
        _pin_memory(zero, problems)
    optimizer = out.get("optimizer")
    if isinstance(optimizer, dict) and "torch_adam" in optimizer:
        # DeepSpeed reads torch_adam from optimizer.params only and ignores it here (its own tests set it
        # here): dropped, with the warning, so the run is DeepSpeed's
        value = optimizer.pop("torch_adam")
        logger.warning(f"config: optimizer.torch_adam ({show(value)}) has no effect there and is ignored, as in "
                       "DeepSpeed; write optimizer.params.torch_adam to choose torch's Adam")
    return out, problems
