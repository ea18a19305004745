"""`deepspeed.comm.comm` (where DeepSpeed defines the functions `deepspeed.comm` exports)."""

from lightspeed.comm.api import *  # noqa: F401,F403
from lightspeed.comm.api import __all__  # noqa: F401
