"""`lightspeed --num_procs N script.py` end to end: real CPU processes under the elastic agent."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from .conftest import SCRIPTS, clean_env, run_cli

pytestmark = pytest.mark.dist


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _line_of(script: str, text: str) -> int:
    """The number of the first line of SCRIPTS/script holding `text`."""
    return next(n for n, line in enumerate((SCRIPTS / script).read_text().splitlines(), 1) if text in line)


def _ranks(out, n):
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(n)]


def test_two_processes_with_local_rank_per_rank_logs_and_core_binding(tmp_path, home):
    out, logs = tmp_path / "out", tmp_path / "logs"
    out.mkdir()
    bind = len(os.sched_getaffinity(0)) >= 2
    proc = run_cli(["--num_procs", "2", "--enable_each_rank_log", logs, *(["--bind_cores_to_rank"] if bind else []),
                    SCRIPTS / "allreduce_job.py", "--out", out], tmp_path, home, timeout=90)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = _ranks(out, 2)
    for r, seen in enumerate(ranks):
        assert seen["sum"] == 1.0
        assert (seen["RANK"], seen["LOCAL_RANK"], seen["WORLD_SIZE"], seen["LOCAL_WORLD_SIZE"]) == (str(r), str(r), "2", "2")
        assert seen["local_rank_arg"] == r  # the script declares --local_rank, so it got it
        assert seen["MASTER_ADDR"] and int(seen["MASTER_PORT"]) > 0
        assert (seen["CROSS_RANK"], seen["CROSS_SIZE"], seen["LOCAL_SIZE"]) == ("0", "1", "2")
        assert seen["LIGHTSPEED_ACCELERATOR"] == "cpu" and seen["CUDA_VISIBLE_DEVICES"] is None
        if bind:
            assert seen["OMP_NUM_THREADS"] == str(len(seen["cores"]))
    if bind:
        assert not set(ranks[0]["cores"]) & set(ranks[1]["cores"])
    logs_by_rank = {p.name.rsplit("_", 1)[1]: p.read_text() for p in logs.iterdir()}
    assert sorted(logs_by_rank) == ["rank0.log", "rank1.log"]
    assert "rank 1 done" in logs_by_rank["rank1.log"] and "rank 1 done" not in proc.stdout


def test_four_processes_on_a_fixed_master_port(tmp_path, home):
    out = tmp_path / "out"
    out.mkdir()
    port = _free_port()
    proc = run_cli(["--num_procs", "4", "--master_port", port, SCRIPTS / "allreduce_job.py", "--out", out],
                   tmp_path, home, timeout=90)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for r, seen in enumerate(_ranks(out, 4)):
        assert seen["sum"] == 6.0 and seen["RANK"] == str(r) and seen["WORLD_SIZE"] == "4"
        assert (seen["MASTER_ADDR"], seen["MASTER_PORT"]) == ("127.0.0.1", str(port))


def test_a_failing_rank_stops_the_job_with_its_exit_status(tmp_path, home):
    start = time.monotonic()
    proc = run_cli(["--num_procs", "2", SCRIPTS / "failing_job.py"], tmp_path, home, timeout=60)
    elapsed = time.monotonic() - start
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "rank 1 fails on purpose" in proc.stderr
    assert elapsed < 30  # rank 0 waits for rank 1 forever; the agent must stop it


def test_max_restarts_restarts_the_workers(tmp_path, home):
    out = tmp_path / "out"
    out.mkdir()
    proc = run_cli(["--num_procs", "2", "--max_restarts", "1", SCRIPTS / "flaky_job.py", out], tmp_path, home,
                   timeout=90)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "failed (exitcode: 3) local_rank: 1" in proc.stderr  # the first attempt failed, as planned
    # Second attempt (restart count 1) for both ranks; no --local_rank for a script that does not declare it.
    assert [(out / f"done{r}").read_text() for r in range(2)] == ["1 2 []", "1 2 []"]


def test_exit_status_of_a_failed_worker():
    from types import SimpleNamespace

    from lightspeed.launcher.exits import job_status

    def status(code, **error_file):
        return job_status(SimpleNamespace(exitcode=code, error_file_data=error_file))

    assert [status(c) for c in (3, 1, -9, -15, 0)] == [3, 1, 137, 143, 1]
    # stopped by the agent after reporting its own failure: that failure's status, not the SIGTERM
    assert status(-15, lightspeed_time=1.0, lightspeed_collective=True) == 124
    assert status(-15, lightspeed_time=1.0, lightspeed_collective=False) == 1


@pytest.mark.parametrize("mode", ["stop", "sleep"])
def test_a_stalled_rank_ends_the_job_at_the_comm_timeout_with_every_ranks_stacks(tmp_path, home, mode):
    start = time.monotonic()
    proc = run_cli(["--num_procs", "2", "--comm_timeout", "4", SCRIPTS / "stall_job.py", "--mode", mode],
                   tmp_path, home, timeout=120)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0 and "done" not in proc.stdout, proc.stderr[-3000:]
    assert elapsed < 60, elapsed  # torch's default would be 30 minutes; startup is most of this
    reason = [line for line in proc.stderr.splitlines() if "job failed:" in line]
    assert len(reason) == 1, proc.stderr[-3000:]
    assert "job failed: rank 0 " in reason[0] and "all_reduce (sum) of 3.9 KiB on a group of 2 ranks" in reason[0]
    # gloo's own timeout error or the watchdog's, whichever reports first
    assert "Timed out waiting 4000ms" in reason[0] or "within the communication timeout of 4 s" in reason[0]
    # every rank's stacks, each under its header: rank 0 waits in the collective, rank 1 where it stopped
    rank1 = proc.stderr.split("--- stacks of rank 1")[1]
    rank0 = proc.stderr.split("--- stacks of rank 0")[1].split("--- stacks of rank 1")[0]
    wait, stop, sleep = (f"stall_job.py\", line {_line_of('stall_job.py', text)} in <module>"
                         for text in (".wait()", "signal.SIGSTOP)", "time.sleep("))
    assert wait in rank0
    if mode == "stop":  # resumed to dump its stacks, the stopped rank may already be in the next collective
        assert stop in rank1 or wait in rank1
    else:
        assert sleep in rank1
    assert ("(was stopped)" in proc.stderr) == (mode == "stop")


@pytest.mark.parametrize("mode, status, reason", [
    ("raise", 1, "exited with status 1: RuntimeError: rank 1 fails on purpose"),
    ("kill", 137, "was killed by SIGKILL"),
])
def test_the_job_ends_with_the_first_failed_ranks_own_error_and_status(tmp_path, home, mode, status, reason):
    """Rank 1 fails while rank 0 waits for it in a collective; rank 0 then fails too (the peer closed
    the connection) and the agent stops it with SIGTERM: neither is the job's reason."""
    proc = run_cli(["--num_procs", "2", SCRIPTS / "stall_job.py", "--mode", mode], tmp_path, home, timeout=120)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == status, proc.stderr[-3000:]
    assert "job failed: rank 1 (pid " in last and last.endswith(reason), proc.stderr[-3000:]


def test_the_first_failure_is_a_ranks_own_not_a_collective_it_caused_nor_the_agents_sigterm():
    from types import SimpleNamespace

    from lightspeed.launcher.exits import first_failure

    def failure(exitcode, timestamp, precise=None, collective=False):
        data = {"message": "m", "timestamp": timestamp}
        if precise is not None:
            data.update(lightspeed_time=precise, lightspeed_collective=collective)
        return SimpleNamespace(pid=10, exitcode=exitcode, timestamp=timestamp, error_file_data=data)

    # rank 1 raised; rank 0's collective failed because of it, a little later, and the agent stopped it
    assert first_failure({0: failure(-15, 100, 100.30, True), 1: failure(1, 100, 100.20)})[0] == 1
    # rank 1 was killed (no error file, the agent's whole-second timestamp is later): still first
    assert first_failure({0: failure(1, 100, 100.40, True), 1: failure(-9, 101)})[0] == 1
    # the agent's SIGTERM (no error file) is never the first failure, whatever the timestamps say
    assert first_failure({0: failure(-15, 99), 1: failure(1, 100)})[0] == 1
    assert first_failure({0: failure(-15, 100)})[0] == 0
    # a stall: the rank whose collective timed out first, though the agent stopped it later
    assert first_failure({0: failure(-15, 100, 100.1, True), 1: failure(1, 100, 100.5, True)})[0] == 0


def _stalled_since(stdout: str) -> float:
    return float(next(line for line in stdout.splitlines() if line.startswith("rank 1 stalls at")).split()[-1])


@pytest.mark.parametrize("mode, nprocs", [("stop", 2), ("sleep", 2), ("stop", 4)])
def test_the_heartbeat_names_a_stalled_rank_long_before_the_comm_timeout(tmp_path, home, mode, nprocs):
    proc = run_cli(["--num_procs", nprocs, SCRIPTS / "stall_job.py", "--mode", mode, "--stall_seconds", "3"],
                   tmp_path, home, timeout=120)
    ended = time.time()
    # (resumed to dump its stacks, a stopped rank may finish the collective before the job ends)
    assert proc.returncode == 124, proc.stderr[-3000:]
    assert ended - _stalled_since(proc.stdout) < 3 + 15
    last = proc.stderr.strip().splitlines()[-1]
    assert "job failed: rank " in last and ": rank 1 stalled: " in last, proc.stderr[-3000:]
    assert f"; this rank waits in all_reduce (sum) of 3.9 KiB on a group of {nprocs} ranks" in last
    reason = "its heartbeat stopped" if mode == "stop" else "it waits in no collective and made no progress"
    assert reason in last
    for rank in range(nprocs):  # every rank's stacks, the stalled rank's where it stalled
        assert f"--- stacks of rank {rank}" in proc.stderr
    rank1 = proc.stderr.split("--- stacks of rank 1")[1]
    where = _line_of("stall_job.py", "signal.SIGSTOP)" if mode == "stop" else "time.sleep(")
    # resumed to dump its stacks, a stopped rank may already be in the next collective
    wait = _line_of("stall_job.py", ".wait()")
    assert f"line {where} in <module>" in rank1 or (mode == "stop" and f"line {wait} in <module>" in rank1)


@pytest.mark.parametrize("mode", ["stop", "sleep"])
def test_without_a_launcher_the_waiting_ranks_end_within_seconds_of_a_stall(tmp_path, mode):
    env = clean_env(tmp_path, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE="2")
    procs = [subprocess.Popen([sys.executable, str(SCRIPTS / "stall_job.py"), "--mode", mode, "--stall_seconds", "3"],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        out0, err0 = procs[0].communicate(timeout=90)
        ended = time.time()
        if mode == "sleep":  # the named rank ends itself; a stopped one cannot
            out1, err1 = procs[1].communicate(timeout=30)
            assert procs[1].returncode == 124 and "named as stalled by rank 0" in err1, err1[-3000:]
            assert "stall_job.py" in err1  # its own stacks
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert procs[0].returncode == 124, err0[-3000:]
    if mode == "sleep":
        assert ended - _stalled_since(out1) < 3 + 15
    assert "lightspeed: rank 0: rank 1 stalled: " in err0 and "stacks of every thread" in err0, err0[-3000:]


def test_without_a_launcher_a_rank_killed_mid_save_ends_its_peers_commit_within_seconds(tmp_path):
    env = clean_env(tmp_path, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE="2")
    start = time.monotonic()
    procs = [subprocess.Popen([sys.executable, str(SCRIPTS / "save_kill_job.py"), str(tmp_path / "ckpt")],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        _, err0 = procs[0].communicate(timeout=90)  # the commit timeout is 600 s
        elapsed = time.monotonic() - start  # (rank 1 is not reaped yet: a zombie counts as gone)
        procs[1].communicate(timeout=30)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert procs[1].returncode == -9
    assert procs[0].returncode == 1, err0[-3000:]
    assert elapsed < 45, elapsed  # start-up is most of it
    assert "rank 1 (world rank) cannot finish its part of tag t1: its process" in err0, err0[-3000:]
    assert not (tmp_path / "ckpt" / "latest").exists()


def test_failure_reason_is_one_line():
    from types import SimpleNamespace

    from lightspeed.launcher.local import failure_reason

    generic = "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"
    assert failure_reason(1, SimpleNamespace(message=generic, exitcode=3, pid=11)) == "rank 1 (pid 11) exited with status 3"
    killed = SimpleNamespace(message="", exitcode=-9, pid=12, signal_name=lambda: "SIGKILL")
    assert failure_reason(0, killed) == "rank 0 (pid 12) was killed by SIGKILL"
    recorded = SimpleNamespace(message={"message": "ValueError: bad\nsecond line", "extraInfo": {}}, exitcode=1, pid=13)
    assert failure_reason(2, recorded) == "rank 2 (pid 13) exited with status 1: ValueError: bad"
    stopped = SimpleNamespace(message="lightspeed: rank 0: rank 1 stalled: ...", exitcode=-15, pid=14,
                              error_file_data={"lightspeed_time": 1.0, "lightspeed_collective": True})
    assert failure_reason(0, stopped) == ("rank 0 (pid 14) failed (status 124), then was stopped by the launcher: "
                                          "lightspeed: rank 0: rank 1 stalled: ...")


def test_the_process_group_is_destroyed_before_interpreter_exit(tmp_path, home):
    """gloo's worker threads are joined by lightspeed's exit handler, while the interpreter is alive
    (else a worker releasing a backward-issued collective at finalization aborts the process)."""
    out = tmp_path / "out"
    out.mkdir()
    proc = run_cli(["--num_procs", "2", SCRIPTS / "teardown_job.py", out], tmp_path, home, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in range(2):
        record = out / f"rank{rank}.txt"
        assert record.exists(), f"rank {rank} wrote no thread record at exit: {proc.stderr[-3000:]}"
        threads = record.read_text().split()
        assert "pt_gloo_runloop" not in threads, threads  # the threads that run (and release) collectives
