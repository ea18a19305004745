"""ZeRO++ (`zero_quantized_weights`, `zero_hpz_partition_size`, `zero_quantized_gradients`,
`zero_quantized_nontrainable_weights`): the `Collectives` bundle a stage-3 strategy is handed.

Owns: choosing and wiring the collective objects for the four keys (and the node groups they need).
Must not: know parameter groups; each piece is an object the groups call like the exact one.

- qwZ: every parameter all-gather sends int8 codes and block scales (`QuantizedAllGather`); the fp32
  masters and the lp shards stay as they are, only the gathered copy is quantized.
- hpZ: each group's `ParamGather` keeps a secondary shard within its partition group of P consecutive
  ranks after the first gather of a step, and gathers from it within the group until the shard changes
  (P usually a machine's ranks; DeepSpeed's `zero_hpz_partition_size` meaning).
  With qwZ the secondary shard is the received int8 payload (so the backward gathers re-quantize
  nothing). *Changed*: DeepSpeed gathers each forward from the primary shards; here a forward that
  finds a secondary shard made since the last step (micro-steps of gradient accumulation) reads it.
- qgZ: the gradient reduce-scatter is `QuantizedReduceScatter`, with nodes of `ranks_per_node()` ranks
  (DeepSpeed: the visible device count), whatever P is.
- frozen weights: a group of parameters with requires_grad=False keeps its shard as a `QuantizedShard`
  and gathers it as stored, int8 codes and scales.

Byte counts: the objects also count the bytes that cross machines of `ranks_per_node()` ranks
(`CommStats.inter_node_bytes`).
"""

from __future__ import annotations

from lightspeed.comm.codecs import AllGather, AllReduce, Collectives, ParamGather, ReduceScatter
from lightspeed.comm.collectives import Communicator
from lightspeed.comm.node_groups import NodeComms, ranks_per_node
from lightspeed.comm.quantized import QuantizedAllGather, QuantizedReduceScatter, QuantizedShard
from lightspeed.config.errors import ConfigError

HPZ_KEY = "zero_optimization.zero_hpz_partition_size"


def zeropp_enabled(zero) -> bool:
    """True when the `zero_optimization` section turns on any ZeRO++ piece."""
    return bool(zero.zero_quantized_weights or zero.zero_quantized_nontrainable_weights
                or zero.zero_quantized_gradients or zero.zero_hpz_partition_size > 1)


def zeropp_collectives(comm: Communicator, zero) -> Collectives:
    """The collectives of a stage-3 run with the ZeRO++ keys of `zero` (a `ZeroConfig`). Every rank of
    `comm` must call it (it may create process groups)."""
    world = comm.world_size
    hpz = int(zero.zero_hpz_partition_size) if zero.zero_hpz_partition_size > 1 else 1
    if hpz > 1 and (hpz > world or world % hpz):
        raise ConfigError(f"{HPZ_KEY}: {hpz} ranks per partition must divide the data-parallel world size ({world})")
    node_size = ranks_per_node(world)  # a machine's ranks: what "inter-node" counts and qgZ's stages use
    exact = AllGather(comm, inter_node_fraction=_inter_fraction(world, node_size))
    quant = QuantizedAllGather(comm, inter_node_fraction=_inter_fraction(world, node_size))
    partition = NodeComms.build(comm, hpz, HPZ_KEY) if hpz > 1 else None
    node_exact = node_quant = None
    if partition is not None:
        inside = _inter_fraction(hpz, node_size)
        node_exact = AllGather(partition.intra, comm.stats, name="all_gather_intra_node", inter_node_fraction=inside)
        node_quant = QuantizedAllGather(partition.intra, comm.stats, name="quantized_all_gather_intra_node",
                                        inter_node_fraction=inside)

    def param_gather(trainable: bool) -> ParamGather:
        quantized = zero.zero_quantized_weights or (not trainable and zero.zero_quantized_nontrainable_weights)
        base, node = (quant, node_quant) if quantized else (exact, node_exact)
        if partition is None:
            return ParamGather(base)
        return ParamGather(base, node, partition_size=hpz, partition_rank=partition.node_rank)

    def store_shard(shard, trainable: bool):
        if not trainable and zero.zero_quantized_nontrainable_weights:
            return QuantizedShard(shard)
        return shard

    reduce_scatter = ReduceScatter(comm)
    if zero.zero_quantized_gradients:
        key = "zero_optimization.zero_quantized_gradients"
        same = partition is not None and hpz == node_size
        reduce_scatter = QuantizedReduceScatter(comm, partition if same else NodeComms.build(comm, node_size, key))
    return Collectives(comm, AllReduce(comm), reduce_scatter, exact, param_gathers=param_gather,
                       shard_store=store_shard)


def _inter_fraction(group_size: int, node_size: int) -> float:
    """The share of a gather over `group_size` consecutive ranks that comes from other machines of
    `node_size` ranks (groups and machines aligned, as consecutive ranks are)."""
    return max(group_size - node_size, 0) / group_size
