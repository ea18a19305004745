"""DeepSpeed's stage-0 (no ZeRO) checkpoints: which saved tensor is which parameter's master and state.

Owns the reading of the model file's ``optimizer`` entry when DeepSpeed ran without ZeRO: a plain torch
optimizer's state dict (fp32 training: the masters are the module's own parameters), the unfused
fp16/bf16 optimizer's (``fp32_groups``: one fp32 tensor per parameter) or the fused one's
(``fp32_groups_flat``: one flat fp32 tensor per param group); and, with MoE experts, each expert-parallel
rank's optimizer (`moe_stage0_layout`). Must not: open files (deepspeed_format.py hands it the loaded
model file, expert entries and optimizer states) or guess silently.

Note: [naming the optimizer's parameters]
    A stage-0 checkpoint records the optimizer's parameters by position only. They are the module's
    parameters (tied ones once) in the order the optimizer was given them, less those it was not given
    (frozen ones, usually). When the optimizer holds them all, position i is the i-th parameter. When it
    holds fewer, every order-preserving choice whose shapes fit the saved tensors is counted; exactly one
    is taken, and several (e.g. a frozen vector shaped like a trainable bias) is an error asking for
    ``param_names``: the names in the optimizer's order, which the caller knows from its model.

Note: [MoE without ZeRO]
    DeepSpeed 0.19.8 saves MoE training without ZeRO as: the model file's ``module`` without the experts'
    entries (its ``optimizer``: ep rank 0's, which its loader ignores), one ``layer_<L>_expert_<G>`` file
    per expert (deepspeed_moe.py), and per expert-parallel rank e an ``expp_rank_<e>_mp_rank_00_optim_states.pt``
    holding ``{"optimizer": <that rank's optimizer state dict>}`` (written by its first expert-data-parallel
    rank; the loader of rank r reads its ep rank's). Each rank's optimizer holds the dense parameters
    (groups without ``moe``) and its own local experts (groups with ``moe`` True, DeepSpeed's
    ``split_params_into_different_moe_groups_for_optimizer``), each in the module's order; ep rank e's
    local expert i of a layer with N experts is global expert e x N / ep + i. The dense slots are named
    from ep rank 0's file (every rank holds the same values), each expert slot from its own rank's;
    a piece's rank is the ep rank. An expert group's names are every ep rank's, in ep-rank order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from lightspeed.checkpoint.deepspeed_moe import expert_id
from lightspeed.checkpoint.errors import CheckpointError

__all__ = ["Stage0Layout", "stage0_layout", "moe_stage0_layout"]

_MAX_MATCH_CELLS = 5_000_000
_SCALER_KEYS = ("dynamic_loss_scale", "cur_scale", "cur_iter", "last_overflow_iter", "scale_factor", "scale_window")


@dataclass
class Stage0Layout:
    params: dict[str, tuple[torch.Size, tuple[tuple[int, int, int, int], ...]]] = field(default_factory=dict)
    groups: list[dict] = field(default_factory=list)
    loss_scaler: dict | None = None
    master: Callable[[int, int], torch.Tensor] | None = None
    slot_states: Callable[[int, int], dict] | None = None
    state_keys: list[str] = field(default_factory=list)
    shared: dict[str, str] = field(default_factory=dict)  # tied alias -> the name kept
    frozen: list[str] = field(default_factory=list)  # module parameters the optimizer does not hold


def _module_params(model: dict) -> tuple[list[tuple[str, torch.Tensor]], dict[str, str]]:
    """The module's parameters in order, tied ones once (by shared storage), buffers left out; and the
    tied aliases (alias -> the name kept)."""
    buffers = set(model.get("buffer_names") or [])
    seen: dict[tuple, str] = {}
    out, aliases = [], {}
    for name, tensor in model["module"].items():
        if name in buffers or not isinstance(tensor, torch.Tensor):
            continue
        ident = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if tensor.numel() and ident in seen:
            aliases[name] = seen[ident]
            continue
        seen[ident] = name
        out.append((name, tensor))
    return out, aliases


def _count_matches(slots: list[torch.Size | None], cands: list[torch.Size]) -> list[list[int]]:
    """dp[i][j]: the number of ways (capped at 2) to give slots i.. to candidates j.. in order."""
    num_slots, num_cands = len(slots), len(cands)
    dp = [[0] * (num_cands + 1) for _ in range(num_slots + 1)]
    for j in range(num_cands + 1):
        dp[num_slots][j] = 1
    for i in range(num_slots - 1, -1, -1):
        for j in range(num_cands - 1, -1, -1):
            fits = slots[i] is None or slots[i] == cands[j]
            dp[i][j] = min(2, (dp[i + 1][j + 1] if fits else 0) + dp[i][j + 1])
    return dp


def _match(slots: list[torch.Size | None], params: list[tuple[str, torch.Tensor]], where: str) -> list[str]:
    cands = [t.shape for _, t in params]
    if len(slots) == len(cands):
        chosen = list(range(len(cands)))
    elif len(slots) > len(cands):
        raise CheckpointError(f"{where}: the optimizer holds {len(slots)} parameters but the module only "
                              f"{len(cands)}")
    elif len(slots) * len(cands) > _MAX_MATCH_CELLS:
        raise CheckpointError(f"{where}: the optimizer holds {len(slots)} of the module's {len(cands)} parameters; "
                              "pass param_names (the optimizer's parameter names, in order)")
    else:
        dp = _count_matches(slots, cands)
        if dp[0][0] != 1:
            how = "no" if dp[0][0] == 0 else "more than one"
            raise CheckpointError(f"{where}: {how} order-preserving choice of {len(slots)} of the module's "
                                  f"{len(cands)} parameters fits the optimizer's tensors; pass param_names "
                                  "(the optimizer's parameter names, in order)")
        chosen, j = [], 0
        for i, shape in enumerate(slots):
            while not ((shape is None or shape == cands[j]) and dp[i + 1][j + 1]):
                j += 1
            chosen.append(j)
            j += 1
    names = [params[j][0] for j in chosen]
    for name, shape, j in zip(names, slots, chosen):
        if shape is not None and shape != cands[j]:
            raise CheckpointError(f"{where}: optimizer tensor of shape {tuple(shape)} does not fit parameter "
                                  f"{name} {tuple(cands[j])}; pass param_names")
    return names


def _named(param_names: Sequence[str], params: list[tuple[str, torch.Tensor]], count: int, where: str) -> list[str]:
    known = dict(params)
    names = list(param_names)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise CheckpointError(f"{where}: param_names {unknown[:3]} are not parameters of the saved module")
    if len(names) != count:
        raise CheckpointError(f"{where}: {len(names)} param_names for the optimizer's {count} parameters")
    return names


def _scalars(state: dict) -> dict:
    out = {}
    for k, v in state.items():
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            continue
        v = v.item() if isinstance(v, torch.Tensor) else v
        out[k] = int(v) if isinstance(v, float) and v.is_integer() else v
    return out


def stage0_layout(model: dict, where: str, param_names: Sequence[str] | None) -> Stage0Layout:
    """Where each trainable parameter's fp32 master and optimizer state are in a stage-0 model file
    (`model`, loaded; `where` names it in errors). Pieces are (rank 0, slot, start, length)."""
    opt = model.get("optimizer")
    if not isinstance(opt, dict):
        raise CheckpointError(f"{where}: holds no optimizer state (saved without an optimizer?)")
    params, aliases = _module_params(model)
    module = dict(params)
    layout = Stage0Layout(shared=aliases)
    if "fp32_groups_flat" in opt or "fp32_groups" in opt:
        inner = opt.get("optimizer_state_dict")
        if not isinstance(inner, dict) or "param_groups" not in inner:
            raise CheckpointError(f"{where}: the fp16/bf16 optimizer's state has no optimizer_state_dict")
        layout.loss_scaler = {k: opt[k] for k in _SCALER_KEYS if k in opt}
    else:
        inner = opt
        if "param_groups" not in inner or "state" not in inner:
            raise CheckpointError(f"{where}: the 'optimizer' entry is neither a torch optimizer's state dict nor "
                                  "DeepSpeed's fp16/bf16 optimizer's")
    ids = [i for pg in inner["param_groups"] for i in pg["params"]]
    states = inner["state"]
    layout.slot_states = lambda rank, slot: states.get(ids[slot], {})

    if "fp32_groups_flat" in opt:  # fused: one flat per group, the group's parameters end to end
        flats = opt["fp32_groups_flat"]
        total = sum(int(f.numel()) for f in flats)
        if param_names is not None:
            names = list(param_names)
            _named(names, params, len(names), where)
        elif sum(t.numel() for _, t in params) == total:
            names = [n for n, _ in params]
        else:
            raise CheckpointError(f"{where}: the fused optimizer's flat groups hold {total} elements, not the "
                                  "module's parameter count; pass param_names (the optimizer's names, in order)")
        it = iter(names)
        groups_names = []
        for g, flat in enumerate(flats):
            offset, group = 0, []
            while offset < flat.numel():
                name = next(it, None)
                if name is None:
                    raise CheckpointError(f"{where}: param_names cover fewer elements than flat group {g}")
                shape = module[name].shape
                layout.params[name] = (shape, ((0, g, offset, shape.numel()),))
                offset += shape.numel()
                group.append(name)
            if offset != flat.numel():
                raise CheckpointError(f"{where}: parameters do not end at flat group {g}'s end ({offset} != "
                                      f"{flat.numel()}); pass the right param_names")
            groups_names.append(group)
        layout.master = lambda rank, slot: flats[slot]
    else:
        if "fp32_groups" in opt:  # unfused: one fp32 tensor per parameter
            masters = [t for group in opt["fp32_groups"] for t in group]
            if len(masters) != len(ids):
                raise CheckpointError(f"{where}: {len(masters)} fp32 tensors for {len(ids)} optimizer slots")
            slots: list[torch.Size | None] = [t.shape for t in masters]
        else:  # fp32: the module's parameters are the masters
            masters = None
            slots = []
            for i in ids:
                shaped = [v for v in states.get(i, {}).values() if isinstance(v, torch.Tensor) and v.dim() > 0]
                slots.append(shaped[0].shape if shaped else None)
        names = (_named(param_names, params, len(ids), where) if param_names is not None
                 else _match(slots, params, where))
        for s, name in enumerate(names):
            shape = module[name].shape
            layout.params[name] = (shape, ((0, s, 0, shape.numel()),))
        layout.master = ((lambda rank, slot: masters[slot]) if masters is not None
                         else (lambda rank, slot: module[names[slot]]))
        groups_names, s = [], 0
        for pg in inner["param_groups"]:
            groups_names.append(names[s:s + len(pg["params"])])
            s += len(pg["params"])
    for pg, names_in_group, first in zip(inner["param_groups"], groups_names,
                                         _first_slots(inner["param_groups"], "fp32_groups_flat" in opt)):
        hyper = {k: (list(v) if isinstance(v, tuple) else v) for k, v in pg.items() if k != "params"}
        layout.groups.append({**hyper, "names": list(names_in_group),
                              "scalars": _scalars(layout.slot_states(0, first)) if first is not None else {}})
    keys: list[str] = []
    for s in range(len(ids)):
        for k, v in layout.slot_states(0, s).items():
            if isinstance(v, torch.Tensor) and v.dim() > 0 and k not in keys:
                keys.append(k)
    layout.state_keys = keys
    layout.frozen = [n for n, _ in params if n not in layout.params]
    return layout


def _first_slots(param_groups: list[dict], fused: bool) -> list[int | None]:
    out, s = [], 0
    for g, pg in enumerate(param_groups):
        out.append((g if fused else s) if pg["params"] else None)
        s += len(pg["params"])
    return out


def _optimizer_parts(opt: Any, where: str) -> tuple[dict, list[torch.Tensor] | None, dict | None]:
    """(the torch optimizer's state dict, the unfused fp16/bf16 optimizer's fp32 masters or None, its loss
    scaler or None) of one ``optimizer`` entry."""
    if not isinstance(opt, dict):
        raise CheckpointError(f"{where}: holds no optimizer state (saved without an optimizer?)")
    if "fp32_groups_flat" in opt:
        raise CheckpointError(f"{where}: the fused fp16/bf16 optimizer's flat groups (fp32_groups_flat) with MoE "
                              "experts are not read; DeepSpeed uses the unfused optimizer with torch's Adam")
    if "fp32_groups" in opt:
        inner = opt.get("optimizer_state_dict")
        if not isinstance(inner, dict) or "param_groups" not in inner or "state" not in inner:
            raise CheckpointError(f"{where}: the fp16/bf16 optimizer's state has no optimizer_state_dict")
        return inner, [t for group in opt["fp32_groups"] for t in group], {k: opt[k] for k in _SCALER_KEYS
                                                                           if k in opt}
    if "param_groups" not in opt or "state" not in opt:
        raise CheckpointError(f"{where}: the 'optimizer' entry is neither a torch optimizer's state dict nor "
                              "DeepSpeed's fp16/bf16 optimizer's")
    return opt, None, None


def moe_stage0_layout(model: dict, experts: dict[str, torch.Tensor], optimizers: list[Any], files: list[str],
                      param_names: Sequence[str] | None) -> Stage0Layout:
    """Where each trainable parameter's fp32 master and optimizer state are in a DeepSpeed MoE checkpoint
    saved without ZeRO (the module Note): `model` the loaded model file, `experts` the expert files'
    entries (global names, by layer then expert), `optimizers[e]` ep rank e's ``optimizer`` entry, read
    from `files[e]`. Pieces are (ep rank, slot, 0, numel)."""
    ep = len(optimizers)
    where0 = files[0]
    buffers = set(model.get("buffer_names") or [])
    layers: dict[str, int] = {}
    for name in experts:
        prefix, g, _ = expert_id(name)
        layers[prefix] = max(layers.get(prefix, 0), g + 1)
    for prefix, count in layers.items():
        if count % ep:
            raise CheckpointError(f"{where0}: {count} experts in {prefix[:-1]} for {ep} expert-parallel ranks "
                                  "(expp_rank_<E> files)")
    cands: list[list[tuple[str, torch.Tensor]]] = [[] for _ in range(ep)]  # ep rank e's expert parameters
    for name, tensor in experts.items():
        prefix, g, rest = expert_id(name)
        local = layers[prefix] // ep
        if f"{prefix}{g % local}{rest}" not in buffers:  # buffer_names holds ep rank 0's local names
            cands[g // local].append((name, tensor))
    dense, aliases = _module_params(model)
    module = {**dict(dense), **experts}
    layout = Stage0Layout(shared=aliases)
    given = list(param_names) if param_names is not None else None
    states, masters, ids_of, names_of = [], [], [], []
    groups_of: list[list[list[str]]] = []
    for e, (opt, path) in enumerate(zip(optimizers, files)):
        inner, fp32, scaler = _optimizer_parts(opt, path)
        if e == 0:
            layout.loss_scaler = scaler
        ids = [i for pg in inner["param_groups"] for i in pg["params"]]
        if fp32 is not None and len(fp32) != len(ids):
            raise CheckpointError(f"{path}: {len(fp32)} fp32 tensors for {len(ids)} optimizer slots")
        slot_shapes: list[torch.Size | None] = []
        for s, i in enumerate(ids):
            if fp32 is not None:
                slot_shapes.append(fp32[s].shape)
            else:
                shaped = [v for v in inner["state"].get(i, {}).values() if isinstance(v, torch.Tensor) and v.dim() > 0]
                slot_shapes.append(shaped[0].shape if shaped else None)
        is_moe = [bool(pg.get("moe")) for pg in inner["param_groups"] for _ in pg["params"]]
        dense_slots = [s for s in range(len(ids)) if not is_moe[s]]
        expert_slots = [s for s in range(len(ids)) if is_moe[s]]
        flags = [(bool(pg.get("moe")), len(pg["params"]) if not pg.get("moe") else None)
                 for pg in inner["param_groups"]]
        if e == 0:
            first, first_flags = inner, flags
        elif flags != first_flags:
            raise CheckpointError(f"{path}: its param groups differ from {where0}'s")
        names: list[str | None] = [None] * len(ids)
        todo = [(dense_slots, dense)] if e == 0 else []
        todo.append((expert_slots, cands[e]))
        for slots, pool in todo:
            if given is not None:
                known = {n for n, _ in pool}
                chosen = _named([n for n in given if n in known], pool, len(slots), path)
            else:
                chosen = _match([slot_shapes[s] for s in slots], pool, path)
            for s, name in zip(slots, chosen):
                if slot_shapes[s] is not None and slot_shapes[s] != module[name].shape:
                    raise CheckpointError(f"{path}: optimizer tensor of shape {tuple(slot_shapes[s])} does not fit "
                                          f"parameter {name} {tuple(module[name].shape)}")
                names[s] = name
                layout.params[name] = (module[name].shape, ((e, s, 0, module[name].shape.numel()),))
        groups, s = [], 0
        for pg in inner["param_groups"]:
            groups.append([n for n in names[s:s + len(pg["params"])] if n is not None])
            s += len(pg["params"])
        states.append(inner["state"])
        masters.append(fp32)
        ids_of.append(ids)
        names_of.append(names)
        groups_of.append(groups)
    layout.slot_states = lambda rank, slot: states[rank].get(ids_of[rank][slot], {})
    layout.master = lambda rank, slot: (masters[rank][slot] if masters[rank] is not None
                                        else module[names_of[rank][slot]])
    s = 0
    for g, pg in enumerate(first["param_groups"]):
        hyper = {k: (list(v) if isinstance(v, tuple) else v) for k, v in pg.items() if k != "params"}
        names = [n for e in range(ep) for n in groups_of[e][g]] if pg.get("moe") else groups_of[0][g]
        layout.groups.append({**hyper, "names": names,
                              "scalars": _scalars(layout.slot_states(0, s)) if pg["params"] else {}})
        s += len(pg["params"])
    keys: list[str] = []
    for e in range(ep):
        for slot in range(len(ids_of[e])):
            for k, v in layout.slot_states(e, slot).items():
                if isinstance(v, torch.Tensor) and v.dim() > 0 and k not in keys:
                    keys.append(k)
    layout.state_keys = keys
    layout.frozen = [n for n, _ in dense + [c for cs in cands for c in cs] if n not in layout.params]
    return layout
