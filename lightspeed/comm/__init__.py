"""Communication: the only package that imports torch.distributed.

`init.py` starts the process group (and its timeout and teardown), `topology.py` holds the run's mesh
(`Topology`: dims pp, dp_replicate, edp_shard, ep, sp, tp and the group of any set of them),
`groups.py` its data-parallel view `ParallelGroups`, `collectives.py` the `Communicator` the runtime uses
(the only place collectives are issued), `codecs.py` the collective objects strategies are handed, with
their byte counts, `watchdog.py` the stall reports, `heartbeat.py` the rank heartbeat that names a stalled rank, `comms_logger.py` DeepSpeed's comms logger
(`log_summary`), `tp_autograd.py` the tensor-parallel autograd functions, `differentiable.py` Ulysses'
all-to-all and the autograd gathers, `sequence_groups.py` the sequence-parallel record (process-wide:
transformers asks for its group by name), `onebit.py` the one-bit all-reduce, and ZeRO++'s pieces:
`quantized.py` (int8 weight gather, int4 hierarchical reduce-scatter), `node_groups.py`, `zeropp.py`.
DeepSpeed's module-level `deepspeed.comm` functions (`get_rank`, `all_reduce`, `all_gather_into_tensor`,
...) live in `api.py` and are reachable here (`lightspeed.comm.get_rank()`), imported on first use so
`import lightspeed.comm` stays light.
"""

_API = ("ReduceOp", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce", "all_to_all_single",
        "allgather_fn", "barrier", "broadcast", "broadcast_object_list", "configure", "destroy_process_group",
        "gather", "get_backend", "get_global_rank", "get_local_rank", "get_rank", "get_world_size",
        "has_all_gather_into_tensor", "has_reduce_scatter_tensor", "inference_all_reduce", "init_distributed",
        "irecv", "is_available", "is_initialized", "isend", "log_summary", "new_group", "recv", "reduce",
        "reduce_scatter", "reduce_scatter_fn", "reduce_scatter_tensor", "scatter", "send",
        "CCL_BACKEND", "GLOO_BACKEND", "HCCL_BACKEND", "MPI_BACKEND", "NCCL_BACKEND", "P2POp", "SCCL_BACKEND",
        "TORCH_DISTRIBUTED_DEFAULT_PORT", "all_gather_coalesced", "all_reduce_coalesced", "all_to_all",
        "batch_isend_irecv", "default_pg_timeout", "get_all_ranks_from_group", "get_local_rank_from_launcher",
        "get_world_group", "get_world_rank_from_launcher", "get_world_size_from_launcher", "has_all_reduce_coalesced",
        "has_coalescing_manager", "in_aml", "in_aws_sm", "in_dlts", "monitored_barrier")

__all__ = list(_API)


def __getattr__(name: str):
    if name == "log_summary":
        from lightspeed.comm.comms_logger import log_summary

        return log_summary
    if name in _API:
        from lightspeed.comm import api

        return getattr(api, name)
    raise AttributeError(f"module 'lightspeed.comm' has no attribute {name!r}")
