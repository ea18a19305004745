"""`detect_launch_env`: the rank layout read from torchrun, Open MPI and SLURM variables (pure: the
environment is passed as a dict, no processes)."""

from __future__ import annotations

import pytest

from lightspeed.comm.init import LaunchEnv, detect_launch_env

TORCHRUN = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "1234"}
OMPI = {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "16", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}
SLURM = {"SLURM_PROCID": "6", "SLURM_NTASKS": "12", "SLURM_LOCALID": "2", "SLURM_NODELIST": "gpu[03-05,09]"}


def test_torchrun_variables():
    assert detect_launch_env(TORCHRUN) == LaunchEnv(3, 8, 1, "10.0.0.5", 1234, "torchrun")


def test_torchrun_defaults_for_missing_optional_variables():
    launch = detect_launch_env({"RANK": "0", "WORLD_SIZE": "2"})
    assert launch == LaunchEnv(0, 2, 0, "127.0.0.1", 29500, "torchrun")
    assert detect_launch_env({"RANK": "1", "WORLD_SIZE": "2"}, distributed_port=31337).master_port == 31337


def test_torchrun_wins_over_mpi_and_slurm():
    # torchrun started inside an srun / mpirun allocation: its own variables describe this process
    assert detect_launch_env({**SLURM, **OMPI, **TORCHRUN}).source == "torchrun"
    assert detect_launch_env({**SLURM, **OMPI, **TORCHRUN}).rank == 3


def test_rank_without_world_size_is_not_torchrun():
    assert detect_launch_env({"RANK": "1", **SLURM}).source == "slurm"


def test_open_mpi_variables():
    launch = detect_launch_env({**OMPI, "MASTER_ADDR": "head", "MASTER_PORT": "4000"})
    assert launch == LaunchEnv(5, 16, 1, "head", 4000, "openmpi")


def test_open_mpi_defaults():
    launch = detect_launch_env({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4"}, distributed_port=29600)
    assert launch == LaunchEnv(0, 4, 0, "127.0.0.1", 29600, "openmpi")


def test_open_mpi_wins_over_slurm():
    # mpirun inside a SLURM allocation: SLURM_PROCID is the rank of mpirun itself, not of this process
    launch = detect_launch_env({**SLURM, **OMPI})
    assert (launch.source, launch.rank, launch.world_size) == ("openmpi", 5, 16)


def test_slurm_variables():
    assert detect_launch_env(SLURM) == LaunchEnv(6, 12, 2, "gpu03", 29500, "slurm")


@pytest.mark.parametrize("nodelist,first", [
    ("node[03-05,09]", "node03"),
    ("node[09,03-05]", "node09"),
    ("node[7]", "node7"),
    ("a,b", "a"),
    ("single", "single"),
    ("login,node[1-4]", "login"),
    ("node[1-4],login", "node1"),
    ("gpu-node[001-004],cpu[1-2]", "gpu-node001"),
    ("node[1-2]-ib,node[5-6]-ib", "node1-ib"),  # a suffix after the brackets belongs to every host
    ("rack[2-3]-n[05-08]", "rack2-n05"),  # several bracket groups: first of each
    ("10.0.0.7", "10.0.0.7"),
])
def test_slurm_master_is_the_first_host_of_the_nodelist(nodelist, first):
    launch = detect_launch_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_NODELIST": nodelist})
    assert launch.master_addr == first


def test_slurm_job_nodelist_fallback_and_explicit_master():
    base = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2"}
    assert detect_launch_env({**base, "SLURM_JOB_NODELIST": "c[10-11]"}).master_addr == "c10"
    launch = detect_launch_env({**base, "SLURM_NODELIST": "c[10-11]", "MASTER_ADDR": "c11", "MASTER_PORT": "5000"})
    assert (launch.master_addr, launch.master_port, launch.local_rank) == ("c11", 5000, 0)
    assert detect_launch_env(base).master_addr == "127.0.0.1"  # no nodelist at all


def test_no_launcher_is_a_single_process_on_a_free_port():
    launch = detect_launch_env({})
    assert (launch.rank, launch.world_size, launch.local_rank, launch.master_addr, launch.source) == \
        (0, 1, 0, "127.0.0.1", "single-process")
    assert 0 < launch.master_port < 65536
    assert detect_launch_env({"MASTER_PORT": "4242"}).master_port == 4242


def test_partial_launcher_variables_fall_back_to_single_process():
    assert detect_launch_env({"WORLD_SIZE": "4"}).source == "single-process"
    assert detect_launch_env({"SLURM_PROCID": "3"}).source == "single-process"  # no SLURM_NTASKS


def test_an_unreadable_master_port_is_named_unless_no_rendezvous_reads_it():
    """DeepSpeed's test harness writes MASTER_PORT=None beside a file:// init_method, which reads no port."""
    import pytest

    env = dict(TORCHRUN, MASTER_PORT="None")
    with pytest.raises(ValueError, match="MASTER_PORT must be a port number \\(got 'None'\\)"):
        detect_launch_env(env)
    assert detect_launch_env(env, distributed_port=29511, port_required=False).master_port == 29511
    assert detect_launch_env({"MASTER_PORT": "None"}, port_required=False).master_port > 0  # a free one
