"""Process-group start-up: `init_distributed`, reading rank and world size from the environment that
started this process (torchrun / the `lightspeed` launcher, SLURM, Open MPI), DeepSpeed-style, and the
communication timeout.

Note: communication timeout
    torch's default (30 minutes, DeepSpeed's too) keeps a job whose rank stopped (SIGSTOP, a deadlock,
    a hung collective) alive for half an hour while ranks that die end it in seconds. Here the default
    is `DEFAULT_TIMEOUT` (10 minutes); `init_distributed(timeout=)` sets it, else the environment
    variable LIGHTSPEED_COMM_TIMEOUT (seconds; the launcher's --comm_timeout sets it for every rank),
    else the ds_config's ``comm.timeout_seconds``: `initialize()` reads the config after the group
    exists, so `apply_config_timeout` changes the default group's timeout then, unless one of the
    first two set it.
    The same timeout goes to torch.distributed (gloo raises, NCCL aborts) and to the collective
    watchdog (comm/watchdog.py), which reports which collective stalled and the ranks' stacks. The
    rank heartbeat (comm/heartbeat.py, ``comm.stall_seconds``) names a stalled rank sooner.
    gloo, measured with torch 2.13 on 2026-12-01 (two processes, one sleeping before an
    all_reduce, timeout 3 s): the waiting rank's all_reduce raises RuntimeError "Timed out waiting
    3000ms for recv operation to complete" after 3.0 s; every later collective on that group fails
    at once ("Application timeout caused pair closure"); the peer, once it runs again, gets
    "Connection closed by peer".

Note: teardown
    A process group that `init_distributed` started is destroyed at interpreter exit (atexit), while
    the interpreter is fully alive. Otherwise gloo's worker threads outlive the main thread into
    interpreter finalization, and a worker that drops the last reference to a finished collective
    issued during backward (torch 2.13 stashes a Python `contextvars.Context` in the thread-local
    state every such work copies) takes the GIL to release it, which a finalizing interpreter
    answers by ending the thread: "terminate called without an active exception", SIGABRT, after
    all the work (core dumps: ~AsyncAllreduceWork -> ~ThreadLocalState -> SafePyObject decref ->
    take_gil -> pthread_exit in ProcessGroupGloo::runLoop). Destroying the group frees it only if
    nothing else holds it: torch.distributed.nn.functional's default arguments capture the world
    group when that module is first imported after the group exists (torch's optimizers import it
    through dynamo), so it is imported here first. Freed, the group joins its threads (c10d releases
    the GIL while it does). Measured with benchmarks/exit_abort.py (two CPU processes through the
    launcher, 2026-12-01): 5 SIGABRTs in 94 runs before, none in 60 after. After an
    unhandled exception a gloo group is destroyed too (else a rank that raised may abort at exit the
    same way, and the launcher reports SIGABRT instead of the exception: 1 of the first 3 runs of
    tests/launcher/scripts/stall_job.py --mode raise, none in about 10 since; 2026-12-04), but in a helper thread given `_DESTROY_AFTER_ERROR_S`: gloo's destructor
    first finishes the collectives already queued, which may wait on a live peer up to the timeout;
    past that the process exits with status 1 at once. An NCCL group is left alone then: destroying it
    can block on a peer that failed mid-collective, and the job is ending anyway.
"""

from __future__ import annotations

import atexit
import os
import re
import socket
import sys
import threading
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.nn.functional  # noqa: F401  (before any group exists: see the Note on teardown)

from lightspeed._utils.logging import get_logger
from lightspeed.comm import heartbeat, watchdog

logger = get_logger(__name__)

DEFAULT_TIMEOUT = timedelta(minutes=10)
_TIMEOUT = {"seconds": DEFAULT_TIMEOUT.total_seconds(), "from_config": True}  # may the config still set it
_DESTROY_AFTER_ERROR_S = 5.0
TIMEOUT_ENV = "LIGHTSPEED_COMM_TIMEOUT"


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


def _master_port(env: dict[str, str], default: int, required: bool) -> int:
    """MASTER_PORT as a number; an unreadable one (DeepSpeed's test harness writes "None" beside a file://
    init_method) is `default` when no rendezvous reads it (`required` False), else a ValueError."""
    text = env.get("MASTER_PORT")
    if text is None:
        return default
    try:
        return int(text)
    except ValueError:
        if not required:
            return default
        raise ValueError(f"MASTER_PORT must be a port number (got {text!r})") from None


def detect_launch_env(env: dict[str, str] | None = None, distributed_port: int = 29500,
                      port_required: bool = True) -> LaunchEnv:
    """Read the rank layout from the environment variables of torchrun, SLURM or Open MPI.
    `port_required` False: the rendezvous does not read MASTER_PORT (an explicit init_method)."""
    env = dict(os.environ if env is None else env)
    port = _master_port(env, distributed_port, port_required)
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
    return LaunchEnv(0, 1, 0, env.get("MASTER_ADDR", "127.0.0.1"), _master_port(env, 0, port_required) or free_port(),
                     "single-process")


def comm_timeout(timeout: timedelta | float | None = None, env: dict[str, str] | None = None) -> timedelta:
    """The communication timeout: `timeout` (a timedelta, or seconds) when given, else
    $LIGHTSPEED_COMM_TIMEOUT seconds, else `DEFAULT_TIMEOUT`. ValueError for a non-positive or
    unreadable value."""
    if timeout is None:
        text = (os.environ if env is None else env).get(TIMEOUT_ENV, "").strip()
        if not text:
            return DEFAULT_TIMEOUT
        try:
            seconds = float(text)
        except ValueError:
            raise ValueError(f"{TIMEOUT_ENV} must be a number of seconds (got {text!r})") from None
        if not seconds > 0 or seconds == float("inf"):
            raise ValueError(f"{TIMEOUT_ENV} must be a positive number of seconds (got {text!r})")
        return timedelta(seconds=seconds)
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        timeout = timedelta(seconds=timeout)
    if not isinstance(timeout, timedelta):
        raise TypeError(f"init_distributed(timeout=) takes a datetime.timedelta or seconds (got {type(timeout).__name__})")
    if timeout.total_seconds() <= 0:
        raise ValueError(f"init_distributed(timeout=) must be positive (got {timeout})")
    return timeout


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() and os.environ.get("LIGHTSPEED_ACCELERATOR", "") != "cpu" else "gloo"


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True, distributed_port: int = 29500,
                     verbose: bool = True, timeout: timedelta | float | None = None, init_method: str | None = None,
                     dist_init_required: bool | None = None, config=None, rank: int = -1,
                     world_size: int = -1) -> None:
    """Start torch.distributed (nccl on CUDA, gloo on CPU) unless it is already started.

    Rank and world size come from the arguments when given, else from torchrun / the `lightspeed`
    launcher, SLURM or Open MPI variables, else a single process on this host. The variables
    torch.distributed's env:// reads (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) are set
    from what was found, so later code sees one consistent picture. `timeout` (default: see the module
    Note) bounds every collective and arms the collective watchdog.
    """
    if dist_init_required is False:
        return
    if dist.is_initialized():
        return
    _TIMEOUT["from_config"] = timeout is None and not os.environ.get(TIMEOUT_ENV, "").strip()
    timeout = comm_timeout(timeout)
    _TIMEOUT["seconds"] = timeout.total_seconds()
    port_required = init_method in (None, "env://")
    launch = detect_launch_env(distributed_port=distributed_port, port_required=port_required) \
        if auto_mpi_discovery or "RANK" in os.environ \
        else detect_launch_env({k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "SLURM_"))},
                               distributed_port, port_required)
    if rank >= 0 and world_size > 0:
        launch = LaunchEnv(rank, world_size, launch.local_rank, launch.master_addr, launch.master_port, "arguments")
    backend = dist_backend or default_backend()
    os.environ.update(RANK=str(launch.rank), WORLD_SIZE=str(launch.world_size), LOCAL_RANK=str(launch.local_rank),
                      MASTER_ADDR=launch.master_addr, MASTER_PORT=str(launch.master_port))
    if backend == "nccl":
        torch.cuda.set_device(launch.local_rank % torch.cuda.device_count())
    if verbose:
        logger.info("initializing torch.distributed: backend=%s rank=%d world_size=%d (from %s, master %s:%d), "
                    "communication timeout %g s", backend, launch.rank, launch.world_size, launch.source,
                    launch.master_addr, launch.master_port, timeout.total_seconds())
    dist.init_process_group(backend=backend, init_method=init_method or "env://", rank=launch.rank,
                            world_size=launch.world_size, timeout=timeout)
    watchdog.install(timeout.total_seconds(), launch.rank)
    try:
        store = dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError) as e:  # a backend started without a store (MPI)
        logger.warning("no rank heartbeat (comm.stall_seconds): the process group has no store (%s)", e)
    else:
        heartbeat.install(store, launch.rank, launch.world_size)
    atexit.register(_destroy_at_exit)


def apply_config_timeout(seconds: float) -> float:
    """The ds_config's ``comm.timeout_seconds``: becomes the default group's timeout and the watchdog's
    unless init_distributed(timeout=) or $LIGHTSPEED_COMM_TIMEOUT set one (module Note). Returns the
    timeout in force, in seconds."""
    if _TIMEOUT["from_config"] and dist.is_initialized() and seconds != _TIMEOUT["seconds"]:
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds))
        dog = watchdog.current()
        if dog is not None:
            dog.timeout_s, dog.poll_s = float(seconds), min(1.0, seconds / 10)
        _TIMEOUT["seconds"] = float(seconds)
        logger.info("communication timeout %g s (comm.timeout_seconds)", seconds)
    return _TIMEOUT["seconds"]


def timeout_seconds() -> float:
    """The communication timeout in force (the default before init_distributed)."""
    return _TIMEOUT["seconds"]


def _destroy_at_exit() -> None:
    """Destroy the default process group at exit (rule in the module Note: teardown)."""
    heartbeat.uninstall()
    watchdog.uninstall()
    if not dist.is_initialized():
        return
    if getattr(sys, "last_value", None) is None:
        dist.destroy_process_group()
        return
    if dist.get_backend() != "gloo":
        return
    helper = threading.Thread(target=dist.destroy_process_group, name="lightspeed-destroy-group", daemon=True)
    helper.start()
    helper.join(_DESTROY_AFTER_ERROR_S)
    if helper.is_alive():  # a queued collective waits on a live peer: exit as the exception would
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
