"""ZenFlow at ZeRO stage 3: the stage's partitioned groups as ZenFlow's shards (zero/zenflow.py).

Owns: `zenflow_shards`, one `ZenFlowShard` per (trainable ParamGroup, optimizer param group holding
some of its parameters), in group order then optimizer-group order on every rank. Must not: step,
select or reduce anything (zero/zenflow.py does), or change how the groups are laid out.

Note: [every rank, every shard] ZenFlow all-reduces each shard's column sums over the ranks holding
the shard's weights, so every rank must hold the same shards in the same order. At stage 3 a group's
optimizer piece is the part of one optimizer group's contiguous range (stage3/strategy.py's Note on
granularity) inside this rank's shard, and a rank's shard may hold none of it: that rank still gets the
shard, with no elements (no master, no pieces), so it takes part in the column sums and nothing else.
A shard's column layout lists every parameter of its range, whatever this rank holds of them. Keys
are the parameters' `ds_id`s: unique in the model, so the adaptive update counts each weight once.

Note: [where things are] A piece's master is the optimizer's tensor for it (the host fp32 shard's
slice that `_bind_optimizer` gave the optimizer), its gradient the device gradient shard's slice,
its host gradient the host gradient shard's slice, and its low-precision values the group's device lp
shard at the same offset: the device step writes the selected elements there, and the strategy's
write-back marks the shard changed before the next all-gather.
"""

from __future__ import annotations

import torch

from lightspeed.config.errors import ConfigError
from lightspeed.zero.partition import Range
from lightspeed.zero.stage3.param_group import ParamGroup
from lightspeed.zero.zenflow import ZenFlowShard


def zenflow_shards(groups: list[ParamGroup], optimizer: torch.optim.Optimizer,
                   opt_index: dict[int, int],
                   opt_pieces: dict[int, list[tuple[Range, torch.Tensor, int]]]) -> list[ZenFlowShard]:
    """ZenFlow's shards over the trainable `groups` (the Note on every rank). `opt_index`: id(param) ->
    its optimizer param group; `opt_pieces`: id(group) -> (flat range, optimizer tensor, 0) per piece."""
    out = []
    for g in groups:
        if not g.offload.offloads_optimizer:
            raise ConfigError("zero_optimization.zenflow: every trainable group's optimizer state must be in host "
                              "memory (offload_optimizer.ratio < 1 keeps some on the device)")
        by_group: dict[int, list] = {}
        for st in g.states:
            gi = opt_index.get(id(st.param))
            if gi is not None:
                by_group.setdefault(gi, []).append(st)
        tensors = {(r.start, r.end): t for r, t, _ in opt_pieces.get(id(g), ())}
        with g.grad_buffers.allocated():  # slices are cut from the gradient buffer (its storage comes and goes)
            for gi in sorted(by_group):
                out.append(_shard(g, by_group[gi], optimizer.param_groups[gi], tensors))
    return out


def _shard(g: ParamGroup, states: list, group: dict, tensors: dict) -> ZenFlowShard:
    whole = Range(states[0].range.start, states[-1].range.end)  # contiguous: laid out by optimizer group
    own = g.local(whole)  # shard coordinates
    weights = [(st.ds_id, tuple(st.shape)) for st in states]
    if not own.numel:
        empty = torch.empty(0, dtype=torch.float32)
        return ZenFlowShard(empty, empty, g.grad_shard[:0], g.lp_shard[:0], [], [], _all_reduce(g),
                            weights=weights, group=group)
    first = own.start + g.shard.start  # the piece's first element, in the group's flat coordinates
    master = tensors[(first, own.end + g.shard.start)]
    pieces = []
    for st in states:
        part = st.range.intersect(Range(first, first + own.numel))
        if part.numel:
            pieces.append((st.ds_id, tuple(st.shape), part.start - st.range.start, part.end - st.range.start,
                           part.start - first))
    return ZenFlowShard(master, g.master_grad_shard[own.start:own.end], g.grad_shard[own.start:own.end], g.lp_shard,
                        [(Range(own.start, own.end), 0)], pieces, _all_reduce(g), weights=weights, group=group)


def _all_reduce(g: ParamGroup):
    return g.collectives.all_reduce if g.collectives.world_size > 1 else None
