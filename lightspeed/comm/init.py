"""Process-group start-up: `init_distributed`, reading rank and world size from the environment that
started this process (torchrun / the `lightspeed` launcher, SLURM, Open MPI), DeepSpeed-style.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from lightspeed._utils.logging import get_logger

logger = get_logger(__name__)

DEFAULT_TIMEOUT = timedelta(minutes=30)


@dataclass(frozen=True)
class LaunchEnv:
    """Rank layout of this process and which launcher it came from."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    source: str  # "torchrun", "slurm", "openmpi", "arguments" or "single-process"


def _first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM nodelist such as `node[01-04,07],other` or `rack[1-2]-n[01-08]-ib`
    (no scontrol needed): the first entry, with each bracket group replaced by its first value."""
    first = re.split(r",(?![^\[]*\])", nodelist, maxsplit=1)[0]  # commas outside brackets separate hosts
    return re.sub(r"\[([^\]]*)\]", lambda m: m.group(1).split(",")[0].split("-")[0], first)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def detect_launch_env(env: dict[str, str] | None = None, distributed_port: int = 29500) -> LaunchEnv:
    """Read the rank layout from the environment variables of torchrun, SLURM or Open MPI."""
    env = dict(os.environ if env is None else env)
    port = int(env.get("MASTER_PORT", distributed_port))
    if "RANK" in env and "WORLD_SIZE" in env:
        return LaunchEnv(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)),
                         env.get("MASTER_ADDR", "127.0.0.1"), port, "torchrun")
    if "OMPI_COMM_WORLD_RANK" in env:
        return LaunchEnv(int(env["OMPI_COMM_WORLD_RANK"]), int(env["OMPI_COMM_WORLD_SIZE"]),
                         int(env.get("OMPI_COMM_WORLD_LOCAL_RANK", 0)), env.get("MASTER_ADDR", "127.0.0.1"),
                         port, "openmpi")
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        addr = env.get("MASTER_ADDR") or _first_slurm_host(env.get("SLURM_NODELIST", env.get("SLURM_JOB_NODELIST", "127.0.0.1")))
        return LaunchEnv(int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0)),
                         addr, port, "slurm")
    return LaunchEnv(0, 1, 0, env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", 0)) or free_port(),
                     "single-process")


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() and os.environ.get("LIGHTSPEED_ACCELERATOR", "") != "cpu" else "gloo"


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True, distributed_port: int = 29500,
                     verbose: bool = True, timeout: timedelta | None = DEFAULT_TIMEOUT, init_method: str | None = None,
                     dist_init_required: bool | None = None, config=None, rank: int = -1,
                     world_size: int = -1) -> None:
    """Start torch.distributed (nccl on CUDA, gloo on CPU) unless it is already started.

    Rank and world size come from the arguments when given, else from torchrun / the `lightspeed`
    launcher, SLURM or Open MPI variables, else a single process on this host. The variables
    torch.distributed's env:// reads (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) are set
    from what was found, so later code sees one consistent picture.
    """
    if dist_init_required is False:
        return
    if dist.is_initialized():
        return
    launch = detect_launch_env(distributed_port=distributed_port) if auto_mpi_discovery or "RANK" in os.environ \
        else detect_launch_env({k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "SLURM_"))},
                               distributed_port)
    if rank >= 0 and world_size > 0:
        launch = LaunchEnv(rank, world_size, launch.local_rank, launch.master_addr, launch.master_port, "arguments")
    backend = dist_backend or default_backend()
    os.environ.update(RANK=str(launch.rank), WORLD_SIZE=str(launch.world_size), LOCAL_RANK=str(launch.local_rank),
                      MASTER_ADDR=launch.master_addr, MASTER_PORT=str(launch.master_port))
    if backend == "nccl":
        torch.cuda.set_device(launch.local_rank % torch.cuda.device_count())
    if verbose:
        logger.info("initializing torch.distributed: backend=%s rank=%d world_size=%d (from %s, master %s:%d)",
                    backend, launch.rank, launch.world_size, launch.source, launch.master_addr, launch.master_port)
    dist.init_process_group(backend=backend, init_method=init_method or "env://", rank=launch.rank,
                            world_size=launch.world_size, timeout=timeout or DEFAULT_TIMEOUT)
