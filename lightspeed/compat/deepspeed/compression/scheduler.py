"""`deepspeed.compression.scheduler`: `compression_scheduler`, whose construction raises
NotImplementedError (model compression is not built)."""

from lightspeed.compat.deepspeed._missing import missing_class
from lightspeed.compat.deepspeed.compression.compress import COMPRESSION

compression_scheduler = missing_class("deepspeed.compression.scheduler.compression_scheduler", COMPRESSION)

__all__ = ["compression_scheduler"]
