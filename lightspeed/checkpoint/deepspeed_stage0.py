"""DeepSpeed's stage-0 (no ZeRO) checkpoints: which saved tensor is which parameter's master and state.

Owns the reading of the model file's ``optimizer`` entry when DeepSpeed ran without ZeRO: a plain torch
optimizer's state dict (fp32 training: the masters are the module's own parameters), the unfused
fp16/bf16 optimizer's (``fp32_groups``: one fp32 tensor per parameter) or the fused one's
(``fp32_groups_flat``: one flat fp32 tensor per param group). Must not: open files (deepspeed_format.py
hands it the loaded model file) or guess silently.

Note: [naming the optimizer's parameters]
    A stage-0 checkpoint records the optimizer's parameters by position only. They are the module's
    parameters (tied ones once) in the order the optimizer was given them, less those it was not given
    (frozen ones, usually). When the optimizer holds them all, position i is the i-th parameter. When it
    holds fewer, every order-preserving choice whose shapes fit the saved tensors is counted; exactly one
    is taken, and several (e.g. a frozen vector shaped like a trainable bias) is an error asking for
    ``param_names``: the names in the optimizer's order, which the caller knows from its model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from lightspeed.checkpoint.errors import CheckpointError

__all__ = ["Stage0Layout", "stage0_layout"]

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
