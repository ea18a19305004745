"""DeepSpeed's checkpoints of MoE training (`deepspeed.moe.layer.MoE` with ZeRO 0-2; DeepSpeed 0.19.8
refuses those layers at ZeRO 3), as its engine writes them: what deepspeed_format.py needs beyond a
dense checkpoint (without ZeRO the optimizer's layout is deepspeed_stage0.py's MoE Note).

Owns the expert files' names and the expert param groups' layout. DeepSpeed writes, beside the dense
files, one `layer_<L>_expert_<G>_mp_rank_00_model_states.pt` per MoE layer L and global expert G (that
expert's module entries under the global name `...deepspeed_experts.<G>.*`; `mp_rank_00_model_states.pt`
then holds only the dense entries). Its ZeRO optimizer puts the experts of an MoE param group (`moe`:
True, one per expert-parallel size) in a flat buffer of their own, partitioned over the
expert-data-parallel group only (`partition_count` W / ep, the dense groups' W): ep rank e's buffer is
its local experts (named locally, `...deepspeed_experts.<i>.*`, as `param_shapes` lists them for rank 0)
split over the ranks e, e + ep, e + 2 ep, ... (DeepSpeed's expert-data-parallel groups), local expert i
being global expert e x num_local + i. Must not: open files itself (deepspeed_format.py hands
`read_expert_entries` its loader; deepspeed_moe_writer.py writes).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Container, Mapping
from typing import Any

import torch

from lightspeed.checkpoint.errors import CheckpointError

EXPERT_FILE = re.compile(r"^layer_(\d+)_expert_(\d+)_mp_rank_00_model_states\.pt$")
_LOCAL = re.compile(r"^(.*\.deepspeed_experts\.)(\d+)(\..+)$")


def expert_files(names: list[str]) -> list[str]:
    """The per-expert model files among a tag directory's file names, by layer then expert."""
    found = [(int(m.group(1)), int(m.group(2)), n) for n in names if (m := EXPERT_FILE.match(n))]
    return [n for _, _, n in sorted(found)]


def expert_file_ids(name: str) -> tuple[int, int]:
    """(layer, global expert) of an expert file's name (one `expert_files` returned)."""
    m = EXPERT_FILE.match(name)
    if m is None:
        raise ValueError(f"{name}: not a DeepSpeed expert file name")
    return int(m.group(1)), int(m.group(2))


def expert_id(name: str) -> tuple[str, int, str] | None:
    """(prefix up to ``deepspeed_experts.``, expert index, the rest) of an expert entry's name; None when
    `name` is not a `MoE` layer's expert entry."""
    m = _LOCAL.match(name)
    return None if m is None else (m.group(1), int(m.group(2)), m.group(3))


def num_local_experts(names: list[str]) -> dict[str, int]:
    """{expert prefix: number of local experts} of the local expert names `names`."""
    out: dict[str, int] = {}
    for name in names:
        m = _LOCAL.match(name)
        if m:
            out[m.group(1)] = max(out.get(m.group(1), 0), int(m.group(2)) + 1)
    return out


def global_name(name: str, ep_rank: int, local: dict[str, int]) -> str | None:
    """The global name of ep rank `ep_rank`'s local expert entry `name`; None when `name` is not a `MoE`
    layer's expert (`...deepspeed_experts.<i>.*`)."""
    m = _LOCAL.match(name)
    if not m or m.group(1) not in local:
        return None
    return f"{m.group(1)}{ep_rank * local[m.group(1)] + int(m.group(2))}{m.group(3)}"


def expert_group_ranks(world: int, count: int) -> list[list[int]]:
    """For each ep rank, the data-parallel ranks its experts' buffer is split over, in order (DeepSpeed's
    expert-data-parallel group: ranks e, e + ep, ...); `count` the group's `partition_count`."""
    ep = world // count
    return [[e + k * ep for k in range(count)] for e in range(ep)]


def read_expert_entries(files: list[tuple[str, str]], load: Callable[[str], Any],
                        dense: Container[str]) -> dict[str, torch.Tensor]:
    """Every MoE expert's entries under their global names, by layer then expert: `files` the expert files
    as (name, path) in `expert_files` order, each opened by `load`; `dense` the model file's entries.
    A file must hold only entries of its own expert and layer (the L-th MoE layer met), none saved twice."""
    out: dict[str, torch.Tensor] = {}
    prefixes: list[str] = []
    for name, path in files:
        layer, expert = expert_file_ids(name)
        entries = load(path)
        if not isinstance(entries, Mapping) or not entries:
            raise CheckpointError(f"{path}: not a DeepSpeed expert model-states file (no entries)")
        for key, value in entries.items():
            found = expert_id(key)
            if found is None or found[1] != expert or not isinstance(value, torch.Tensor):
                raise CheckpointError(f"{path}: holds {key!r}, not an entry of expert {expert} "
                                      "(...deepspeed_experts.<G>.*): a mismatched expert file")
            if found[0] not in prefixes:
                prefixes.append(found[0])
            if prefixes.index(found[0]) != layer:
                raise CheckpointError(f"{path}: holds {key!r}, an entry of the MoE layer {found[0][:-1]}, which is "
                                      f"not layer {layer}: a mismatched expert file")
            if key in out or key in dense:
                raise CheckpointError(f"{path}: {key!r} is saved twice (also in another file)")
            out[key] = value
    return out
