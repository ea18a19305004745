"""Process groups, collectives and their wire formats. `log_summary` is DeepSpeed's
`deepspeed.comm.log_summary` (the comms logger's table)."""

from lightspeed.comm.comms_logger import log_summary

__all__ = ["log_summary"]
