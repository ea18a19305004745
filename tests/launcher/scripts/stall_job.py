"""A job whose rank 1 stops making progress before a collective that rank 0 waits in: it SIGSTOPs itself
(--mode stop) or sleeps (--mode sleep), or fails there: raises (--mode raise) or SIGKILLs itself (--mode
kill). Rank 0 prints `rank 0 done` only if its wait ended normally."""

import argparse
import os
import signal
import time

parser = argparse.ArgumentParser()
parser.add_argument("--mode", choices=("stop", "sleep", "raise", "kill"), default="stop")
parser.add_argument("--stall_seconds", type=float, default=None, help="comm.stall_seconds")
args = parser.parse_args()

import torch  # noqa: E402

import lightspeed  # noqa: E402
from lightspeed.comm.collectives import Communicator  # noqa: E402

lightspeed.init_distributed()
if args.stall_seconds is not None:
    from lightspeed.comm import heartbeat  # noqa: E402

    heartbeat.set_stall_seconds(args.stall_seconds)  # what initialize() does with comm.stall_seconds
comm = Communicator()
grads = torch.ones(1000, device="cuda" if torch.cuda.is_available() else "cpu")  # NCCL needs CUDA tensors
comm.all_reduce(grads)  # every rank gets here: the group works
if comm.rank == 1:
    print(f"rank 1 stalls at {time.time()}", flush=True)
    if args.mode == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif args.mode == "sleep":
        time.sleep(3600)
    elif args.mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    else:
        raise RuntimeError("rank 1 fails on purpose")
comm.all_reduce(grads, async_op=True).wait()
grads.sum().item()  # NCCL's wait only orders the stream: the host blocks here
print(f"rank {comm.rank} done", flush=True)
