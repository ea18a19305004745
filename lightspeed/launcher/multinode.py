"""Several nodes: the command that starts the per-node agent (`python -m lightspeed.launcher.node`) on
every host through pdsh, ssh, mpirun (Open MPI) or srun (SLURM), the variables exported to it, and
running that command.

Owns `MultiNodeJob`, the command builders (pure: tests compare their output exactly), `dry_run_lines`
and `run`. Every host runs the same agent as a one-node job does (`local.run_node`), so restarts,
CUDA_VISIBLE_DEVICES, core binding and per-rank logs behave the same under every launcher; the
launcher only starts one agent per host. Must not import torch.

Exports, DeepSpeed's rules: every variable of this environment whose name starts with NCCL, PYTHON,
MLFLOW, MV2 or UCX (plus LIGHTSPEED), with this directory put first on PYTHONPATH; then the
``KEY=VALUE`` lines of ``~/.deepspeed_env``, ``~/.lightspeed_env``, ``./.deepspeed_env`` and
``./.lightspeed_env``, in that order, later ones winning (file names from DS_ENV_FILE and
LIGHTSPEED_ENV_FILE when set).

Note: differences from DeepSpeed's runners
    DeepSpeed's mpirun and srun commands start every rank directly (so they cannot honour --include
    slots, or restart); here they start one agent per host (``--map-by ppr:1:node`` /
    ``--ntasks-per-node=1``) and ``--bind-to none``, since Open MPI's default binding of that one
    process would pin all of a host's workers to one core. The Open MPI transport settings DeepSpeed
    adds (``--mca btl ^openib``, ``btl_tcp_if_include eth0``, ``UCX_TLS=tcp``) are left out: MPI here
    only starts processes, it carries no traffic. ``ssh`` is a launcher of its own (one ssh per host,
    DeepSpeed has none): its remote agent stops its workers when the ssh connection closes.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Optional

from lightspeed._utils.logging import get_logger
from lightspeed.launcher.errors import LaunchError
from lightspeed.launcher.hostfile import describe_slots, encode_world_info
from lightspeed.launcher.local import NodePlan, source_root
from lightspeed.launcher.node import NODE_MODULE, node_command

logger = get_logger(__name__)

LAUNCHERS = ("pdsh", "ssh", "openmpi", "slurm")
EXPORT_PREFIXES = ("NCCL", "PYTHON", "MLFLOW", "MV2", "UCX", "LIGHTSPEED")
PDSH_MAX_FAN_OUT = 1024
_ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def env_file_names(environ: dict[str, str]) -> list[str]:
    return [environ.get("DS_ENV_FILE", ".deepspeed_env"), environ.get("LIGHTSPEED_ENV_FILE", ".lightspeed_env")]


def read_env_file(path: str) -> dict[str, str]:
    """``KEY=VALUE`` lines (blank lines and ``#`` comments skipped; one pair of quotes around the value
    removed); a line without ``=`` is a LaunchError naming it."""
    out: dict[str, str] = {}
    with open(path, encoding="utf-8") as f:
        for lineno, raw in enumerate(f.read().splitlines(), 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            key, sep, value = line.partition("=")
            key, value = key.strip(), value.strip()
            if key.startswith("export "):
                key = key[len("export "):].strip()
            if not sep or not _ENV_KEY.fullmatch(key):
                raise LaunchError(f'{path}:{lineno}: expected "NAME=VALUE", got "{line}"')
            if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
                value = value[1:-1]
            out[key] = value
    return out


def collect_exports(environ: dict[str, str], cwd: str, home: str) -> dict[str, str]:
    """The variables every node gets (rules in the module docstring)."""
    env = dict(environ)
    path = [cwd, source_root(), *env.get("PYTHONPATH", "").split(os.pathsep)]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in path if p))
    exports = {k: env[k] for k in sorted(env) if k.startswith(EXPORT_PREFIXES)}
    seen = set()
    for directory in (home, cwd):
        for name in env_file_names(environ):
            env_file = os.path.realpath(os.path.join(directory, name))
            if env_file not in seen and os.path.isfile(env_file):
                seen.add(env_file)
                logger.info(f"exporting the variables of {env_file}")
                exports.update(read_env_file(env_file))
    return exports


@dataclass
class MultiNodeJob:
    """`plan` (with node rank 0 standing for any node) started on every host of its world by
    `launcher`; `launcher_args` go to that launcher (pdsh, ssh, mpirun or srun)."""

    launcher: str
    plan: NodePlan
    exports: dict[str, str] = field(default_factory=dict)
    launcher_args: str = ""
    ssh_port: Optional[int] = None
    comment: str = ""
    account: str = ""
    cwd: str = field(default_factory=os.getcwd)
    python: str = sys.executable

    @property
    def hosts(self) -> list[str]:
        return list(self.plan.world_info)


def _node_command(job: MultiNodeJob, node_rank: Optional[str], extra: tuple[str, ...] = ()) -> list[str]:
    return node_command(job.plan, node_rank, job.python, extra)


def remote_shell(job: MultiNodeJob, cmd: list[str]) -> str:
    """One shell line for a remote host: exports, cd to this directory, exec the agent."""
    exports = "".join(f"export {k}={shlex.quote(v)}; " for k, v in job.exports.items())
    return f"{exports}cd {shlex.quote(job.cwd)} && exec {shlex.join(cmd)}"


def pdsh_env(job: MultiNodeJob, environ: dict[str, str]) -> dict[str, str]:
    env = {"PDSH_RCMD_TYPE": "ssh"}
    if job.ssh_port is not None:
        env["PDSH_SSH_ARGS_APPEND"] = f"{environ.get('PDSH_SSH_ARGS_APPEND', '')} -p {job.ssh_port}".strip()
    return env


def pdsh_command(job: MultiNodeJob) -> list[str]:
    """One pdsh for every host; pdsh replaces %n with each host's rank."""
    return ["pdsh", "-S", "-f", str(PDSH_MAX_FAN_OUT), "-w", ",".join(job.hosts), *shlex.split(job.launcher_args),
            remote_shell(job, _node_command(job, "%n"))]


def pdsh_kill_command(job: MultiNodeJob) -> list[str]:
    pattern = f"{NODE_MODULE} --world_info={encode_world_info(job.plan.world_info)}"
    return ["pdsh", "-S", "-f", str(PDSH_MAX_FAN_OUT), "-w", ",".join(job.hosts), f"pkill -f {shlex.quote(pattern)}"]


def ssh_port_args(job: MultiNodeJob) -> list[str]:
    return ["-p", str(job.ssh_port)] if job.ssh_port is not None else []


def ssh_commands(job: MultiNodeJob) -> list[list[str]]:
    """One ssh per host, in host order; --launcher_args are ssh options."""
    return [["ssh", *ssh_port_args(job), *shlex.split(job.launcher_args), host,
             remote_shell(job, _node_command(job, str(i), ("--stop_on_stdin_eof",)))]
            for i, host in enumerate(job.hosts)]


def openmpi_command(job: MultiNodeJob) -> list[str]:
    exports = [arg for k, v in job.exports.items() for arg in ("-x", f"{k}={v}")]
    return ["mpirun", "-n", str(len(job.hosts)), "--host", ",".join(job.hosts), "--map-by", "ppr:1:node",
            "--bind-to", "none", *shlex.split(job.launcher_args), *exports, *_node_command(job, None)]


def slurm_command(job: MultiNodeJob) -> list[str]:
    for k, v in job.exports.items():
        if "," in v:
            raise LaunchError(f"the slurm launcher cannot export {k}: srun --export cannot carry a value with a comma "
                              f"({k}={v})")
    n = len(job.hosts)
    cmd = ["srun", f"--nodes={n}", f"--ntasks={n}", "--ntasks-per-node=1", f"--nodelist={','.join(job.hosts)}",
           *shlex.split(job.launcher_args)]
    cmd += ["--comment", job.comment] if job.comment else []
    cmd += ["--account", job.account] if job.account else []
    export = ",".join(["ALL", *(f"{k}={v}" for k, v in job.exports.items())])
    return cmd + [f"--export={export}", *_node_command(job, None)]


def commands(job: MultiNodeJob) -> list[list[str]]:
    """The command(s) this host runs to start the job: one, or one per host for ssh."""
    if job.launcher == "ssh":
        return ssh_commands(job)
    builder = {"pdsh": pdsh_command, "openmpi": openmpi_command, "slurm": slurm_command}.get(job.launcher)
    if builder is None:
        raise LaunchError(f"unknown launcher {job.launcher} (choose from {', '.join(LAUNCHERS)})")
    return [builder(job)]


def dry_run_lines(job: MultiNodeJob, environ: dict[str, str]) -> list[str]:
    """What `--dry_run` prints: each command exactly as it would run (with the launcher's own
    environment variables in front), then one comment line per host saying what it runs."""
    prefix = ""
    if job.launcher == "pdsh":
        prefix = "".join(f"{k}={shlex.quote(v)} " for k, v in pdsh_env(job, environ).items())
    lines = [prefix + shlex.join(cmd) for cmd in commands(job)]
    first_rank = 0
    for i, (host, slots) in enumerate(job.plan.world_info.items()):
        ranks = describe_slots(list(range(first_rank, first_rank + len(slots))))
        lines.append(f"# {host}: node {i}, slots {describe_slots(slots)}, ranks {ranks}")
        first_rank += len(slots)
    return lines


def check_ssh(job: MultiNodeJob, timeout: float = 30.0) -> None:
    """Fail early, as DeepSpeed does, when the first host does not take passwordless ssh."""
    host = job.hosts[0]
    extra = shlex.split(job.launcher_args) if job.launcher == "ssh" else []
    cmd = ["ssh", "-o", "PasswordAuthentication=no", "-o", "BatchMode=yes", *ssh_port_args(job), *extra, host,
           "hostname"]
    try:
        result = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise LaunchError(f"host {host} is not reachable by ssh ({e}); set up passwordless ssh or pass --no_ssh_check")
    if result.returncode != 0:
        why = (result.stderr.strip().splitlines() or [f"exit status {result.returncode}"])[-1]
        raise LaunchError(f"host {host} is not reachable by passwordless ssh ({why}); "
                          "set up passwordless ssh or pass --no_ssh_check")


def _backend(job: MultiNodeJob) -> str:
    return {"pdsh": "pdsh", "ssh": "ssh", "openmpi": "mpirun", "slurm": "srun"}[job.launcher]


def check_backend(job: MultiNodeJob) -> None:
    if shutil.which(_backend(job)) is None:
        raise LaunchError(f"launcher {job.launcher} needs `{_backend(job)}`, which is not on PATH")


class _Stop(Exception):
    def __init__(self, signum: int):
        self.signum = signum


def _raise_stop(signum, frame):
    raise _Stop(signum)


def _stop(procs: list[subprocess.Popen], grace: float = 10.0) -> None:
    """Close each ssh's stdin (its remote agent then stops its workers), then terminate what is left."""
    for p in procs:
        if p.poll() is None and p.stdin:
            try:
                p.stdin.close()
            except OSError:
                pass
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            p.kill()


def _run_ssh(cmds: list[list[str]], env: dict[str, str]) -> int:
    procs = [subprocess.Popen(cmd, stdin=subprocess.PIPE, env=env) for cmd in cmds]
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                logger.error(f"a node exited with status {failed[0]}: stopping the others")
                _stop(procs)
                return failed[0] if failed[0] > 0 else 1
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.2)
    except _Stop as e:
        _stop(procs)
        return 128 + e.signum


def _run_one(job: MultiNodeJob, cmd: list[str], env: dict[str, str]) -> int:
    proc = subprocess.Popen(cmd, env=env)
    try:
        return proc.wait()
    except _Stop as e:
        proc.send_signal(signal.SIGINT if e.signum == signal.SIGINT else signal.SIGTERM)
        if job.launcher == "pdsh":  # pdsh does not stop remote commands: kill the agents, as DeepSpeed does
            subprocess.run(pdsh_kill_command(job), env=env)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        return 128 + e.signum


def run(job: MultiNodeJob, check_ssh_first: bool = True) -> int:
    """Start the job and wait for it; return its exit status. Raises LaunchError before starting
    anything when the launcher is missing or the first host refuses ssh."""
    check_backend(job)
    if check_ssh_first and job.launcher in ("pdsh", "ssh"):
        check_ssh(job)
    env = dict(os.environ)
    if job.launcher == "pdsh":
        env.update(pdsh_env(job, env))
    cmds = commands(job)
    for cmd in cmds:
        logger.info(f"cmd = {shlex.join(cmd)}")
    previous = {s: signal.signal(s, _raise_stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _run_ssh(cmds, env) if job.launcher == "ssh" else _run_one(job, cmds[0], env)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
