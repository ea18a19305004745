"""`deepspeed.ops.aio`: DeepSpeed's asynchronous-I/O extension builder (`AsyncIOBuilder`, not built by
lightspeed, which reads and writes NVMe swap files with its own readers: lightspeed/offload/nvme.py)."""

from lightspeed.compat.deepspeed.ops.op_builder import AsyncIOBuilder  # noqa: F401

__all__ = ["AsyncIOBuilder"]
