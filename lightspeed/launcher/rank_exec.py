"""The per-rank shim: binds this rank to its share of the cores and/or sends its output to a per-rank
log file, then replaces itself (exec) with the real worker command.

The elastic agent starts every worker of a node with the same command line, and only the
environment (LOCAL_RANK, RANK) tells them apart, so per-rank settings are made here, inside the
worker process, before the exec. Exec keeps the PID, so the agent still watches, signals and reaps the
real worker; CPU affinity and redirected file descriptors survive the exec.

It is run by file path (``python -u .../rank_exec.py``), not with ``-m``: it must start fast and
must not import lightspeed or torch. Standard library only; the launcher imports the two pure helpers
below to validate --bind_core_list before anything starts.

Note: core binding
    DeepSpeed wraps each rank in ``numactl -C <cores> [-m <numa node>]``. Here the shim calls
    ``os.sched_setaffinity`` instead: no numactl package needed, and the core pool defaults to the
    cores this process may run on (its affinity mask, which respects container cpusets) rather than
    DeepSpeed's count of physical cores from 0. The split is DeepSpeed's: with C cores and P ranks
    per node, rank r gets the r-th run of C // P cores, and OMP_NUM_THREADS = C // P. NUMA memory
    binding (numactl's ``-m``) is not done: the kernel's first-touch policy places a bound rank's
    memory on its own node in the common case.
"""

from __future__ import annotations

import os
import sys


def parse_core_list(text: str) -> list[int]:
    """``"0,2-4,6"`` -> ``[0, 2, 3, 4, 6]``; ranges ascending and not overlapping (DeepSpeed's rules)."""
    cores: list[int] = []
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ValueError(f'bad core range "{part}" in "{text}" (expected e.g. 0,2-5,7)')
        lo, hi = int(first), int(last) if dash else int(first)
        if hi < lo:
            raise ValueError(f'core range "{part}" ends before it starts')
        if cores and lo <= cores[-1]:
            raise ValueError(f'core ranges in "{text}" must be ascending and must not overlap')
        cores.extend(range(lo, hi + 1))
    return cores


def cores_for_rank(cores: list[int], nprocs: int, local_rank: int) -> list[int]:
    """The cores of `local_rank` when `cores` are split evenly over `nprocs` ranks."""
    per_rank = len(cores) // nprocs
    if per_rank < 1:
        raise ValueError(f"{len(cores)} cores for {nprocs} processes per node: each rank needs at least one")
    return cores[per_rank * local_rank: per_rank * (local_rank + 1)]


def available_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def main(argv: list[str]) -> None:
    """``rank_exec.py [--cores LIST] [--nprocs N] [--log_dir DIR --log_prefix P] -- command ...``"""
    opts: dict[str, str] = {}
    while argv and argv[0] != "--":
        key, _, value = argv.pop(0).partition("=")
        opts[key.lstrip("-")] = value
    command = argv[1:]
    if not command:
        sys.exit("rank_exec: no command after --")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if "cores" in opts:
        pool = parse_core_list(opts["cores"]) if opts["cores"] else available_cores()
        mine = cores_for_rank(pool, int(opts.get("nprocs", "1")), local_rank)
        os.sched_setaffinity(0, mine)
        os.environ["OMP_NUM_THREADS"] = str(len(mine))
    if "log_dir" in opts:
        os.makedirs(opts["log_dir"], exist_ok=True)
        rank = os.environ.get("RANK", local_rank)
        path = os.path.join(opts["log_dir"], f"{opts.get('log_prefix', 'lightspeed')}_rank{rank}.log")
        # Appending: a restarted attempt adds to the same file rather than erasing the failure before it.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
