"""Boxes of `zero.Init`-partitioned parameters, delivered to the ranks that keep them: how AutoEP
(parallel/experts/autoep.py) gives each rank its experts of a model built under `zero.Init` (a
Hugging Face `from_pretrained` at ZeRO-3), its ep rank's rows and, with the experts sliced over tp,
its tp rank's units of them, without any rank gathering a whole experts tensor.

Owns: `replace_init_module`: this rank's boxes of some parameters of a module (rows [f, f + n) along
dim 0, and along one other dim one or more ranges, joined), read from the module's Init groups (which
are then discarded), made into a new module by the caller, whose parameters are partitioned again.
Must not: decide which boxes a rank keeps (the caller says), or touch a stage-3 strategy's groups (only
zero.Init's, before `initialize()` takes them over).

Note: [the exchange] Under Init a module's parameters of one (requires_grad, dtype) lie end to end in
one flat buffer padded to a multiple of the group's world W; rank r keeps elements [r S, (r+1) S), a
contiguous flat range of each parameter it meets. A wanted set is a list of boxes of one parameter
(each a [start, stop) per dim) that differ along one dim only, in increasing order there, taken
joined along that dim (rows of experts: one box; a tp rank's gate and up units of a fused gate|up:
two); since the joined tensor's C order is the parameter's flat order restricted to the set, a rank's
share of it is the wanted elements of each flat range, in order. A flat range [lo, hi) splits into at
most 2 ndim - 1 boxes that are each contiguous (`_flat_boxes`); a wanted box cut by one of them is a
narrowed view of the shard, so neither side walks elements or builds an index. Every rank of the group
publishes its boxes; rank r sends rank w the wanted elements of w's boxes held in r's shard (parameter
order), and receives from every rank, in rank order, those of its own, placing each part at the count
of its wanted elements before that part's flat start: one all-to-all with per-rank sizes per group. A
rank so receives exactly its boxes (1/ep of an [E, ...] parameter's rows, of which 1/tp of the units
when sliced over tp) and sends only what it holds; nothing is gathered whole. Every rank of the group
must call it for the same module, parameters in the same order (each with its own boxes); ranks
wanting the same boxes (expert-data-parallel replicas) each receive them.

Note: [what is kept] The boxes taken, the module's Init groups are discarded (its parameters become
empty placeholders). `replace_init_module` builds the replacement from them and partitions its
parameters again as zero.Init would (Init groups in the source's dtype, device and offload), over the
ranks that hold the same boxes (AutoEP: the expert-data-parallel group, without tp when the experts
are sliced over it), so the boxes of only one module are whole on a rank at a time; `initialize()`'s
stage-3 strategy then takes these groups over, one unit at a time, as every other Init group.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn

from lightspeed.comm.collectives import Communicator
from lightspeed.comm.differentiable import ragged_all_to_all
from lightspeed.zero.partition import Range, shard_range
from lightspeed.zero.stage3.init import store_init_groups, take_init_groups
from lightspeed.zero.stage3.param_group import ParamGroup, ParamState, param_state

Box = tuple[tuple[int, int], ...]  # [start, stop) along each dim of a parameter


def _flat_boxes(shape: Sequence[int], lo: int, hi: int) -> list[tuple[int, Box]]:
    """Flat elements [lo, hi) of a C-contiguous `shape` as (flat start, box) pieces, each contiguous, in
    flat order (the Note on the exchange)."""
    if lo >= hi:
        return []
    if len(shape) == 1:
        return [(lo, ((lo, hi),))]
    inner = math.prod(shape[1:])
    full = tuple((0, n) for n in shape[1:])
    first, last = lo // inner, hi // inner  # the rows lo and hi fall in

    def within(row: int, a: int, b: int) -> list[tuple[int, Box]]:  # elements [a, b) of one row
        return [(row * inner + s, ((row, row + 1),) + box) for s, box in _flat_boxes(shape[1:], a, b)]

    if first == last:
        return within(first, lo % inner, hi % inner)
    out = []
    if lo % inner:
        out += within(first, lo % inner, inner)
        first += 1
    if last > first:
        out.append((first * inner, ((first, last),) + full))
    if hi % inner:
        out += within(last, 0, hi % inner)
    return out


def _cut(piece: Box, box: Box) -> Box | None:
    """`box` within `piece`, relative to the piece's start (None when they do not meet)."""
    out = []
    for (a, b), (c, d) in zip(piece, box):
        start, stop = max(a, c), min(b, d)
        if start >= stop:
            return None
        out.append((start - a, stop - start))
    return tuple(out)


def _numel(shape: Sequence[int], boxes: Sequence[Box], lo: int, hi: int) -> int:
    """How many elements of `boxes` lie in flat [lo, hi)."""
    return sum(math.prod(n for _, n in cut) for _, piece in _flat_boxes(shape, lo, hi) for box in boxes
               if (cut := _cut(piece, box)) is not None)


def _elements(flat: torch.Tensor, lo: int, shape: Sequence[int], boxes: Sequence[Box], dim: int) -> torch.Tensor:
    """The elements of `boxes` (joined along `dim`) held by `flat` (flat [lo, lo + len) of `shape`), in
    flat order."""
    out = []
    for start, piece in _flat_boxes(shape, lo, lo + flat.numel()):
        view = flat[start - lo:start - lo + math.prod(b - a for a, b in piece)].view([b - a for a, b in piece])
        cuts = [cut for box in boxes if (cut := _cut(piece, box)) is not None]
        parts = []
        for cut in cuts:
            part = view
            for d, (a, n) in enumerate(cut):
                part = part.narrow(d, a, n)
            parts.append(part)
        if parts:
            out.append(torch.cat(parts, dim=dim).reshape(-1))
    return torch.cat(out) if out else flat.new_empty(0)


def _joined(shape: Sequence[int], boxes: Sequence[Box], what: str) -> tuple[int, tuple[int, ...]]:
    """(the dim `boxes` join along, the joined shape); raises unless they are boxes of `shape` that
    differ along one dim only, increasing and disjoint there."""
    if not boxes or any(len(b) != len(shape) or any(not 0 <= a < z <= n for (a, z), n in zip(b, shape))
                        for b in boxes):
        raise ValueError(f"{what}: boxes {list(boxes)} are not non-empty boxes of {tuple(shape)}")
    differ = {d for b in boxes[1:] for d in range(len(shape)) if b[d] != boxes[0][d]}
    dim = differ.pop() if len(differ) == 1 else 0
    if differ or any(b[dim][0] < a[dim][1] for a, b in zip(boxes, boxes[1:])):
        raise ValueError(f"{what}: boxes {list(boxes)} do not differ along one dim only, increasing and disjoint")
    sizes = [z - a for a, z in boxes[0]]
    sizes[dim] = sum(b[dim][1] - b[dim][0] for b in boxes)
    return dim, tuple(sizes)


def _exchange(g: ParamGroup, items: list[tuple[str, ParamState, tuple[Box, ...]]]) -> dict[str, torch.Tensor]:
    """This rank's boxes of `items` (the Note on the exchange), on the group's device in its dtype."""
    comm = g.comm
    mine_wanted = [boxes for _, _, boxes in items]
    wants = comm.all_gather_object(mine_wanted) if comm.world_size > 1 else [mine_wanted]
    shards = [shard_range(g.layout.padded_numel, comm.world_size, w) for w in range(comm.world_size)]
    mine = shards[comm.rank]
    g.lp_in()
    shard = g.lp_shard.to(g.device)  # a host shard (remote_device "cpu") goes through the device
    joined = {name: _joined(st.shape, boxes, f"{name}") for name, st, boxes in items}

    def held(st: ParamState, sh: Range) -> tuple[int, int]:  # the parameter's flat elements in a shard
        part = st.range.intersect(sh)
        return (part.start - st.range.start, part.end - st.range.start) if part.numel else (0, 0)

    pieces, send_sizes = [], []
    for theirs in wants:
        size = 0
        for (name, st, _), boxes in zip(items, theirs):
            lo, hi = held(st, mine)
            if hi > lo:
                dim = _joined(st.shape, boxes, name)[0]
                part = _elements(shard[st.range.start + lo - mine.start:st.range.start + hi - mine.start], lo,
                                 st.shape, boxes, dim)
                pieces.append(part)
                size += part.numel()
        send_sizes.append(size)
    # per source rank, per item: (where its part lands in this rank's boxes, its size)
    recv_plan = [[(_numel(st.shape, boxes, 0, lo), _numel(st.shape, boxes, lo, hi))
                  for name, st, boxes in items for lo, hi in [held(st, sh)]] for sh in shards]
    recv_sizes = [sum(n for _, n in parts) for parts in recv_plan]
    send = torch.cat(pieces) if pieces else shard.new_empty(0)
    if comm.world_size == 1:
        recv = send
    else:
        with torch.no_grad():
            recv = ragged_all_to_all(send, comm.group, send_sizes, recv_sizes)
    out = {name: recv.new_empty(math.prod(joined[name][1])) for name, _, _ in items}
    offset = 0
    for parts in recv_plan:
        for (name, _, _), (at, n) in zip(items, parts):
            out[name][at:at + n] = recv[offset:offset + n]
            offset += n
    return {name: out[name].view(joined[name][1]) for name, _, _ in items}


def replace_init_module(module: nn.Module, wanted: Mapping[str, Sequence[Box]],
                        build: Callable[[dict[str, torch.Tensor]], nn.Module], keep: Communicator) -> nn.Module:
    """`build(boxes)` of this rank's `wanted` boxes (parameter name -> its boxes, joined along the one
    dim where they differ) of `module`'s Init-partitioned parameters, with the new module's parameters
    partitioned again by zero.Init over `keep` (the ranks that took the same boxes), as the source's
    were (the Note on what is kept). Collective over the source's Init groups."""
    taken, like = _take(module, wanted)
    built = build(taken)
    del taken
    # each parameter keeps its boxes' dtype (its source group's), on the source's device and offload
    store_init_groups(built, list(built.named_parameters(recurse=False)), keep, like.device, None, like.offload)
    return built


def _take(module: nn.Module, wanted: Mapping[str, Sequence[Box]]) -> tuple[dict[str, torch.Tensor], ParamGroup]:
    groups = take_init_groups(module)
    by_group: dict[int, tuple[ParamGroup, list[tuple[str, ParamState, tuple[Box, ...]]]]] = {}
    for name, boxes in wanted.items():
        p = getattr(module, name)
        st = param_state(p)
        if st is None or not any(st.group is g for g in groups):
            raise ValueError(f"{type(module).__name__}.{name} is not a parameter partitioned by zero.Init on "
                             "this module (built outside zero.Init, or already taken over by initialize())")
        boxes = tuple(tuple((int(a), int(b)) for a, b in box) for box in boxes)
        _joined(st.shape, boxes, f"{type(module).__name__}.{name}")
        by_group.setdefault(id(st.group), (st.group, []))[1].append((name, st, boxes))
    out: dict[str, torch.Tensor] = {}
    for g, items in by_group.values():
        out.update(_exchange(g, items))
    for g in groups:
        g.discard()
    return out, groups[0]


__all__ = ["Box", "replace_init_module"]
