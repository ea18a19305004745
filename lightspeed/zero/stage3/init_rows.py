"""Rows of `zero.Init`-partitioned parameters, delivered to the ranks that keep them: how AutoEP
(parallel/experts/autoep.py) gives each ep rank its experts of a model built under `zero.Init` (a
Hugging Face `from_pretrained` at ZeRO-3) without any rank gathering a whole experts tensor.

Owns: `replace_init_module`: this rank's rows [first, first + count) along dim 0 of some parameters
of a module, read from the module's Init groups (which are then discarded), made into a new module by
the caller, whose parameters are partitioned again. Must not: decide which rows a rank keeps (the
caller says), or touch a stage-3 strategy's groups (only zero.Init's, before `initialize()` takes
them over).

Note: [the exchange] Under Init a module's parameters of one (requires_grad, dtype) lie end to end in
one flat buffer padded to a multiple of the group's world W; rank r keeps elements [r S, (r+1) S).
Rows [f, f + n) of parameter i, which sits at [a_i, b_i) of the buffer with R_i elements a row, are
elements [a_i + f R_i, a_i + (f + n) R_i). Every rank of the group publishes its (f, n); rank r sends
rank w the part of each of w's wanted ranges that lies in r's shard (parameter order), and receives
from every rank, in rank order, the parts of its own: one all-to-all with per-rank sizes per group.
A rank so receives exactly its rows (n / E of an [E, ...] parameter) and sends only what it holds;
nothing is gathered whole. Every rank of the group must call it for the same module, parameters in the
same order (each with its own rows); ranks wanting the same rows (expert-data-parallel replicas) each
receive them.

Note: [what is kept] The rows taken, the module's Init groups are discarded (its parameters become
empty placeholders). `replace_init_module` builds the replacement from the rows and partitions its
parameters again as zero.Init would (Init groups in the source's dtype, device and offload), over the
ranks that hold the same rows (AutoEP: the expert-data-parallel group), so the rows of only one module
are whole on a rank at a time; `initialize()`'s stage-3 strategy then takes these groups over, one unit
at a time, as every other Init group.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from lightspeed.comm.collectives import Communicator
from lightspeed.comm.differentiable import ragged_all_to_all
from lightspeed.zero.partition import Range, shard_range
from lightspeed.zero.stage3.init import store_init_groups, take_init_groups
from lightspeed.zero.stage3.param_group import ParamGroup, ParamState, param_state


def _wanted(st: ParamState, first: int, count: int) -> Range:
    """Elements of the group's flat buffer holding rows [first, first + count) of `st`'s parameter."""
    rows = st.shape[0]
    per_row = st.range.numel // rows if rows else 0
    start = st.range.start + first * per_row
    return Range(start, start + count * per_row)


def _exchange(g: ParamGroup, items: list[tuple[str, ParamState]], first: int, count: int) -> dict[str, torch.Tensor]:
    """This rank's rows of `items` (the Note on the exchange), on the group's device in its dtype."""
    comm = g.comm
    wants = comm.all_gather_object((first, count)) if comm.world_size > 1 else [(first, count)]
    shards = [shard_range(g.layout.padded_numel, comm.world_size, w) for w in range(comm.world_size)]
    mine = shards[comm.rank]
    g.lp_in()
    shard = g.lp_shard.to(g.device)  # a host shard (remote_device "cpu") goes through the device
    pieces, send_sizes = [], []
    for f, n in wants:
        size = 0
        for _, st in items:
            part = _wanted(st, f, n).intersect(mine)
            if part.numel:
                pieces.append(shard[part.start - mine.start:part.end - mine.start])
                size += part.numel
        send_sizes.append(size)
    recv_plan = [[_wanted(st, first, count).intersect(sh) for _, st in items] for sh in shards]
    recv_sizes = [sum(r.numel for r in parts) for parts in recv_plan]
    send = torch.cat(pieces) if pieces else shard.new_empty(0)
    if comm.world_size == 1:
        recv = send
    else:
        with torch.no_grad():
            recv = ragged_all_to_all(send, comm.group, send_sizes, recv_sizes)
    out = {name: recv.new_empty(_wanted(st, first, count).numel) for name, st in items}
    offset = 0
    for parts in recv_plan:
        for (name, st), part in zip(items, parts):
            if part.numel:
                start = part.start - _wanted(st, first, count).start
                out[name][start:start + part.numel] = recv[offset:offset + part.numel]
                offset += part.numel
    return {name: out[name].view((count,) + tuple(st.shape[1:])) for name, st in items}


def replace_init_module(module: nn.Module, names: Sequence[str], first: int, count: int,
                        build: Callable[[dict[str, torch.Tensor]], nn.Module], keep: Communicator) -> nn.Module:
    """`build(rows)` of this rank's rows [first, first + count) of `module`'s Init-partitioned `names`, with
    the new module's parameters partitioned again by zero.Init over `keep` (the ranks that took the same
    rows), as the source's were (the Note on what is kept). Collective."""
    rows, like = _take(module, names, first, count)
    built = build(rows)
    del rows
    # each parameter keeps its rows' dtype (its source group's), on the source's device and offload
    store_init_groups(built, list(built.named_parameters(recurse=False)), keep, like.device, None, like.offload)
    return built


def _take(module: nn.Module, names: Sequence[str], first: int, count: int
          ) -> tuple[dict[str, torch.Tensor], ParamGroup]:
    groups = take_init_groups(module)
    by_group: dict[int, tuple[ParamGroup, list[tuple[str, ParamState]]]] = {}
    for name in names:
        p = getattr(module, name)
        st = param_state(p)
        if st is None or not any(st.group is g for g in groups):
            raise ValueError(f"{type(module).__name__}.{name} is not a parameter partitioned by zero.Init on "
                             "this module (built outside zero.Init, or already taken over by initialize())")
        if not 0 <= first <= first + count <= st.shape[0]:
            raise ValueError(f"{type(module).__name__}.{name}: rows [{first}, {first + count}) of "
                             f"{tuple(st.shape)}")
        by_group.setdefault(id(st.group), (st.group, []))[1].append((name, st))
    out: dict[str, torch.Tensor] = {}
    for g, items in by_group.values():
        out.update(_exchange(g, items, first, count))
    for g in groups:
        g.discard()
    return out, groups[0]


__all__ = ["replace_init_module"]
