"""ZeRO stage 3: parameter partitioning (param groups of unit subtrees as the unit of communication, hooks,
prefetch, meta-device construction under `Init`).

Modules, in import order: `param_group` (per-parameter state, the flat sharded group), `init`
(`Init`, the initialization rule), `units` (which module subtrees form the units of communication),
`coordinator` (hooks, trace, prefetch, release), `gathered`
(`GatheredParameters`, `register_external_parameter`), `strategy` (`Stage3Strategy`).
"""

from lightspeed.zero.stage3.gathered import GatheredParameters, register_external_parameter
from lightspeed.zero.stage3.init import Init, initialize_module_weights
from lightspeed.zero.stage3.param_group import param_state
from lightspeed.zero.stage3.strategy import Stage3Options, Stage3Strategy

__all__ = ["GatheredParameters", "Init", "Stage3Options", "Stage3Strategy", "initialize_module_weights",
           "param_state", "register_external_parameter"]
