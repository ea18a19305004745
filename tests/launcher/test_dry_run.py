"""`lightspeed --dry_run`: the exact command of every launcher for a two-host hostfile, and bad input
rejected with one line and exit status 2 before anything starts. In process: nothing is launched."""

import shlex
import subprocess
import sys

import pytest

from lightspeed.launcher.hostfile import encode_world_info

from .conftest import REPO, clean_env

PY = sys.executable
HOSTS2 = {"worker-0": [0, 1], "worker-1": [0, 1]}


@pytest.fixture
def job_dir(tmp_path, home, monkeypatch):
    """A hostfile of two hosts, a script, NCCL_DEBUG set, and env files in home and in the job directory."""
    (tmp_path / "hostfile").write_text("worker-0 slots=2\n# comment\nworker-1 slots=2\n")
    (tmp_path / "train.py").write_text("print('hi')\n")
    (home / ".deepspeed_env").write_text("FROM_HOME=1\n")
    (tmp_path / ".lightspeed_env").write_text("FROM_CWD=a b\n")
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    return tmp_path


def remote(cwd, node_args, world=HOSTS2, master="--master_addr=worker-0 --master_port=29500", script_args=""):
    """The shell line a remote host runs (written out here rather than built by the code under test)."""
    exports = (f"export NCCL_DEBUG=INFO; export PYTHONPATH={cwd}:{REPO}; export FROM_HOME=1; "
               f"export FROM_CWD='a b'; ")
    return (f"{exports}cd {cwd} && exec {PY} -u -m lightspeed.launcher.node --world_info={encode_world_info(world)} "
            f"{node_args}{master} train.py --lr 0.1 'x y'{script_args}")


def test_pdsh(cli, job_dir):
    code, out, err = cli("--hostfile", "hostfile", "--ssh_port", "2200", "--launcher_args", "-R ssh", "--dry_run",
                         "train.py", "--lr", "0.1", "x y")
    assert code == 0, err
    assert out.splitlines() == [
        "PDSH_RCMD_TYPE=ssh PDSH_SSH_ARGS_APPEND='-p 2200' pdsh -S -f 1024 -w worker-0,worker-1 -R ssh "
        + shlex.quote(remote(job_dir, "--node_rank=%n ")),
        "# worker-0: node 0, slots 0-1, ranks 0-1",
        "# worker-1: node 1, slots 0-1, ranks 2-3",
    ]


def test_ssh(cli, job_dir):
    code, out, err = cli("--hostfile", "hostfile", "--launcher", "ssh", "--ssh_port", "2200",
                         "--launcher_args=-i /keys/id -o BatchMode=yes", "--dry_run", "train.py", "--lr", "0.1", "x y")
    assert code == 0, err
    lines = out.splitlines()
    for rank, host in enumerate(["worker-0", "worker-1"]):
        node = remote(job_dir, f"--node_rank={rank} ", master="--master_addr=worker-0 --master_port=29500 "
                      "--stop_on_stdin_eof")
        assert lines[rank] == f"ssh -p 2200 -i /keys/id -o BatchMode=yes {host} {shlex.quote(node)}"
    assert lines[2:] == ["# worker-0: node 0, slots 0-1, ranks 0-1", "# worker-1: node 1, slots 0-1, ranks 2-3"]


def test_openmpi(cli, job_dir):
    code, out, err = cli("-H", "hostfile", "--launcher", "OpenMPI", "--launcher_args=--oversubscribe", "--dry_run",
                         "train.py", "--lr", "0.1", "x y")
    assert code == 0, err
    assert out.splitlines()[0] == (
        f"mpirun -n 2 --host worker-0,worker-1 --map-by ppr:1:node --bind-to none --oversubscribe "
        f"-x NCCL_DEBUG=INFO -x PYTHONPATH={job_dir}:{REPO} -x FROM_HOME=1 -x 'FROM_CWD=a b' "
        f"{PY} -u -m lightspeed.launcher.node --world_info={encode_world_info(HOSTS2)} "
        f"--master_addr=worker-0 --master_port=29500 train.py --lr 0.1 'x y'")


def test_slurm(cli, job_dir):
    code, out, err = cli("-H", "hostfile", "--launcher", "slurm", "--launcher_args", "--partition=gpu --time=1:00:00",
                         "--comment", "exp 1", "--account", "proj", "--master_addr", "10.0.0.1", "--master_port",
                         "6000", "--dry_run", "train.py", "--lr", "0.1", "x y")
    assert code == 0, err
    assert out.splitlines()[0] == (
        f"srun --nodes=2 --ntasks=2 --ntasks-per-node=1 --nodelist=worker-0,worker-1 --partition=gpu --time=1:00:00 "
        f"--comment 'exp 1' --account proj "
        f"'--export=ALL,NCCL_DEBUG=INFO,PYTHONPATH={job_dir}:{REPO},FROM_HOME=1,FROM_CWD=a b' "
        f"{PY} -u -m lightspeed.launcher.node --world_info={encode_world_info(HOSTS2)} "
        f"--master_addr=10.0.0.1 --master_port=6000 train.py --lr 0.1 'x y'")


def test_slurm_refuses_a_value_with_a_comma(cli, job_dir, monkeypatch):
    monkeypatch.setenv("NCCL_IB_HCA", "mlx5_0,mlx5_1")
    code, out, err = cli("-H", "hostfile", "--launcher", "slurm", "--dry_run", "train.py")
    assert code == 2 and err == ("lightspeed: error: the slurm launcher cannot export NCCL_IB_HCA: srun --export "
                                 "cannot carry a value with a comma (NCCL_IB_HCA=mlx5_0,mlx5_1)\n")


def test_node_options_reach_every_host(cli, job_dir, monkeypatch):
    monkeypatch.setenv("ELASTIC_RUN_ID", "run7")
    code, out, err = cli("-H", "hostfile", "--launcher", "openmpi", "--include", "worker-1:1@worker-0",
                         "--max_restarts", "2", "--enable_each_rank_log", "logs", "--bind_core_list", "0-7",
                         "--elastic_training", "--max_elastic_nodes", "4", "--master_addr", "worker-0",
                         "--no_local_rank", "--comm_timeout", "90", "--dry_run", "train.py")
    assert code == 0, err
    world = {"worker-0": [0, 1], "worker-1": [1]}
    assert out.splitlines()[0].endswith(
        f"-u -m lightspeed.launcher.node --world_info={encode_world_info(world)} --master_addr=worker-0 "
        f"--master_port=29500 --no_local_rank --max_restarts=2 --enable_each_rank_log={job_dir}/logs "
        f"--bind_cores_to_rank --bind_core_list=0-7 --enable_elastic_training --min_elastic_nodes=1 "
        f"--max_elastic_nodes=4 --run_id=run7 --comm_timeout=90 train.py")
    assert out.splitlines()[1:] == ["# worker-0: node 0, slots 0-1, ranks 0-1", "# worker-1: node 1, slots 1, ranks 2"]


def test_one_host_runs_here_unless_force_multi(cli, job_dir):
    code, out, _ = cli("-H", "hostfile", "--include", "worker-1", "--dry_run", "train.py")
    assert code == 0 and out.splitlines()[0].startswith(f"{PY} -u -m lightspeed.launcher.node ")
    code, out, _ = cli("-H", "hostfile", "--include", "worker-1", "--force_multi", "--dry_run", "train.py")
    assert code == 0 and out.startswith("PDSH_RCMD_TYPE=ssh pdsh -S -f 1024 -w worker-1 ")


def test_local_node(cli, job_dir):
    (job_dir / "train.py").write_text("parser.add_argument('--local_rank', type=int)\n")
    code, out, err = cli("--num_procs", "2", "--dry_run", "train.py", "--lr", "0.1")
    assert code == 0, err
    assert out.splitlines() == [
        f"{PY} -u -m lightspeed.launcher.node --world_info={encode_world_info({'localhost': [0, 1]})} --node_rank=0 "
        "--master_addr=127.0.0.1 --cpu train.py --lr 0.1",
        "# localhost: node 0, slots 0-1, 2 of 2 ranks, LIGHTSPEED_ACCELERATOR=cpu",
        f"# each worker runs: {PY} -u train.py '--local_rank=${{local_rank}}' --lr 0.1",
    ]
    code, out, err = cli("-H", "hostfile", "--no_ssh", "--node_rank", "1", "--master_addr", "10.0.0.1", "--dry_run",
                         "train.py")
    assert code == 0, err
    assert " --node_rank=1 --master_addr=10.0.0.1 --master_port=29500 train.py" in out.splitlines()[0]
    assert out.splitlines()[1] == "# worker-1: node 1, slots 0-1, 2 of 4 ranks, CUDA_VISIBLE_DEVICES=0,1"


@pytest.mark.parametrize("args, message", [
    ([], "the following arguments are required: script (see `lightspeed --help`)"),
    (["missing.py"], "script not found: missing.py"),
    (["-H", "nothere", "train.py"], "cannot read hostfile nothere: No such file or directory"),
    (["-H", "badhost", "train.py"], 'badhost:2: expected "HOSTNAME slots=N", got "worker-1 slot=2"'),
    (["-H", "hostfile", "--include", "worker-7", "train.py"],
     "--include: unknown host worker-7 (the resource pool has: worker-0, worker-1)"),
    (["-H", "hostfile", "--include", "worker-0:0,2", "train.py"], "--include: host worker-0 has slots 0-1; there is no slot 2"),
    (["-H", "hostfile", "--num_gpus", "3", "train.py"], "--num_gpus 3 but host worker-0 has only 2 slots"),
    (["-H", "hostfile", "--num_nodes", "3", "train.py"], "--num_nodes 3 but only 2 hosts are available (worker-0, worker-1)"),
    (["-H", "hostfile", "--num_nodes", "1", "--include", "worker-0", "train.py"],
     "--num_nodes, --num_gpus and --num_procs cannot be combined with --include/--exclude"),
    (["--num_procs", "0", "train.py"], "--num_procs must be at least 1 (got 0)"),
    (["--num_procs", "two", "train.py"], "argument --num_procs: invalid int value: 'two' (see `lightspeed --help`)"),
    (["--num_procs", "2", "--master_port", "70000", "train.py"], "--master_port must be between 1 and 65535 (got 70000)"),
    (["--num_procs", "2", "--max_restarts", "-1", "train.py"], "--max_restarts must be 0 or more (got -1)"),
    (["--num_procs", "2", "--comm_timeout", "0", "train.py"], "--comm_timeout must be a positive number of seconds (got 0)"),
    (["--num_procs", "2", "--node_rank", "5", "train.py"], "--node_rank 5 but the job has 1 node (node rank 0)"),
    (["-H", "hostfile", "--no_ssh", "--node_rank", "2", "--master_addr", "10.0.0.1", "train.py"],
     "--node_rank 2 but the job has 2 nodes (node ranks 0-1)"),
    (["--num_proc", "2", "train.py"],
     "unrecognized arguments: --num_proc (did you mean --num_procs?) (see `lightspeed --help`)"),
    (["config", "check", "c.json", "--world_sise", "2"],
     "unrecognized arguments: --world_sise 2 (did you mean --world_size?) (see `lightspeed --help`)"),
    (["--num_procs", "2", "--bind_core_list", "4-2", "train.py"], '--bind_cores_to_rank: core range "4-2" ends before it starts'),
    (["--num_procs", "2", "--min_elastic_nodes", "2", "train.py"], "--min_elastic_nodes and --max_elastic_nodes need --elastic_training"),
    (["-H", "hostfile", "--elastic_training", "train.py"], "--elastic_training over several nodes needs --master_addr"),
    (["-H", "hostfile", "--elastic_training", "--min_elastic_nodes", "3", "train.py"],
     "--min_elastic_nodes 3 but only 2 hosts can run the job"),
    (["-H", "hostfile", "--launcher", "local", "train.py"],
     "--launcher local (--no_ssh) runs one node of 2: pass --node_rank between 0 and 1"),
    (["--launcher", "mvapich", "train.py"], "argument --launcher: invalid choice: 'mvapich' (choose from 'pdsh', 'ssh', "
     "'openmpi', 'slurm', 'local') (see `lightspeed --help`)"),
    (["--num_procs", "2", "--enable_each_rank_log", "train.py", "train.py"],
     "--enable_each_rank_log train.py is a file; it must be a directory (created if missing)"),
])
def test_bad_input_is_one_line_and_exit_2(cli, job_dir, args, message):
    (job_dir / "badhost").write_text("worker-0 slots=2\nworker-1 slot=2\n")
    code, out, err = cli(*args)
    assert (code, out, err) == (2, "", f"lightspeed: error: {message}\n")


def test_parsing_and_multi_node_dry_runs_never_import_torch(job_dir, home):
    code = ("import contextlib, io, sys\n"
            "from lightspeed.launcher.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    assert main(['-H', 'hostfile', '--launcher', 'slurm', '--dry_run', 'train.py']) == 0\n"
            "    try:\n"
            "        main(['--help'])\n"
            "    except SystemExit:\n"
            "        pass\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=job_dir, env=clean_env(home), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
