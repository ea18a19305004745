"""A job that leaves its process group to `init_distributed`'s exit handler: it builds a torch optimizer
(whose imports capture the world group in default arguments unless comm/init.py imported them first)
and all-reduces from a gradient hook inside backward. An exit handler registered before
`init_distributed` runs after lightspeed's and writes the threads still alive then to OUT/rank<R>.txt.

A thread that gloo's destructor joined may still be listed for a moment: pthread_join returns when the
kernel clears the thread's tid (mm_release, early in do_exit), and /proc/self/task drops the thread
only when it is released (exit_notify, later); on busy cores the exiting thread can be preempted in
between, and a single listing then shows one `pt_gloo_runloop` (about 1 run in 17 under the full
suite). So the handler lists again for up to 2 s while a runloop thread is listed, with the garbage
collector off: a group that was not freed keeps its runloop threads alive until the process ends, and
still fails the test. The first listing goes to OUT/rank<R>.first.txt."""

import atexit
import gc
import os
import sys
import time

import torch

import lightspeed

out = sys.argv[1]


def _thread_name(tid: str) -> str:
    try:
        with open(f"/proc/self/task/{tid}/comm") as f:
            return f.read().strip()
    except FileNotFoundError:  # the thread ended between listing and reading: it is not alive
        return ""


def _threads():
    return sorted(n for n in map(_thread_name, os.listdir("/proc/self/task")) if n)


def record_threads():
    gc.disable()  # a group held by a reference cycle must stay held: the listings below allocate
    deadline = time.monotonic() + 2.0
    names = first = _threads()
    while "pt_gloo_runloop" in names and time.monotonic() < deadline:  # see the module docstring
        time.sleep(0.01)
        names = _threads()
    with open(os.path.join(out, f"rank{os.environ['RANK']}.txt"), "w") as f:
        f.write("\n".join(names))
    with open(os.path.join(out, f"rank{os.environ['RANK']}.first.txt"), "w") as f:  # for diagnosis
        f.write("\n".join(first))


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
