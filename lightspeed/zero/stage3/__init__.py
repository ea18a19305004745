"""ZeRO stage 3: parameter partitioning (param groups of unit subtrees as the unit of communication, hooks,
prefetch, meta-device construction under `Init`).

Modules, in import order: `param_group` (per-parameter state, the flat sharded group), `init`
(`Init`, the initialization rule), `units` (which module subtrees form the units of communication),
`coordinator` (hooks, trace, prefetch, release), `opaque` (a compiled root's units as opaque ops), `gathered`
(`GatheredParameters`, `register_external_parameter`), `strategy` (`Stage3Strategy`).

How it runs: the unit of communication is a unit module's subtree, FSDP2-style (units.py's rule); a
unit's parameters form one group per `requires_grad` value, and only unit modules have hooks. Forward
pre-hooks all-gather the groups a unit uses (its own, tied ones owned by another unit, and external ones
found by a torch-function mode during the traced first step) into the group's `full_flat` and point each
`param.data` at its view; forward hooks release them unless persistent or reused within
`stage3_max_reuse_distance`, and register a multi-grad hook on the outputs that re-gathers before the
unit's backward. When all of a group's gradients are in, they are reduce-scattered into the accumulated
`grad_shard` (every micro-step, as DeepSpeed). The step agrees fp16 overflow and the global norm across
ranks, steps the optimizer on one flat fp32 piece per (optimizer param group x param group), and writes
the lp shards. `runtime/strategy.py`'s `strategy_places_params` tells `initialize()` not to move a
stage-3 model to the device: the strategy shards it there one group at a time. At a data-parallel world
of one the parameters view their shards (param_group.py's Note: one rank; `Stage3Options.one_rank_views`,
`options.py`'s module constant `ONE_RANK_VIEWS`, turns that off for the machinery's single-process unit tests).

ZeRO++ (comm/zeropp.py) changes only what goes on the wire and how a frozen shard is stored: the fp32
masters, optimizer state and checkpoints are plain ZeRO-3's (a plain ZeRO-3 run loads a ZeRO++
checkpoint); a frozen parameter stored quantized has no in-place fragment (`safe_get_full_fp32_param` on
it raises), and its 16-bit save is the dequantized value.
"""

from lightspeed.zero.stage3.gathered import GatheredParameters, register_external_parameter
from lightspeed.zero.stage3.init import Init, initialize_module_weights
from lightspeed.zero.stage3.param_group import param_state
from lightspeed.zero.stage3.options import Stage3Options
from lightspeed.zero.stage3.strategy import Stage3Strategy

__all__ = ["GatheredParameters", "Init", "Stage3Options", "Stage3Strategy", "initialize_module_weights",
           "param_state", "register_external_parameter"]
