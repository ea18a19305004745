"""`deepspeed.comm`: lightspeed.comm's DeepSpeed-named functions (`lightspeed/comm/api.py`)."""

from lightspeed.comm.api import *  # noqa: F401,F403
from lightspeed.comm.api import __all__  # noqa: F401
