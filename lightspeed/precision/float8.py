"""Float8 training of the model's linear layers (the ``float8`` config section), through torchao.

Owns: the swap of `nn.Linear` layers for torchao's `Float8Linear` (`convert_to_float8_training` with
`Float8LinearConfig.from_recipe_name`), which layers qualify, and the error when torchao is missing.
A `Float8Linear` keeps the layer's own weight and bias Parameters (the same objects, so tied weights,
the optimizer's parameter list and the ZeRO strategies see nothing new); its forward casts input,
weight and output gradient to float8 with dynamic scales and runs `torch._scaled_mm`. Masters,
gradients and optimizer state stay as the precision mode keeps them. Must not: touch the strategy,
the optimizer or the loss scale.

Note (which layers): a layer is converted unless its fully-qualified name contains one of
`float8.filter_fqns`, or either dimension is not a multiple of 16 (`_scaled_mm` needs both; torchao's
own recipes skip such layers the same way). The conversion runs in `initialize()` before the strategy
is built (stage 3 then shards the converted model), and `engine.compile()` compiles it like any other.
"""

from __future__ import annotations

import dataclasses

import torch

from lightspeed._utils.logging import get_logger

logger = get_logger(__name__)

TORCHAO_PIN = "torchao==0.18.0"  # the version the float8 extra pins (works with torch 2.11 and 2.13)
DIM_MULTIPLE = 16


def _torchao_float8():
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as err:
        raise ImportError(f"float8.enabled needs torchao: pip install 'lightspeed[float8]' (pins {TORCHAO_PIN})") from err
    return Float8LinearConfig, convert_to_float8_training


def convert_to_float8(module: torch.nn.Module, cfg) -> list[str]:
    """Swap `module`'s qualifying `nn.Linear` layers for torchao's float8 training linears in place,
    as `cfg` (the ``float8`` section) says; returns the names of the converted layers (none when
    `cfg.enabled` is false). ImportError naming `float8.enabled` when torchao is missing."""
    if not cfg.enabled:
        return []
    Float8LinearConfig, convert_to_float8_training = _torchao_float8()
    config = Float8LinearConfig.from_recipe_name(cfg.recipe)
    if cfg.emulate:
        config = dataclasses.replace(config, emulate=True)
    converted: list[str] = []
    skipped: list[str] = []

    def qualifies(layer: torch.nn.Module, fqn: str) -> bool:
        if type(layer) is not torch.nn.Linear:
            return False
        if any(part in fqn for part in cfg.filter_fqns):
            return False
        if layer.in_features % DIM_MULTIPLE or layer.out_features % DIM_MULTIPLE:
            skipped.append(f"{fqn} ({layer.in_features}x{layer.out_features})")
            return False
        converted.append(fqn)
        return True

    convert_to_float8_training(module, config=config, module_filter_fn=qualifies)
    logger.info("float8 (%s recipe%s): converted %d linear layer(s)%s", cfg.recipe, ", emulated" if cfg.emulate else "",
                len(converted), f"; kept in high precision (a dimension not a multiple of {DIM_MULTIPLE}): "
                + ", ".join(skipped) if skipped else "")
    if not converted:
        logger.warning("float8.enabled: no linear layer qualified (filter_fqns %s, dimensions multiples of %d)",
                       list(cfg.filter_fqns), DIM_MULTIPLE)
    return converted
