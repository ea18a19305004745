"""Rank 1 raises at once; the other ranks wait for it in the process group's start-up forever."""

import os

if os.environ["RANK"] == "1":
    raise RuntimeError("rank 1 fails on purpose")

import torch.distributed as dist  # noqa: E402

dist.init_process_group("gloo")
dist.barrier()
