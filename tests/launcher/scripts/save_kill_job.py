"""Two plain processes (no launcher) save a checkpoint in the background; rank 1 is killed (SIGKILL)
while it writes its part, from inside torch.save. Rank 0's commit must notice that rank 1 is gone
rather than wait out the commit timeout. Usage: save_kill_job.py SAVE_DIR."""

import os
import signal
import sys

import torch

import lightspeed
from lightspeed.checkpoint.writer import CheckpointWriter, WriterOptions
from lightspeed.comm.collectives import Communicator


class _KillWhenSaved:
    def __reduce__(self):
        os.kill(os.getpid(), signal.SIGKILL)


lightspeed.init_distributed()
comm = Communicator()
writer = CheckpointWriter(WriterOptions(decoupled=True))  # commit_timeout_s: the default 600 s
files = {f"part_rank{comm.rank}.pt": {"w": torch.ones(4), **({"kill": _KillWhenSaved()} if comm.rank == 1 else {})}}
writer.save(sys.argv[1], "t1", files, comm=comm, dp_rank=comm.rank, num_ranks=comm.world_size)
writer.wait(comm)
print(f"rank {comm.rank} saved", flush=True)
