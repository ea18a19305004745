"""`lightspeed --elastic_training`: two nodes of one process each (on this host) train with an
`elasticity` config; one node is killed, and the other's agent restarts the job at world size 1, which
resumes from the last checkpoint (resharded) with the elastic batch size for one process."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from lightspeed.comm.init import free_port

from .conftest import SCRIPTS, clean_env

pytestmark = pytest.mark.dist


@pytest.mark.slow
def test_a_killed_node_restarts_the_job_at_one_process_from_the_checkpoint(tmp_path, home):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    log, save = tmp_path / "steps.jsonl", tmp_path / "ckpt"
    port = free_port()
    env = clean_env(home, OMP_NUM_THREADS="1", LIGHTSPEED_RDZV_LAST_CALL_SECONDS="2")

    def node(rank):
        cmd = [sys.executable, "-m", "lightspeed.launcher.cli", "-H", hostfile, "--launcher", "local", "--node_rank",
               str(rank), "--num_procs", "1", "--master_addr", "127.0.0.1", "--master_port", str(port),
               "--elastic_training", "--min_elastic_nodes", "1", "--max_elastic_nodes", "2", "--max_restarts", "2",
               "--comm_timeout", "5", SCRIPTS / "elastic_job.py", save, log, "4"]
        return subprocess.Popen(list(map(str, cmd)), cwd=tmp_path, env=env, start_new_session=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    first = node(0)
    time.sleep(0.5)  # node 0 hosts the rendezvous store
    second = node(1)
    try:
        deadline = time.monotonic() + 120
        pid_files = [tmp_path / f"steps.jsonl.worker_of_agent{proc.pid}" for proc in (first, second)]
        while not all(f.exists() for f in pid_files):
            assert first.poll() is None and second.poll() is None, (first.poll(), second.poll())
            assert time.monotonic() < deadline, "the two nodes never reached step 2 together"
            time.sleep(0.2)
        worker = int(pid_files[1].read_text())
        os.killpg(second.pid, signal.SIGKILL)  # node 1: its agent ...
        os.kill(worker, signal.SIGKILL)  # ... and its worker (the agent starts workers in their own session)
        second.wait()
        out, _ = first.communicate(timeout=90)
    finally:
        for proc in (first, second):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        for pid_file in tmp_path.glob("steps.jsonl.worker_of_agent*"):  # workers live in their own sessions
            try:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
    assert first.returncode == 0, out[-4000:]
    steps = [json.loads(line) for line in log.read_text().splitlines()]
    two = [s for s in steps if s["world"] == 2]
    one = [s for s in steps if s["world"] == 1]
    assert two and one and two[-1]["step"] == 2 and steps[-1] == one[-1]
    # every step once, in order: world size 1 continued from the world-size-2 checkpoint of step 2
    assert [s["step"] for s in steps[steps.index(two[-1]):]] == [2, 3, 4]
    assert {(s["batch"], s["micro"], s["gas"]) for s in two} == {(8, 4, 1)}  # elasticity: 8 = 4 x 1 x 2
    assert {(s["batch"], s["micro"], s["gas"]) for s in one} == {(8, 4, 2)}  # 8 = 4 x 2 x 1


@pytest.mark.parametrize("extra, restarts", [((), "--max_restarts=100"), (("--max_restarts", "3"), "--max_restarts=3")])
def test_elastic_jobs_restart_up_to_100_times_unless_told(cli, extra, restarts):
    code, out, err = cli("--num_procs", "1", "--elastic_training", *extra, "--dry_run", SCRIPTS / "elastic_job.py")
    assert code == 0, err
    assert restarts in out


def test_min_and_max_nodes_are_torchruns_names_for_the_elastic_range():
    from lightspeed.launcher.cli import build_launch_parser

    args = build_launch_parser().parse_args(["--elastic_training", "--min_nodes", "1", "--max_nodes", "3", "train.py"])
    assert (args.min_elastic_nodes, args.max_elastic_nodes) == (1, 3)
