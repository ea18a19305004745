"""Run a function in `world_size` real processes joined by a gloo process group; collect the results.

Used by the dist tests: `run_world(fn, 4, *args)` returns `[fn(*args) on rank 0, ..., on rank 3]`.
Children come from a forkserver that has already imported torch, so each starts in a fraction of a
second and never inherits the test runner's threads. A child that raises makes `run_world` raise with
that rank's traceback; a child that hangs is killed at `timeout` seconds, and the error holds the
stacks its threads were in shortly before.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import pickle
import queue
import tempfile
import time
import traceback
from typing import Any, Callable

from lightspeed.comm.init import free_port

_CTX = None


def _context():
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "torch.distributed", "lightspeed"])
    return _CTX


def _child(rank: int, world_size: int, port: int, backend: str, fn: Callable, args: tuple, kwargs: dict,
           results, env: dict[str, str], stacks: tuple[str, float]) -> None:
    # a rank still running shortly before the parent gives up writes its threads' stacks where the parent
    # reads them into its error (the child's stderr is the forkserver's, not the test's)
    path, after = stacks
    stack_file = open(path, "w")  # noqa: SIM115 (open for the life of the process: faulthandler writes to it)
    faulthandler.dump_traceback_later(after, exit=False, file=stack_file)
    os.environ.update(env)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), LIGHTSPEED_ACCELERATOR=os.environ.get("LIGHTSPEED_ACCELERATOR", "cpu"))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(backend=backend, rank=rank, world_size=world_size)
        try:
            # plain pickle bytes: tensors travel by value, not as shared-memory handles that die with the child
            report = (rank, "ok", pickle.dumps(fn(*args, **kwargs)))
        except BaseException:  # report every failure, including SystemExit, to the parent
            report = (rank, "error", traceback.format_exc())
        # before the teardown: with NCCL, destroy_process_group can block on a peer that failed mid-collective
        results.put(report)
        dist.destroy_process_group()
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


class WorldError(RuntimeError):
    pass


def run_world(fn: Callable, world_size: int, *args: Any, backend: str = "gloo", timeout: float = 240,
              env: dict[str, str] | None = None, **kwargs: Any) -> list[Any]:
    """Run `fn(*args, **kwargs)` on ranks 0..world_size-1 (fn must be importable: module level)."""
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    stack_dir = tempfile.TemporaryDirectory(prefix="run_world_")
    stack_path = [os.path.join(stack_dir.name, f"rank{r}.txt") for r in range(world_size)]
    dump_after = max(timeout - 3, timeout / 2)
    procs = [ctx.Process(target=_child, args=(r, world_size, port, backend, fn, args, kwargs, results, env or {},
                                              (stack_path[r], dump_after)), daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    outputs: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outputs) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(outputs))
                raise WorldError(f"run_world: ranks {missing} did not finish within {timeout:.0f} s"
                                 + "".join(_stacks(r, stack_path[r]) for r in missing))
            try:
                rank, status, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in outputs]
                if dead:
                    raise WorldError(f"run_world: rank {dead[0]} died with exit code {procs[dead[0]].exitcode}")
                continue
            if status == "error":
                raise WorldError(f"run_world: rank {rank} raised:\n{value}")
            outputs[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        stack_dir.cleanup()
    return [outputs[r] for r in range(world_size)]


def _stacks(rank: int, path: str) -> str:
    """What a hanging rank's faulthandler wrote (its threads' stacks), for the error message."""
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        text = ""
    return f"\nrank {rank} stacks{' (none written)' if not text else ''}:\n{text[-4000:]}"
