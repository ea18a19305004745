"""A job that leaves its process group to `init_distributed`'s exit handler: it builds a torch optimizer
(whose imports capture the world group in default arguments unless comm/init.py imported them first)
and all-reduces from a gradient hook inside backward. An exit handler registered before
`init_distributed` runs after lightspeed's and writes the threads still alive then to OUT/rank<R>.txt."""

import atexit
import os
import sys

import torch

import lightspeed

out = sys.argv[1]


def _thread_name(tid: str) -> str:
    try:
        with open(f"/proc/self/task/{tid}/comm") as f:
            return f.read().strip()
    except FileNotFoundError:  # the thread ended between listing and reading: it is not alive
        return ""


def record_threads():
    names = sorted(n for n in map(_thread_name, os.listdir("/proc/self/task")) if n)
    with open(os.path.join(out, f"rank{os.environ['RANK']}.txt"), "w") as f:
        f.write("\n".join(names))


atexit.register(record_threads)  # registered first, so it runs last
lightspeed.init_distributed()
from lightspeed.comm.collectives import Communicator  # noqa: E402

comm = Communicator()
weight = torch.nn.Parameter(torch.ones(8))
torch.optim.AdamW([weight], lr=0.1)
pending = []
weight.register_post_accumulate_grad_hook(lambda p: pending.append(comm.all_reduce(p.grad, async_op=True)))
(weight * 2).sum().backward()
for work in pending:
    work.wait()
print(f"rank {comm.rank} done", flush=True)
