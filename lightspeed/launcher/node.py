"""`python -m lightspeed.launcher.node`: the per-node entry point that pdsh, ssh, mpirun and srun start
on every host of a multi-node job (DeepSpeed's `deepspeed.launcher.launch`, with its option names).

Owns turning that command line into a `NodePlan` for this host, including finding which node of the
world this is: --node_rank when given (pdsh's %n, ssh), else this host's name among the world's
hosts, else the rank the process starter gave (mpirun's OMPI_COMM_WORLD_RANK, srun's SLURM_PROCID,
PMI_RANK) with one agent started per node. Everything else is `local.run_node`.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading
from typing import Optional

from lightspeed._utils.logging import get_logger, log_all_ranks
from lightspeed.launcher.errors import LaunchError
from lightspeed.launcher.hostfile import Resources, decode_world_info, encode_world_info
from lightspeed.launcher.local import NodePlan, run_node

logger = get_logger(__name__)

NODE_MODULE = "lightspeed.launcher.node"

STARTER_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID")
DEFAULT_MASTER_PORT = 29500  # torch.distributed's, DeepSpeed's


def node_options(plan: NodePlan) -> list[str]:
    """The options of `build_parser` that carry `plan`, other than world, node rank and master."""
    opts = [flag for flag, on in (("--module", plan.module), ("--no_python", plan.no_python),
                                  ("--no_local_rank", plan.no_local_rank), ("--as_deepspeed", plan.as_deepspeed),
                                  ("--cpu", plan.cpu)) if on]
    if plan.max_restarts:
        opts.append(f"--max_restarts={plan.max_restarts}")
    if plan.each_rank_log:
        opts.append(f"--enable_each_rank_log={os.path.abspath(plan.each_rank_log)}")
    if plan.bind_cores:
        opts.append("--bind_cores_to_rank")
        if plan.bind_core_list:
            opts.append(f"--bind_core_list={plan.bind_core_list}")
    if plan.elastic is not None:
        opts += ["--enable_elastic_training", f"--min_elastic_nodes={plan.elastic[0]}",
                 f"--max_elastic_nodes={plan.elastic[1]}"]
    if plan.run_id:
        opts.append(f"--run_id={plan.run_id}")
    return opts


def node_command(plan: NodePlan, node_rank: Optional[str], python: str = sys.executable,
                 extra: tuple[str, ...] = ()) -> list[str]:
    """The command that runs `plan` on one host; `node_rank` None: the agent finds it (mpirun, srun),
    a string so pdsh's ``%n`` fits."""
    cmd = [python, "-u", "-m", NODE_MODULE, f"--world_info={encode_world_info(plan.world_info)}"]
    if node_rank is not None:
        cmd.append(f"--node_rank={node_rank}")
    cmd.append(f"--master_addr={plan.master_addr}")
    if plan.master_port is not None:
        cmd.append(f"--master_port={plan.master_port}")
    return cmd + node_options(plan) + list(extra) + [plan.script, *plan.script_args]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m lightspeed.launcher.node", allow_abbrev=False,
                                description="Run this node's share of a lightspeed job (started by `lightspeed`).")
    p.add_argument("--world_info", required=True, help="base64 JSON of {host: [slot, ...]} for the whole job")
    p.add_argument("--node_rank", type=int, default=-1, help="this node's index in world_info (default: found)")
    p.add_argument("--master_addr", default="127.0.0.1")
    p.add_argument("--master_port", type=int, default=None,
                   help=f"default: {DEFAULT_MASTER_PORT}, or a free port when the job has one node")
    p.add_argument("--module", action="store_true")
    p.add_argument("--no_python", action="store_true")
    p.add_argument("--no_local_rank", action="store_true")
    p.add_argument("--as_deepspeed", action="store_true")
    p.add_argument("--max_restarts", type=int, default=0)
    p.add_argument("--enable_each_rank_log", default=None, metavar="DIR")
    p.add_argument("--bind_cores_to_rank", action="store_true")
    p.add_argument("--bind_core_list", default=None)
    p.add_argument("--enable_elastic_training", action="store_true")
    p.add_argument("--min_elastic_nodes", type=int, default=-1)
    p.add_argument("--max_elastic_nodes", type=int, default=-1)
    p.add_argument("--cpu", action="store_true", help="CPU processes: leave CUDA_VISIBLE_DEVICES alone")
    p.add_argument("--run_id", default="")
    p.add_argument("--stop_on_stdin_eof", action="store_true",
                   help="stop every worker when stdin closes (the ssh launcher's connection went away)")
    p.add_argument("training_script")
    p.add_argument("training_script_args", nargs=argparse.REMAINDER)
    return p


def _host_names() -> set[str]:
    name = socket.gethostname()
    names = {name, name.split(".")[0], socket.getfqdn()}
    if os.environ.get("SLURMD_NODENAME"):
        names.add(os.environ["SLURMD_NODENAME"])
    return names


def resolve_node_rank(world: Resources, node_rank: int, environ: dict[str, str],
                      host_names: Optional[set[str]] = None) -> int:
    """This node's index in `world` (order in the module docstring)."""
    hosts = list(world)
    if node_rank >= 0:
        if node_rank >= len(hosts):
            raise LaunchError(f"--node_rank {node_rank} but the job has {len(hosts)} nodes")
        return node_rank
    matches = [i for i, host in enumerate(hosts) if host in (host_names if host_names is not None else _host_names())]
    if len(matches) == 1:
        return matches[0]
    for var in STARTER_RANK_VARS:
        if environ.get(var, "").isdigit() and int(environ[var]) < len(hosts):
            return int(environ[var])
    raise LaunchError(f"cannot tell which of the job's nodes ({', '.join(hosts)}) this host is: pass --node_rank")


def _stop_when_stdin_closes() -> None:
    def watch():
        try:  # the raw descriptor: a daemon thread blocked in sys.stdin would hold its lock at shutdown
            while os.read(0, 4096):
                pass
        except OSError:
            pass
        logger.warning("the launcher's connection closed: stopping this node's workers")
        os.kill(os.getpid(), signal.SIGTERM)  # the agent's handler stops every worker, then exits

    threading.Thread(target=watch, name="stdin-eof", daemon=True).start()


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    log_all_ranks()  # this process is a node's agent, not a rank: its messages matter on every node
    try:
        world = decode_world_info(args.world_info)
        node_rank = resolve_node_rank(world, args.node_rank, dict(os.environ))
    except LaunchError as e:
        logger.error(str(e))
        return 2
    elastic = None
    if args.enable_elastic_training:
        elastic = (max(args.min_elastic_nodes, 1), args.max_elastic_nodes if args.max_elastic_nodes > 0 else len(world))
    master_port = args.master_port
    if master_port is None and (len(world) > 1 or elastic is not None):
        master_port = DEFAULT_MASTER_PORT
    plan = NodePlan(world_info=world, node_rank=node_rank, script=args.training_script,
                    script_args=args.training_script_args, master_addr=args.master_addr,
                    master_port=master_port, module=args.module, no_python=args.no_python,
                    no_local_rank=args.no_local_rank, as_deepspeed=args.as_deepspeed,
                    max_restarts=args.max_restarts,
                    each_rank_log=args.enable_each_rank_log, bind_cores=args.bind_cores_to_rank,
                    bind_core_list=args.bind_core_list, elastic=elastic, cpu=args.cpu, run_id=args.run_id)
    if args.stop_on_stdin_eof:
        _stop_when_stdin_closes()
    return run_node(plan)


if __name__ == "__main__":
    sys.exit(main())
