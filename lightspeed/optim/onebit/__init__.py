"""DeepSpeed's compressed-communication optimizers: 1-bit Adam, 0/1 Adam, 1-bit LAMB. Each receives a
`lightspeed.comm.onebit.OneBitAllReduce` and tells the strategy, through `owns_gradient_reduction()`
(`base.ReducesOwnGradients`), when it wants the gradients left local."""

from lightspeed.optim.onebit.adam import OneBitAdam
from lightspeed.optim.onebit.base import ReducesOwnGradients
from lightspeed.optim.onebit.common import OneBitOptimizer
from lightspeed.optim.onebit.lamb import OneBitLamb
from lightspeed.optim.onebit.zoadam import ZeroOneAdam

__all__ = ["OneBitAdam", "ZeroOneAdam", "OneBitLamb", "OneBitOptimizer", "ReducesOwnGradients"]
