"""DeepSpeed's `deepspeed.comm` functions: torch.distributed collectives on the default group (or a
group passed in), with DeepSpeed's names and signatures, for user code and for the `deepspeed.comm`
that `register_as_deepspeed()` exposes.

Owns: those module-level functions. Must not: hold process groups of its own (lightspeed's runtime
passes `ParallelGroups` around and issues its collectives through `Communicator`), or start
torch.distributed implicitly (`init_distributed` does that, explicitly).

`prof`, `log_name` and `debug` are accepted for DeepSpeed's signatures; these functions call torch
directly, so the comms logger (`comm/comms_logger.py`, `configure`, `log_summary`) times the runtime's
collectives, not these.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from lightspeed.comm.collectives import all_gather_single, reduce_scatter_single
from lightspeed.comm.init import init_distributed

ReduceOp = dist.ReduceOp


def _require_initialized(what: str) -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"comm.{what}: torch.distributed is not initialized; call init_distributed() first")


def is_available() -> bool:
    return dist.is_available()


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def destroy_process_group(group=None) -> None:
    dist.destroy_process_group(group)


def get_rank(group=None) -> int:
    _require_initialized("get_rank")
    return dist.get_rank(group)


def get_world_size(group=None) -> int:
    _require_initialized("get_world_size")
    return dist.get_world_size(group)


def get_local_rank() -> int:
    """This process's rank on its node, as the launcher set it (LOCAL_RANK, else Open MPI's, else 0)."""
    return int(os.environ.get("LOCAL_RANK", os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", 0)))


def get_global_rank(group=None, group_rank: int = 0) -> int:
    _require_initialized("get_global_rank")
    return dist.get_global_rank(group, group_rank) if group is not None else group_rank


def get_backend(group=None) -> str:
    _require_initialized("get_backend")
    return dist.get_backend(group)


def new_group(ranks):
    _require_initialized("new_group")
    return dist.new_group(ranks)


def barrier(group=None, async_op: bool = False, device_ids=None, prof: bool = False, log_name: str = "barrier",
            debug=None):
    _require_initialized("barrier")
    return dist.barrier(group=group, async_op=async_op, device_ids=device_ids)


def broadcast(tensor: torch.Tensor, src: int, group=None, async_op: bool = False, prof: bool = False,
              log_name: str = "broadcast", debug=None):
    """Broadcast from global rank `src` (torch.distributed's convention, and DeepSpeed's)."""
    return dist.broadcast(tensor, src=src, group=group, async_op=async_op)


def broadcast_object_list(object_list: list, src: int, group=None, device=None):
    return dist.broadcast_object_list(object_list, src=src, group=group, device=device)


def all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, async_op: bool = False, prof: bool = False,
               log_name: str = "all_reduce", debug=None):
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def inference_all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, async_op: bool = False,
                         prof: bool = False, log_name: str = "all_reduce", debug=None):
    """DeepSpeed's low-latency all-reduce for inference; here the same all-reduce as `all_reduce`."""
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def reduce(tensor: torch.Tensor, dst: int, op=ReduceOp.SUM, group=None, async_op: bool = False, prof: bool = False,
           log_name: str = "reduce", debug=None):
    return dist.reduce(tensor, dst=dst, op=op, group=group, async_op=async_op)


def all_gather(tensor_list: list, tensor: torch.Tensor, group=None, async_op: bool = False, prof: bool = False,
               log_name: str = "all_gather", debug=None):
    return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)


def all_gather_object(object_list: list, obj, group=None, prof: bool = False, log_name: str = "all_gather_object",
                      debug=None):
    return dist.all_gather_object(object_list, obj, group=group)


def all_gather_into_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor, group=None, async_op: bool = False,
                           prof: bool = False, log_name: str = "all_gather_into_tensor", debug=None):
    """`output_tensor` (world_size * tensor.numel() elements) = every rank's `tensor`, in rank order."""
    return all_gather_single(output_tensor, tensor, group=group, async_op=async_op)


def allgather_fn(output_tensor: torch.Tensor, input_tensor: torch.Tensor, group=None, async_op: bool = False,
                 debug=None):
    return all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)


def has_all_gather_into_tensor() -> bool:
    return True


def reduce_scatter(output: torch.Tensor, input_list: list, op=ReduceOp.SUM, group=None, async_op: bool = False,
                   prof: bool = False, log_name: str = "reduce_scatter", debug=None):
    return dist.reduce_scatter(output, input_list, op=op, group=group, async_op=async_op)


def reduce_scatter_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor, op=ReduceOp.SUM, group=None,
                          async_op: bool = False, prof: bool = False, log_name: str = "reduce_scatter_tensor",
                          debug=None):
    """`output_tensor` = this rank's chunk of the reduction of every rank's `tensor`."""
    return reduce_scatter_single(output_tensor, tensor, op=op, group=group, async_op=async_op)


def reduce_scatter_fn(output_tensor: torch.Tensor, tensor: torch.Tensor, op=ReduceOp.SUM, group=None,
                      async_op: bool = False, prof: bool = False, debug=None):
    return reduce_scatter_single(output_tensor, tensor, op=op, group=group, async_op=async_op)


def has_reduce_scatter_tensor() -> bool:
    return True


def all_to_all_single(output: torch.Tensor, tensor: torch.Tensor, output_split_sizes=None, input_split_sizes=None,
                      group=None, async_op: bool = False, prof: bool = False, log_name: str = "all_to_all_single",
                      debug=None):
    return dist.all_to_all_single(output, tensor, output_split_sizes=output_split_sizes,
                                  input_split_sizes=input_split_sizes, group=group, async_op=async_op)


def send(tensor: torch.Tensor, dst: int, group=None, tag: int = 0, prof: bool = False, log_name: str = "send",
         debug=None):
    return dist.send(tensor, dst=dst, group=group, tag=tag)


def recv(tensor: torch.Tensor, src: int | None = None, group=None, tag: int = 0, prof: bool = False,
         log_name: str = "recv", debug=None):
    return dist.recv(tensor, src=src, group=group, tag=tag)


def isend(tensor: torch.Tensor, dst: int, group=None, tag: int = 0, prof: bool = False, log_name: str = "isend",
          debug=None):
    return dist.isend(tensor, dst=dst, group=group, tag=tag)


def irecv(tensor: torch.Tensor, src: int | None = None, group=None, tag: int = 0, prof: bool = False,
          log_name: str = "irecv", debug=None):
    return dist.irecv(tensor, src=src, group=group, tag=tag)


def gather(tensor: torch.Tensor, gather_list=None, dst: int = 0, group=None, async_op: bool = False,
           prof: bool = False, log_name: str = "gather", debug=None):
    return dist.gather(tensor, gather_list=gather_list, dst=dst, group=group, async_op=async_op)


def scatter(tensor: torch.Tensor, scatter_list=None, src: int = 0, group=None, async_op: bool = False,
            prof: bool = False, log_name: str = "scatter", debug=None):
    return dist.scatter(tensor, scatter_list=scatter_list, src=src, group=group, async_op=async_op)


def all_to_all(output_tensor_list: list, input_tensor_list: list, group=None, async_op: bool = False,
               prof: bool = False, log_name: str = "all_to_all", debug=None):
    return dist.all_to_all(output_tensor_list, input_tensor_list, group=group, async_op=async_op)


def all_reduce_coalesced(tensors: list, op=ReduceOp.SUM, group=None, async_op: bool = False, prof: bool = False,
                         log_name: str = "all_reduce", debug=None):
    return dist.all_reduce_coalesced(tensors, op=op, group=group, async_op=async_op)


class _AllHandles:
    """One handle over several: `wait()` waits for each, `is_completed()` when all are."""

    def __init__(self, handles: list):
        self._handles = handles

    def wait(self) -> bool:
        for handle in self._handles:
            handle.wait()
        return True

    def is_completed(self) -> bool:
        return all(handle.is_completed() for handle in self._handles)


def all_gather_coalesced(output_tensors: list, input_tensors: list, group=None, async_op: bool = False):
    """All-gathers each input into its output (`all_gather_into_tensor` pairwise); with `async_op` a
    handle whose `wait()` waits for every gather, else it returns once all are done."""
    if len(output_tensors) != len(input_tensors):
        raise ValueError(f"all_gather_coalesced: {len(output_tensors)} outputs for {len(input_tensors)} inputs")
    _require_initialized("all_gather_coalesced")
    handle = _AllHandles([dist.all_gather_into_tensor(out, inp, group=group, async_op=True)
                          for out, inp in zip(output_tensors, input_tensors)])
    if async_op:
        return handle
    handle.wait()
    return None


def has_all_reduce_coalesced() -> bool:
    return hasattr(dist, "all_reduce_coalesced")


def has_coalescing_manager() -> bool:
    return hasattr(dist.distributed_c10d, "_coalescing_manager")


class P2POp:
    """One point-to-point operation of `batch_isend_irecv`: `op` is `isend` or `irecv` (this module's
    or torch.distributed's), `peer` a global rank."""

    def __init__(self, op, tensor: torch.Tensor, peer: int, group=None, tag: int = 0):
        if op not in (isend, irecv, dist.isend, dist.irecv):
            raise ValueError(f"P2POp: op must be deepspeed.comm.isend or deepspeed.comm.irecv (got {op!r})")
        self.op = "isend" if op in (isend, dist.isend) else "irecv"
        self.tensor, self.peer, self.group, self.tag = tensor, peer, group, tag


def batch_isend_irecv(p2p_op_list: list, prof: bool = False, log_name: str = "batch_isend_irecv", debug=None):
    """Starts the point-to-point operations together; their requests."""
    _require_initialized("batch_isend_irecv")
    return dist.batch_isend_irecv([dist.P2POp(getattr(dist, op.op), op.tensor, op.peer, op.group, op.tag)
                                   for op in p2p_op_list])


def monitored_barrier(group=None, timeout=None, wait_all_ranks: bool = False, prof: bool = False,
                      log_name: str = "monitored_barrier", debug=None):
    _require_initialized("monitored_barrier")
    return dist.monitored_barrier(group=group if group is not None else dist.group.WORLD, timeout=timeout,
                                  wait_all_ranks=wait_all_ranks)


def get_world_group():
    _require_initialized("get_world_group")
    return dist.group.WORLD


def get_all_ranks_from_group(group=None) -> list[int]:
    """The global ranks of `group`'s members, in group-rank order (every rank without a group)."""
    _require_initialized("get_all_ranks_from_group")
    if group is None:
        return list(range(dist.get_world_size()))
    return dist.get_process_group_ranks(group)


def _launcher_env(names: tuple[str, ...], default: int) -> int:
    for name in names:
        if os.environ.get(name) is not None:
            return int(os.environ[name])
    return default


def get_world_rank_from_launcher() -> int:
    """RANK, else Open MPI's OMPI_COMM_WORLD_RANK, else 0."""
    return _launcher_env(("RANK", "OMPI_COMM_WORLD_RANK"), 0)


def get_world_size_from_launcher() -> int:
    """WORLD_SIZE, else Open MPI's OMPI_COMM_WORLD_SIZE, else 1."""
    return _launcher_env(("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE"), 1)


def get_local_rank_from_launcher() -> int:
    """LOCAL_RANK, else Open MPI's OMPI_COMM_WORLD_LOCAL_RANK, else 0."""
    return _launcher_env(("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"), 0)


def in_aml() -> bool:
    """Inside an Azure Machine Learning job."""
    return "AZUREML_EXPERIMENT_ID" in os.environ


def in_aws_sm() -> bool:
    """Inside an AWS SageMaker training job."""
    return "SM_TRAINING_ENV" in os.environ


def in_dlts() -> bool:
    """On a DLTS cluster."""
    return "DLTS_JOB_ID" in os.environ


def configure(deepspeed_config=None, enabled=None, prof_all=None, prof_ops=None, verbose=None, debug=None):
    """DeepSpeed's `deepspeed.comm.configure`: the comms logger from a config's `comms_logger` section
    (`deepspeed_config`: a loaded config or anything with `.comms_logger`), then the keyword overrides."""
    from lightspeed.comm.comms_logger import COMMS_LOGGER

    if deepspeed_config is not None:
        COMMS_LOGGER.configure(getattr(deepspeed_config, "comms_logger", deepspeed_config))
    for key, value in (("enabled", enabled), ("prof_all", prof_all), ("verbose", verbose), ("debug", debug)):
        if value is not None:
            setattr(COMMS_LOGGER, key, bool(value))
    if prof_ops is not None:
        COMMS_LOGGER.prof_ops = list(prof_ops)


def log_summary(show_straggler: bool = False, return_dict: bool = False):
    """DeepSpeed's `deepspeed.comm.log_summary` (see `comm/comms_logger.py`)."""
    from lightspeed.comm.comms_logger import log_summary as _log_summary

    return _log_summary(show_straggler=show_straggler, return_dict=return_dict)


NCCL_BACKEND, CCL_BACKEND, MPI_BACKEND, GLOO_BACKEND, SCCL_BACKEND, HCCL_BACKEND = (
    "nccl", "ccl", "mpi", "gloo", "sccl", "hccl")
TORCH_DISTRIBUTED_DEFAULT_PORT = 29500
default_pg_timeout = timedelta(minutes=10)

__all__ = [
    "CCL_BACKEND", "GLOO_BACKEND", "HCCL_BACKEND", "MPI_BACKEND", "NCCL_BACKEND", "P2POp", "SCCL_BACKEND",
    "TORCH_DISTRIBUTED_DEFAULT_PORT", "all_gather_coalesced", "all_reduce_coalesced", "all_to_all",
    "batch_isend_irecv", "default_pg_timeout", "get_all_ranks_from_group", "get_local_rank_from_launcher",
    "get_world_group", "get_world_rank_from_launcher", "get_world_size_from_launcher", "has_all_reduce_coalesced",
    "has_coalescing_manager", "in_aml", "in_aws_sm", "in_dlts", "monitored_barrier",
    "ReduceOp", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce", "all_to_all_single",
    "allgather_fn", "barrier", "broadcast", "broadcast_object_list", "configure", "destroy_process_group",
    "gather", "get_backend", "get_global_rank", "get_local_rank", "get_rank", "get_world_size",
    "has_all_gather_into_tensor", "has_reduce_scatter_tensor", "inference_all_reduce", "init_distributed",
    "irecv", "is_available", "is_initialized", "isend", "log_summary", "new_group", "recv", "reduce",
    "reduce_scatter", "reduce_scatter_fn", "reduce_scatter_tensor", "scatter", "send",
]
