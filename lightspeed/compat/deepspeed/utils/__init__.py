"""`deepspeed.utils`: the logger, `log_dist`, `RepeatingLoader`, `OnDevice`, `groups`, and the comm
functions DeepSpeed re-exports here (`is_initialized`), ZeRO-3 leaf modules set from code
(`set_z3_leaf_modules`, `set_z3_leaf_modules_by_name`, ...: lightspeed.zero.stage3.units) and the parameter accessors
(`safe_get_full_fp32_param`, `safe_update_full_grad_vectorized`, ...: lightspeed.zero.param_access), the
`groups` functions DeepSpeed re-exports here (`get_data_parallel_group`, `get_tensor_model_parallel_rank`,
...), and `log_dist_once`, `set_log_level_from_string`, `recursive_getattr` / `recursive_setattr`."""

import functools
import importlib
import logging

from lightspeed._utils.init_on_device import OnDevice
from lightspeed._utils.logging import current_rank, get_logger
from lightspeed.comm.api import get_local_rank, is_initialized
from lightspeed.runtime.dataloader import RepeatingLoader
from lightspeed.zero.stage3.units import (_mark, get_z3_leaf_modules, set_z3_leaf_modules,
                                          set_z3_leaf_modules_by_name, set_z3_leaf_modules_by_suffix,
                                          unset_z3_leaf_modules, z3_leaf_module)

logger = get_logger("lightspeed")


def log_dist(message: str, ranks=None, level: int = logging.INFO) -> None:
    """Log `message` on the given global ranks (None or [-1]: every rank), as DeepSpeed's log_dist."""
    rank = current_rank()
    if ranks is None or -1 in ranks or rank in ranks:
        # a record outside the rank-0 filter's reach: the caller chose which ranks speak
        get_logger("lightspeed.log_dist").log(level, "[Rank %d] %s", rank, message, extra={"all_ranks": True})


def log_dist_once(message: str, ranks=None, level: int = logging.INFO) -> None:
    """`log_dist`, once per process for each (message, ranks, level)."""
    _log_dist_once(message, None if ranks is None else tuple(ranks), level)


@functools.lru_cache(maxsize=None)
def _log_dist_once(message: str, ranks, level: int) -> None:
    log_dist(message, ranks=None if ranks is None else list(ranks), level=level)


_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR,
           "critical": logging.CRITICAL}


def set_log_level_from_string(log_level_str: str, custom_logger=None) -> None:
    """Sets the level of `custom_logger` (default: lightspeed's logger) and of its handlers from "debug",
    "info", "warning", "error" or "critical"."""
    level = _LEVELS.get(str(log_level_str).lower())
    if level is None:
        raise ValueError(f"set_log_level_from_string: must be one of {', '.join(_LEVELS)} (got {log_level_str!r})")
    target = logger if custom_logger is None else custom_logger
    target.setLevel(level)
    for handler in target.handlers:
        handler.setLevel(level)


def set_z3_leaf_module(model, flag: bool) -> None:
    """Marks (`flag` True) or unmarks one module as a ZeRO-3 leaf, as `set_z3_leaf_modules` does."""
    _mark([model], flag)


# DeepSpeed 0.19's `deepspeed.utils.recursive_getattr` / `recursive_setattr`: the compression helpers' own
from lightspeed.compat.deepspeed.compression.helper import recursive_getattr, recursive_setattr  # noqa: E402,F401


# the `deepspeed.utils.groups` functions DeepSpeed's `deepspeed.utils` re-exports (`from .groups import *`)
_GROUP_NAMES = ("get_data_parallel_group", "get_data_parallel_rank", "get_data_parallel_world_size",
                "get_model_parallel_group", "get_model_parallel_rank", "get_model_parallel_world_size",
                "get_tensor_model_parallel_group", "get_tensor_model_parallel_rank",
                "get_tensor_model_parallel_src_rank", "get_tensor_model_parallel_world_size", "initialize",
                "DeprecatedException")


def __getattr__(name: str):
    if name in ("groups", "torch", "zero_to_fp32"):
        return importlib.import_module(f"{__name__}.{name}")
    if name in _GROUP_NAMES:
        return getattr(importlib.import_module(f"{__name__}.groups"), name)
    if name in ("safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
                "safe_set_full_fp32_param", "safe_set_full_optimizer_state", "safe_get_local_fp32_param",
                "safe_get_local_grad", "safe_get_local_optimizer_state", "safe_set_full_grad",
                "safe_set_local_fp32_param", "safe_set_local_grad", "safe_set_local_optimizer_state",
                "safe_update_full_grad_vectorized"):
        from lightspeed.zero import param_access as fragments

        return getattr(fragments, name)
    raise AttributeError(f"module 'deepspeed.utils' (lightspeed) has no attribute {name!r}")


__all__ = ["OnDevice", "RepeatingLoader", "get_local_rank", "get_z3_leaf_modules", "groups", "is_initialized",
           "log_dist", "log_dist_once", "logger", "recursive_getattr", "recursive_setattr", "set_log_level_from_string",
           "set_z3_leaf_module", "set_z3_leaf_modules", "set_z3_leaf_modules_by_name", "set_z3_leaf_modules_by_suffix",
           "unset_z3_leaf_modules", "z3_leaf_module"]
