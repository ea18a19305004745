"""`deepspeed.runtime.zero.leaf_module_config`: the model of `zero_optimization.leaf_module` and its
defaults under DeepSpeed's names. lightspeed's `LeafModuleConfig` (lightspeed/config/zero.py) is the
model; must not hold any rule of its own."""

from lightspeed.config.zero import DEFAULT_LEAF_MODULE_CLASSES as _CLASSES
from lightspeed.config.zero import LeafModuleConfig as DeepSpeedZeroLeafModuleConfig

DEFAULT_LEAF_MODULE_CLASSES: list[str] = list(_CLASSES)
DEFAULT_LEAF_MODULE_NAMES: list[str] = []
DEFAULT_LEAF_MODULE_NAME_SUFFIXES: list[str] = []

__all__ = ["DeepSpeedZeroLeafModuleConfig", "DEFAULT_LEAF_MODULE_CLASSES", "DEFAULT_LEAF_MODULE_NAMES",
           "DEFAULT_LEAF_MODULE_NAME_SUFFIXES"]
