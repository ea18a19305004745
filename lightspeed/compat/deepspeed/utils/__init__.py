"""`deepspeed.utils`: the logger, `log_dist`, `RepeatingLoader`, `OnDevice`, `groups`, and the comm
functions DeepSpeed re-exports here (`is_initialized`), ZeRO-3 leaf modules set from code
(`set_z3_leaf_modules`, `set_z3_leaf_modules_by_name`, ...: lightspeed.zero.stage3.units) and the parameter accessors
(`safe_get_full_fp32_param`, `safe_update_full_grad_vectorized`, ...: lightspeed.zero.param_access)."""

import importlib
import logging

from lightspeed._utils.init_on_device import OnDevice
from lightspeed._utils.logging import current_rank, get_logger
from lightspeed.comm.api import get_local_rank, is_initialized
from lightspeed.runtime.dataloader import RepeatingLoader
from lightspeed.zero.stage3.units import (get_z3_leaf_modules, set_z3_leaf_modules, set_z3_leaf_modules_by_name,
                                          set_z3_leaf_modules_by_suffix, unset_z3_leaf_modules, z3_leaf_module)

logger = get_logger("lightspeed")


def log_dist(message: str, ranks=None, level: int = logging.INFO) -> None:
    """Log `message` on the given global ranks (None or [-1]: every rank), as DeepSpeed's log_dist."""
    rank = current_rank()
    if ranks is None or -1 in ranks or rank in ranks:
        # a record outside the rank-0 filter's reach: the caller chose which ranks speak
        get_logger("lightspeed.log_dist").log(level, "[Rank %d] %s", rank, message, extra={"all_ranks": True})


def __getattr__(name: str):
    if name in ("groups", "torch", "zero_to_fp32"):
        return importlib.import_module(f"{__name__}.{name}")
    if name in ("safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
                "safe_set_full_fp32_param", "safe_set_full_optimizer_state", "safe_get_local_fp32_param",
                "safe_get_local_grad", "safe_get_local_optimizer_state", "safe_set_full_grad",
                "safe_set_local_fp32_param", "safe_set_local_grad", "safe_set_local_optimizer_state",
                "safe_update_full_grad_vectorized"):
        from lightspeed.zero import param_access as fragments

        return getattr(fragments, name)
    raise AttributeError(f"module 'deepspeed.utils' (lightspeed) has no attribute {name!r}")


__all__ = ["OnDevice", "RepeatingLoader", "get_local_rank", "get_z3_leaf_modules", "groups", "is_initialized",
           "log_dist", "logger", "set_z3_leaf_modules", "set_z3_leaf_modules_by_name", "set_z3_leaf_modules_by_suffix",
           "unset_z3_leaf_modules", "z3_leaf_module"]
