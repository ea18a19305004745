"""DeepSpeed's `deepspeed.comm` names that need no process group (lightspeed/comm/api.py): the backend
constants, the launcher's environment readers, the cluster probes, `P2POp`'s check, and the refusal
of a collective before init_distributed. The collectives themselves run in
tests/distributed/test_deepspeed_compat.py."""

from datetime import timedelta

import pytest
import torch

from lightspeed.compat.deepspeed import comm


def test_backend_constants_and_defaults():
    assert (comm.NCCL_BACKEND, comm.CCL_BACKEND, comm.MPI_BACKEND, comm.GLOO_BACKEND, comm.SCCL_BACKEND,
            comm.HCCL_BACKEND) == ("nccl", "ccl", "mpi", "gloo", "sccl", "hccl")
    assert comm.TORCH_DISTRIBUTED_DEFAULT_PORT == 29500 and comm.default_pg_timeout == timedelta(minutes=10)
    assert comm.has_all_reduce_coalesced() is True and isinstance(comm.has_coalescing_manager(), bool)


def test_launcher_environment(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                 "OMPI_COMM_WORLD_LOCAL_RANK", "AZUREML_EXPERIMENT_ID", "SM_TRAINING_ENV", "DLTS_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    assert (comm.get_world_rank_from_launcher(), comm.get_world_size_from_launcher(),
            comm.get_local_rank_from_launcher()) == (0, 1, 0)
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "5")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "8")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "1")
    assert (comm.get_world_rank_from_launcher(), comm.get_world_size_from_launcher(),
            comm.get_local_rank_from_launcher()) == (5, 8, 1)
    monkeypatch.setenv("RANK", "3")  # the launcher's variables win over Open MPI's
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert (comm.get_world_rank_from_launcher(), comm.get_world_size_from_launcher(),
            comm.get_local_rank_from_launcher()) == (3, 4, 0)
    assert not (comm.in_aml() or comm.in_aws_sm() or comm.in_dlts())
    monkeypatch.setenv("SM_TRAINING_ENV", "{}")
    assert comm.in_aws_sm() and not comm.in_aml()


def test_p2p_op_and_uninitialized_refusals():
    op = comm.P2POp(comm.irecv, torch.zeros(1), 1, tag=3)
    assert (op.op, op.peer, op.group, op.tag) == ("irecv", 1, None, 3)
    assert comm.P2POp(torch.distributed.isend, torch.zeros(1), 0).op == "isend"
    with pytest.raises(ValueError, match="op must be deepspeed.comm.isend or deepspeed.comm.irecv"):
        comm.P2POp(comm.send, torch.zeros(1), 1)
    with pytest.raises(ValueError, match="2 outputs for 1 inputs"):
        comm.all_gather_coalesced([torch.zeros(1), torch.zeros(1)], [torch.zeros(1)])
    for call in (comm.get_world_group, comm.get_all_ranks_from_group, comm.monitored_barrier,
                 lambda: comm.batch_isend_irecv([op])):
        with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
            call()


def test_lightspeed_comm_reaches_every_api_function():
    import lightspeed.comm as ls_comm
    from lightspeed.comm import api

    assert sorted(ls_comm.__all__) == sorted(api.__all__)
    assert ls_comm.batch_isend_irecv is api.batch_isend_irecv
