"""`lightspeed.utils`: DeepSpeed's `deepspeed.utils` under lightspeed's name, for scripts written
against lightspeed (`from lightspeed.utils import zero_to_fp32`, `lightspeed.utils.log_dist`), without
registering lightspeed as `deepspeed`.

Owns no names: the table is `lightspeed.compat.deepspeed.utils`'s, and `lightspeed.utils.zero_to_fp32`
and `lightspeed.utils.groups` are that package's submodules themselves (registered here under these
names, so `import lightspeed.utils.zero_to_fp32` finds them), never second copies.
"""

import sys

from lightspeed.compat.deepspeed import utils as _deepspeed_utils
from lightspeed.compat.deepspeed.utils import *  # noqa: F401,F403
from lightspeed.compat.deepspeed.utils import groups, zero_to_fp32

for _name, _module in (("groups", groups), ("zero_to_fp32", zero_to_fp32)):
    sys.modules[f"{__name__}.{_name}"] = _module


def __getattr__(name: str):
    try:
        return getattr(_deepspeed_utils, name)  # the names it imports on first use (the parameter accessors)
    except AttributeError:
        raise AttributeError(f"module 'lightspeed.utils' has no attribute {name!r}") from None


def __dir__():
    return sorted(set(globals()) | set(dir(_deepspeed_utils)))


__all__ = [*_deepspeed_utils.__all__, "zero_to_fp32"]
