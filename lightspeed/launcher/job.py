"""From the `lightspeed` command's launcher options to what runs: a `NodePlan` for this node alone, or a
`MultiNodeJob` that starts the per-node agent on every host.

Owns the checks that must pass before any process starts (option values, the script, the hostfile,
--include / --exclude, core binding) and DeepSpeed's order of decisions: resource pool (hostfile, else
this machine's GPUs or --num_procs CPU slots), then --include / --exclude, then --num_nodes and
--num_gpus / --num_procs, then one node or several (more than one active host, or --force_multi).
Raises `LaunchError`; never starts anything and never prints. Imports torch only to count GPUs when
neither a hostfile nor --num_procs says what to run on.

Note: choices that differ from DeepSpeed
    - --master_port: DeepSpeed's 29500 for several nodes and elastic jobs; a one-node job without it
      takes a free port, so two jobs on one machine do not collide.
    - --master_addr: for several nodes, DeepSpeed asks the first host for `hostname -I` over ssh; here
      the first host's name as the hostfile writes it is used (every node must reach it by that name
      already, for ssh).
    - CUDA_VISIBLE_DEVICES set when `lightspeed` starts (no hostfile): its devices are this machine's
      slots, and --include / --exclude / --num_gpus pick among them (DeepSpeed ignores the variable
      when one of those options is given).
    - --bind_core_list implies --bind_cores_to_rank (DeepSpeed ignores the list without it).
"""

from __future__ import annotations

import argparse
import importlib.machinery
import os
import shutil
import sys
from pathlib import Path
from typing import Union

from lightspeed.launcher.errors import LaunchError
from lightspeed.launcher.hostfile import (DEFAULT_HOSTFILE, Resources, limit_resources, pool_from_hostfile,
                                          read_hostfile, select_resources)
from lightspeed.launcher.local import NodePlan
from lightspeed.launcher.multinode import MultiNodeJob, collect_exports
from lightspeed.launcher.node import DEFAULT_MASTER_PORT
from lightspeed.launcher.rank_exec import available_cores, cores_for_rank, parse_core_list


def _check_counts(args: argparse.Namespace) -> None:
    for name in ("num_nodes", "num_gpus", "num_procs", "min_elastic_nodes", "max_elastic_nodes"):
        value = getattr(args, name)
        if value == 0 or value < -1:
            raise LaunchError(f"--{name} must be at least 1 (got {value})")
    if (args.num_nodes > 0 or args.num_gpus > 0 or args.num_procs > 0) and (args.include or args.exclude):
        raise LaunchError("--num_nodes, --num_gpus and --num_procs cannot be combined with --include/--exclude")
    if args.num_gpus > 0 and args.num_procs > 0:
        raise LaunchError("--num_gpus and --num_procs cannot be used together (--num_procs is for CPU runs)")
    if args.master_port is not None and not 1 <= args.master_port <= 65535:
        raise LaunchError(f"--master_port must be between 1 and 65535 (got {args.master_port})")
    if args.comm_timeout is not None and not 0 < args.comm_timeout < float("inf"):
        raise LaunchError(f"--comm_timeout must be a positive number of seconds (got {args.comm_timeout:g})")
    if args.max_restarts is None:  # DeepSpeed's elastic agent restarts up to 100 times; its other launches never
        args.max_restarts = ELASTIC_MAX_RESTARTS if args.elastic_training else 0
    if args.max_restarts < 0:
        raise LaunchError(f"--max_restarts must be 0 or more (got {args.max_restarts})")
    if not args.elastic_training and (args.min_elastic_nodes > 0 or args.max_elastic_nodes > 0):
        raise LaunchError("--min_elastic_nodes and --max_elastic_nodes need --elastic_training")
    if 0 < args.max_elastic_nodes < args.min_elastic_nodes:
        raise LaunchError(f"--min_elastic_nodes {args.min_elastic_nodes} is more than "
                          f"--max_elastic_nodes {args.max_elastic_nodes}")
    if args.module and args.no_python:
        raise LaunchError("--module and --no_python cannot be used together")
    if args.as_deepspeed and args.no_python:
        raise LaunchError("--as_deepspeed runs a Python script; it cannot be used with --no_python")
    if args.ssh_port is not None and not 1 <= args.ssh_port <= 65535:
        raise LaunchError(f"--ssh_port must be between 1 and 65535 (got {args.ssh_port})")


def _check_script(args: argparse.Namespace) -> None:
    script = args.user_script
    if args.module:
        top = script.split(".")[0]
        if importlib.machinery.PathFinder.find_spec(top, [os.getcwd(), *sys.path]) is None:
            raise LaunchError(f"module not found: {script} (for --module)")
    elif args.no_python:
        if shutil.which(script) is None:
            raise LaunchError(f"program not found or not executable: {script} (for --no_python)")
    elif not Path(script).is_file():
        raise LaunchError(f"script not found: {script}")


def _check_log_dir(path: str | None) -> None:
    if path and os.path.exists(path) and not os.path.isdir(path):
        raise LaunchError(f"--enable_each_rank_log {path} is a file; it must be a directory (created if missing)")


def _gpu_ids(environ: dict[str, str]) -> list[int]:
    visible = environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if visible:
        words = [w.strip() for w in visible.split(",") if w.strip()]
        return [int(w) for w in words] if all(w.isdigit() for w in words) else list(range(len(words)))
    import torch  # after argument parsing: only a GPU count needs it

    return list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []


def _pool(args: argparse.Namespace, environ: dict[str, str]) -> Resources:
    """The hostfile's hosts, else this machine's GPUs or --num_procs CPU slots as host "localhost"."""
    path = args.hostfile
    if path is None and os.path.isfile(DEFAULT_HOSTFILE):
        path = DEFAULT_HOSTFILE
    if path is not None:
        return pool_from_hostfile(read_hostfile(path))
    if args.num_nodes > 1:
        raise LaunchError(f"--num_nodes {args.num_nodes} needs a hostfile listing the hosts (--hostfile)")
    if args.num_procs > 0:
        return {"localhost": list(range(args.num_procs))}
    ids = _gpu_ids(environ)
    if not ids:
        raise LaunchError("no GPU found on this machine: pass --num_procs N to run N CPU processes")
    return {"localhost": ids}


def _check_binding(args: argparse.Namespace, nprocs: int, local: bool) -> None:
    if not args.bind_cores_to_rank:
        return
    try:
        cores = parse_core_list(args.bind_core_list) if args.bind_core_list else available_cores()
        if local or args.bind_core_list:
            cores_for_rank(cores, nprocs, 0)
    except ValueError as e:
        raise LaunchError(f"--bind_cores_to_rank: {e}") from None


ELASTIC_MAX_RESTARTS = 100


def resolve_job(args: argparse.Namespace, environ: dict[str, str] | None = None) -> Union[NodePlan, MultiNodeJob]:
    """The plan for parsed launcher options (`cli.build_launch_parser`); LaunchError on bad input."""
    environ = dict(os.environ if environ is None else environ)
    args.launcher = "local" if args.no_ssh else args.launcher
    if args.bind_core_list:
        args.bind_cores_to_rank = True
    _check_counts(args)
    _check_script(args)
    _check_log_dir(args.enable_each_rank_log)

    pool = _pool(args, environ)
    active = select_resources(pool, args.include, args.exclude)
    per_node, option = (args.num_procs, "--num_procs") if args.num_procs > 0 else (args.num_gpus, "--num_gpus")
    active = limit_resources(active, args.num_nodes, per_node, option)

    multi = (args.force_multi or len(active) > 1) and args.launcher != "local"
    if args.node_rank != -1 and not 0 <= args.node_rank < len(active):
        nodes = f"{len(active)} node{'s' if len(active) != 1 else ''}"
        raise LaunchError(f"--node_rank {args.node_rank} but the job has {nodes} (node ranks 0-{len(active) - 1})"
                          if len(active) > 1 else f"--node_rank {args.node_rank} but the job has 1 node (node rank 0)")
    node_rank = 0
    if args.launcher == "local" and len(active) > 1:
        if not 0 <= args.node_rank < len(active):
            raise LaunchError(f"--launcher local (--no_ssh) runs one node of {len(active)}: pass --node_rank "
                              f"between 0 and {len(active) - 1}")
        node_rank = args.node_rank
    if args.min_elastic_nodes > len(active):
        raise LaunchError(f"--min_elastic_nodes {args.min_elastic_nodes} but only {len(active)} "
                          f"host{'s' if len(active) != 1 else ''} can run the job")
    if args.elastic_training and len(active) > 1 and not args.master_addr:
        raise LaunchError("--elastic_training over several nodes needs --master_addr")
    if len(active) > 1 and args.launcher == "local" and not args.master_addr:
        raise LaunchError("--launcher local (--no_ssh) over several nodes needs --master_addr (node 0's address)")
    master_addr = args.master_addr or (list(active)[0] if multi else "127.0.0.1")
    master_port = args.master_port
    if master_port is None and (len(active) > 1 or multi or args.elastic_training):
        master_port = DEFAULT_MASTER_PORT

    elastic = None
    if args.elastic_training:
        max_nodes = args.max_elastic_nodes if args.max_elastic_nodes > 0 else len(active)
        elastic = (max(args.min_elastic_nodes, 1), max_nodes)
    plan = NodePlan(
        world_info=active, node_rank=node_rank, script=args.user_script, script_args=list(args.user_args),
        master_addr=master_addr, master_port=master_port, module=args.module, no_python=args.no_python,
        no_local_rank=args.no_local_rank, as_deepspeed=args.as_deepspeed, max_restarts=args.max_restarts, each_rank_log=args.enable_each_rank_log,
        bind_cores=args.bind_cores_to_rank, bind_core_list=args.bind_core_list, elastic=elastic,
        cpu=args.num_procs > 0, run_id=environ.get("ELASTIC_RUN_ID", ""), comm_timeout=args.comm_timeout,
    )
    _check_binding(args, max(len(slots) for slots in active.values()), local=not multi)
    if not multi:
        return plan
    home = environ.get("HOME") or os.path.expanduser("~")
    return MultiNodeJob(launcher=args.launcher, plan=plan, exports=collect_exports(environ, os.getcwd(), home),
                        launcher_args=args.launcher_args, ssh_port=args.ssh_port, comment=args.comment,
                        account=args.account)
