"""One node's share of a job, run through torch.distributed.run's elastic agent.

Owns `NodePlan` (what this node runs: its slots of the world, the rendezvous, the worker command) and
`run_node`, which hands the plan to `torch.distributed.launcher.api.elastic_launch`. The agent does
the process management: it sets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and
MASTER_PORT for every worker, restarts the whole worker group up to `max_restarts` times, and stops
every worker of the node as soon as one fails. Nothing here spawns or kills processes itself.

Must not import torch at module level (the CLI imports this module while parsing arguments); only
`run_node` does. Must not print: it logs, and returns an exit status.

Note: a failed or stalled job
    The job ends with one line naming the first rank that failed (exits.py's Note says how it is
    found) and why (its error file's message: an uncaught exception's first line, or for a collective
    that timed out, the collective and the timeout, written by comm/watchdog.py),
    torch's per-rank table at debug level. A rank whose collective stalls signals this agent
    (SIGUSR2) before it exits; the agent then asks every worker of this node that handles SIGUSR1
    (faulthandler, registered by `init_distributed`) for its Python stacks, one rank at a time under a
    header naming it, and resumes stopped workers (SIGCONT) so the shutdown's SIGTERM reaches them
    instead of waiting out the agent's 30-second grace period.

Note: rendezvous
    One node without --master_port: c10d on localhost with a port the OS picks, so concurrent jobs
    never collide. Otherwise DeepSpeed's fixed layout: the "static" rendezvous of torchrun
    --node_rank, node 0 hosting the store at master_addr:master_port, node ranks as given, global
    ranks handed out in node order (hosts may have different slot counts). --elastic_training:
    c10d at master_addr:master_port with min..max nodes (torchrun --nnodes=MIN:MAX); nodes get their
    ranks in the order they join, and each node still uses the slots the world info gives its host.
    Once min nodes have joined, a round waits torch's last-call time (30 s) for more; env
    ``LIGHTSPEED_RDZV_LAST_CALL_SECONDS`` sets it. A worker that fails (a peer node gone) restarts the
    group (--max_restarts) at the nodes left: the script resumes from its last checkpoint, which loads
    at any world size, and an ``elasticity`` config gives the batch for the new size.

Note: --local_rank
    DeepSpeed appends ``--local_rank=N`` to every worker's arguments unless --no_local_rank, which
    breaks scripts whose argparse does not declare it. Here it is passed only to scripts whose source
    declares ``"--local_rank"`` (or torch's ``"--local-rank"``, then in that spelling), found by
    scanning the script's text; --no_local_rank turns it off. The value reaches each worker through
    the agent's ``${local_rank}`` argument macro (torch.distributed.launch's mechanism).
"""

from __future__ import annotations

import importlib.machinery
import os
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from lightspeed._utils.logging import get_logger
from lightspeed.launcher.exits import first_failure, job_status
from lightspeed.launcher.hostfile import Resources

logger = get_logger(__name__)

RANK_EXEC = str(Path(__file__).with_name("rank_exec.py"))
LAST_CALL_ENV = "LIGHTSPEED_RDZV_LAST_CALL_SECONDS"
AS_DEEPSPEED = "lightspeed.as_deepspeed"
LOCAL_RANK_MACRO = "${local_rank}"  # torch.distributed.elastic.utils.api.macros.local_rank
# Every node of a job must use the same run id (the static rendezvous keys its store by it), and nodes
# started by hand (--launcher local) have nothing else in common: a constant, as torchrun's "none".
DEFAULT_RUN_ID = "lightspeed"
_LOCAL_RANK_DECL = re.compile(r"""["'](--local[_-]rank)["']""")


@dataclass
class NodePlan:
    """What one node runs. `world_info` is the whole job's ``{host: [slot, ...]}``; this node is
    `node_rank` in its order and runs one worker per slot of its host."""

    world_info: Resources
    node_rank: int
    script: str
    script_args: list[str] = field(default_factory=list)
    master_addr: str = "127.0.0.1"
    master_port: Optional[int] = None  # None: one node, a port the OS picks
    module: bool = False  # run the script as `python -m`
    no_python: bool = False  # the script is an executable
    no_local_rank: bool = False
    as_deepspeed: bool = False  # run the script through `python -m lightspeed.as_deepspeed`
    max_restarts: int = 0
    each_rank_log: Optional[str] = None  # directory for <prefix>_rank<R>.log files
    log_prefix: str = ""  # default: the launch time, as DeepSpeed's %Y%m%d%H%M%S
    bind_cores: bool = False
    bind_core_list: Optional[str] = None  # "0-3,8-11"; default: the cores this process may use
    elastic: Optional[tuple[int, int]] = None  # (min_nodes, max_nodes)
    cpu: bool = False  # CPU processes: no CUDA_VISIBLE_DEVICES, LIGHTSPEED_ACCELERATOR=cpu
    set_visible_devices: bool = True
    run_id: str = ""  # default DEFAULT_RUN_ID; $ELASTIC_RUN_ID when set, as DeepSpeed
    comm_timeout: Optional[float] = None  # seconds, for every rank's LIGHTSPEED_COMM_TIMEOUT; None: inherited

    @property
    def nnodes(self) -> int:
        return len(self.world_info)

    @property
    def host(self) -> str:
        return list(self.world_info)[self.node_rank]

    @property
    def slots(self) -> list[int]:
        return self.world_info[self.host]

    @property
    def nprocs(self) -> int:
        return len(self.slots)

    @property
    def world_size(self) -> int:
        return sum(len(s) for s in self.world_info.values())


def source_root() -> Optional[str]:
    """The source checkout holding this `lightspeed` package, so workers import this lightspeed even
    when it is not installed; None when it is installed in site-packages (already on every path)."""
    root = Path(__file__).resolve().parents[2]
    return None if root.name in ("site-packages", "dist-packages") else str(root)


def _module_source_path(name: str) -> Optional[Path]:
    """The file `python -m name` would run, found without importing anything."""
    path: Optional[list[str]] = [os.getcwd(), *sys.path]
    spec = None
    for part in name.split("."):
        spec = importlib.machinery.PathFinder.find_spec(part, path)
        if spec is None:
            return None
        path = list(spec.submodule_search_locations or [])
    if spec is None or not spec.origin:
        return None
    if spec.submodule_search_locations:  # a package runs its __main__
        return Path(spec.submodule_search_locations[0]) / "__main__.py"
    return Path(spec.origin)


def local_rank_option(plan: NodePlan) -> Optional[str]:
    """``--local_rank`` or ``--local-rank`` when the script declares that option, else None."""
    if plan.no_local_rank or plan.no_python:
        return None
    path = _module_source_path(plan.script) if plan.module else Path(plan.script)
    try:
        source = path.read_text(encoding="utf-8", errors="replace") if path else ""
    except OSError:
        return None
    found = set(_LOCAL_RANK_DECL.findall(source))
    for option in ("--local_rank", "--local-rank"):
        if option in found:
            return option
    return None


def worker_command(plan: NodePlan) -> list[str]:
    """The command every worker of this node runs (before the agent substitutes ``${local_rank}``)."""
    cmd: list[str] = [] if plan.no_python else [sys.executable, "-u"]
    if plan.as_deepspeed:  # registers lightspeed as `deepspeed` in the worker, then runs the script as python would
        cmd += ["-m", AS_DEEPSPEED]
    cmd += [*(["-m"] if plan.module else []), plan.script]
    option = local_rank_option(plan)
    if option:
        cmd.append(f"{option}={LOCAL_RANK_MACRO}")
    cmd += plan.script_args
    shim: list[str] = []
    if plan.bind_cores:
        shim += [f"--cores={plan.bind_core_list or ''}", f"--nprocs={plan.nprocs}"]
    if plan.each_rank_log:
        prefix = plan.log_prefix or time.strftime("%Y%m%d%H%M%S", time.localtime())
        shim += [f"--log_dir={os.path.abspath(plan.each_rank_log)}", f"--log_prefix={prefix}"]
    if shim:
        cmd = [sys.executable, "-u", RANK_EXEC, *shim, "--", *cmd]
    return cmd


def worker_env(plan: NodePlan, environ: dict[str, str]) -> dict[str, str]:
    """Variables to set in this process before the agent starts, which copies its environment into
    every worker (the agent adds RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT itself)."""
    env = {"CROSS_RANK": str(plan.node_rank), "CROSS_SIZE": str(plan.nnodes), "LOCAL_SIZE": str(plan.nprocs),
           "LIGHTSPEED_AGENT_PID": str(os.getpid())}
    if plan.comm_timeout is not None:
        env["LIGHTSPEED_COMM_TIMEOUT"] = f"{plan.comm_timeout:g}"
    if plan.cpu:
        env["LIGHTSPEED_ACCELERATOR"] = "cpu"
    elif plan.set_visible_devices:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, plan.slots))
    root, path = source_root(), environ.get("PYTHONPATH", "")
    if root and root not in path.split(os.pathsep):
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, path) if p)
    if "OMP_NUM_THREADS" not in environ:
        # Like torchrun: otherwise every worker starts one thread per core and they fight over them.
        env["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // plan.nprocs))
    return env


def rendezvous(plan: NodePlan) -> dict:
    """The agent's rendezvous settings for `plan` (rule in the module Note)."""
    if plan.elastic is not None:
        min_nodes, max_nodes = plan.elastic
        configs = {}
        last_call = os.environ.get(LAST_CALL_ENV)
        if last_call:
            configs["last_call_timeout"] = int(last_call)
        return dict(rdzv_backend="c10d", rdzv_endpoint=f"{plan.master_addr}:{plan.master_port}", rdzv_configs=configs,
                    min_nodes=min_nodes, max_nodes=max_nodes)
    if plan.master_port is None:
        assert plan.nnodes == 1, "several nodes need a fixed master port"
        return dict(rdzv_backend="c10d", rdzv_endpoint="localhost:0", rdzv_configs={}, min_nodes=1, max_nodes=1)
    return dict(rdzv_backend="static", rdzv_endpoint=f"{plan.master_addr}:{plan.master_port}",
                rdzv_configs={"rank": plan.node_rank}, min_nodes=plan.nnodes, max_nodes=plan.nnodes)


def failure_reason(rank: int, failure) -> str:
    """One line for the first failed worker (a torch.distributed.elastic ProcessFailure)."""
    message = failure.message
    if isinstance(message, dict):  # @record's format: {"message": "...", "extraInfo": {...}}
        message = message.get("message", "")
    message = str(message or "").strip()
    if message.startswith("To enable traceback see") or re.fullmatch(r"Signal \d+ \(\w+\) received by PID \d+", message):
        message = ""  # torch's texts when the worker wrote no error file: `how` below says as much
    message = message.splitlines()[0] if message else ""
    if job_status(failure) != 128 - failure.exitcode and failure.exitcode < 0:  # see exits.job_status
        how = f"failed (status {job_status(failure)}), then was stopped by the launcher"
    elif failure.exitcode < 0:
        how = f"was killed by {failure.signal_name()}"
    else:
        how = f"exited with status {failure.exitcode}"
    return f"rank {rank} (pid {failure.pid}) {how}" + (f": {message}" if message else "")


def _workers() -> list[tuple[int, str, bool, bool]]:
    """(pid, rank, handles SIGUSR1, stopped) of this process's children, from /proc."""
    found = []
    me = os.getpid()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[1]) != me:
                continue
            with open(f"/proc/{name}/status") as f:
                caught = next((int(line.split()[1], 16) for line in f if line.startswith("SigCgt:")), 0)
            with open(f"/proc/{name}/environ", "rb") as f:
                env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        except (OSError, ValueError, IndexError):
            continue  # exited meanwhile, or not ours to read
        handles = bool(caught >> (signal.SIGUSR1 - 1) & 1)
        found.append((int(name), env.get(b"RANK", b"?").decode(), handles, fields[0] in "tT"))
    return sorted(found, key=lambda w: (len(w[1]), w[1]))


class _StackDumper:
    """The agent's STALL_SIGNAL handler: asks every worker of this node for its Python stacks, once per
    run (rule in the module Note); later stall reports (the resumed workers' own failing collectives)
    add nothing."""

    def __init__(self):
        self.done = False

    def __call__(self, signum=None, frame=None) -> None:
        if not self.done:
            self.done = True
            _dump_worker_stacks()


def _dump_worker_stacks() -> None:
    from lightspeed.comm.watchdog import DUMP_PAUSE_S, STACKS_SIGNAL

    logger.error("a rank stalled in a collective: Python stacks of this node's workers follow")
    for pid, rank, handles, stopped in _workers():
        try:
            if handles:
                logger.error(f"--- stacks of rank {rank} (pid {pid}){' (was stopped)' if stopped else ''}:")
                os.kill(pid, STACKS_SIGNAL)
            if stopped:
                os.kill(pid, signal.SIGCONT)
            if handles:
                time.sleep(DUMP_PAUSE_S)  # its dump ends before the next header
        except ProcessLookupError:
            continue


def run_node(plan: NodePlan) -> int:
    """Run this node's workers under the elastic agent until they finish; return the job's exit status:
    0 when every worker succeeded, else the first failed worker's exit code (128+N for signal N; the
    first by exits.py's rule, not the peers that failed because of it).

    Sets the variables of `worker_env` in this process's environment, which the agent hands on.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    os.environ.update(worker_env(plan, dict(os.environ)))
    cmd = worker_command(plan)
    config = LaunchConfig(
        nproc_per_node=plan.nprocs,
        run_id=plan.run_id or DEFAULT_RUN_ID,
        max_restarts=plan.max_restarts,
        monitor_interval=0.1,  # torchrun's; a failure is noticed within 0.1 s
        **rendezvous(plan),
    )
    logger.info(f"node {plan.node_rank}/{plan.nnodes} ({plan.host}): {plan.nprocs} worker(s) of {plan.world_size}: "
                f"{' '.join(cmd)}")
    from lightspeed.comm.watchdog import STALL_SIGNAL

    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(STALL_SIGNAL, _StackDumper())
    try:
        elastic_launch(config, cmd[0])(*cmd[1:])
    except ChildFailedError as e:
        rank, failure = first_failure(e.failures)
        logger.debug(str(e))
        logger.error(f"job failed: {failure_reason(rank, failure)}")
        return job_status(failure)
    except SignalException as e:
        logger.error(f"stopped by {e.sigval.name}; every worker was stopped")
        return 128 + int(e.sigval)
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # rendezvous timeouts, a port in use: one line, the traceback at debug level
        logger.debug("launch failed", exc_info=True)
        logger.error(f"launch failed: {type(e).__name__}: {e}")
        return 1
    finally:
        if previous is not None:
            signal.signal(STALL_SIGNAL, previous)
    return 0


def launch_local(script: Path, script_args: list[str], nproc: int, run_id: str) -> int:
    """Run `python -u script *script_args` in `nproc` processes on this host (used by `lightspeed demo`).

    Leaves CUDA_VISIBLE_DEVICES as it is; rendezvous on localhost with a port the OS picks."""
    plan = NodePlan(world_info={"localhost": list(range(nproc))}, node_rank=0, script=str(script),
                    script_args=list(script_args), set_visible_devices=False, run_id=run_id)
    return run_node(plan)
