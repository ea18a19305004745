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


__all__ = [
    "ReduceOp", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce", "all_to_all_single",
    "allgather_fn", "barrier", "broadcast", "broadcast_object_list", "configure", "destroy_process_group",
    "gather", "get_backend", "get_global_rank", "get_local_rank", "get_rank", "get_world_size",
    "has_all_gather_into_tensor", "has_reduce_scatter_tensor", "inference_all_reduce", "init_distributed",
    "irecv", "is_available", "is_initialized", "isend", "log_summary", "new_group", "recv", "reduce",
    "reduce_scatter", "reduce_scatter_fn", "reduce_scatter_tensor", "scatter", "send",
]
