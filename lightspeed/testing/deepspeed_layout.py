"""Synthetic checkpoints in DeepSpeed's ZeRO layout, written without DeepSpeed (tests and benchmarks).

Owns a writer of the files DeepSpeed's engine saves at ZeRO stages 1/2 and 3 (see
checkpoint/deepspeed_format.py's Note for the layout), with plain data where DeepSpeed pickles its own
classes (the stage is an int, the loss scaler a dict), so both lightspeed's reader and DeepSpeed's
zero_to_fp32 read them. Used to test conversion on models DeepSpeed is not installed to train (e.g. a
transformers model for ``from_pretrained``) and to benchmark conversion at sizes no fixture has. The
real files DeepSpeed wrote are under tests/fixtures/deepspeed/; the tests check this writer against them.
Must not: be used to write training checkpoints (the engine's own format is lightspeed's).
"""

from __future__ import annotations

import math
import os
from collections import OrderedDict
from typing import Callable

import torch

__all__ = ["write_zero_checkpoint"]

_VERSION = "0.19.8"


def _save(obj, path: str) -> None:
    torch.save(obj, path)


def write_zero_checkpoint(save_dir: str, *, stage: int, world_size: int, shapes: "OrderedDict[str, torch.Size]",
                          masters: dict[str, torch.Tensor] | None = None, module_state: dict | None = None,
                          buffer_names: list[str] | None = None, frozen: dict[str, torch.Tensor] | None = None,
                          shared: dict[str, str] | None = None, tag: str = "global_step1",
                          seed: int = 0, sub_group_numel: int | None = None,
                          lowp_dtype: torch.dtype = torch.float32,
                          partition_filler: Callable[[int, int], torch.Tensor] | None = None) -> str:
    """Write one tag of a ZeRO checkpoint (one param group) under `save_dir`, and ``latest``; returns the
    tag directory. `masters`: the fp32 values of the trainable `shapes` (None: each rank's partition is
    random, from `partition_filler(rank, numel)` or a seeded normal). exp_avg is 0.1 x master and
    exp_avg_sq master^2, so readers can be checked. `module_state`: what the model file's ``module``
    holds (default: the masters in `lowp_dtype`, placeholders at stage 3, plus frozen and buffers)."""
    if stage not in (1, 2, 3):
        raise ValueError(f"stage must be 1, 2 or 3 (got {stage})")
    tag_dir = os.path.join(save_dir, tag)
    os.makedirs(tag_dir, exist_ok=True)
    frozen, shared, buffer_names = frozen or {}, shared or {}, buffer_names or []
    gen = torch.Generator().manual_seed(seed)

    def fill(rank: int, numel: int) -> torch.Tensor:
        if partition_filler is not None:
            return partition_filler(rank, numel)
        return torch.randn(numel, generator=gen)

    if stage == 3:
        groups = _sub_groups(shapes, sub_group_numel)
        per_rank = [[] for _ in range(world_size)]
        for group in groups:
            for r in range(world_size):
                parts = []
                for name in group:
                    numel = shapes[name].numel()
                    part = math.ceil(numel / world_size)
                    if masters is None:
                        parts.append(fill(r, part))
                    else:
                        padded = torch.zeros(part * world_size)
                        padded[:numel] = masters[name].reshape(-1).float()
                        parts.append(padded[r * part:(r + 1) * part])
                per_rank[r].append(torch.cat(parts) if parts else torch.zeros(0))
        param_shapes = [OrderedDict((n, shapes[n]) for n in group) for group in groups]
    else:
        total = sum(s.numel() for s in shapes.values())
        align = 2 * world_size
        padded_total = math.ceil(total / align) * align
        part = padded_total // world_size
        flat = None
        if masters is not None:
            flat = torch.cat([masters[n].reshape(-1).float() for n in shapes] + [torch.zeros(padded_total - total)])
        per_rank = []
        for r in range(world_size):
            lean = max(0, min(part, total - r * part))  # stages 1/2 save their partition without padding
            values = flat[r * part:r * part + lean].clone() if flat is not None else fill(r, lean)
            per_rank.append([values])
        param_shapes = [OrderedDict(shapes)]

    for r in range(world_size):
        masters_r = per_rank[r]
        states = {i: {"step": torch.tensor(1.0), "exp_avg": 0.1 * m, "exp_avg_sq": m * m}
                  for i, m in enumerate(masters_r)}
        hyper = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False}
        if stage == 3:
            osd = {"zero_stage": 3, "loss_scaler": {"cur_scale": 1.0, "dynamic": False},
                   "dynamic_loss_scale": False, "overflow": False, "partition_count": world_size,
                   "optimizer_state_dict": {"state": states, "param_groups": [dict(hyper, params=list(range(len(masters_r))))]},
                   "fp32_flat_groups": masters_r}
        else:
            osd = {"loss_scaler": {"cur_scale": 1.0, "dynamic": False}, "dynamic_loss_scale": False,
                   "overflow": False, "clip_grad": 1.0,
                   "base_optimizer_state": {"state": states, "param_groups": [dict(hyper, params=[0])]},
                   "single_partition_of_fp32_groups": masters_r, "zero_stage": stage,
                   "group_paddings": [part - masters_r[0].numel()], "partition_count": [world_size],
                   "ds_version": _VERSION}
        _save({"optimizer_state_dict": osd, "ds_config": {}, "ds_version": _VERSION},
              os.path.join(tag_dir, f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"))

    if module_state is None:
        module_state = {}
        for name, shape in shapes.items():
            if stage == 3:
                module_state[name] = torch.empty(0, dtype=lowp_dtype)
            elif masters is not None:
                module_state[name] = masters[name].to(lowp_dtype)
            else:
                module_state[name] = torch.zeros(shape, dtype=lowp_dtype)
        module_state.update({n: (torch.empty(0, dtype=t.dtype) if stage == 3 else t) for n, t in frozen.items()})
    model_files = ([f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(world_size)] if stage == 3
                   else ["mp_rank_00_model_states.pt"])
    for r, fname in enumerate(model_files):
        if stage == 3:
            fragments = {}
            for n, t in frozen.items():
                part = math.ceil(t.numel() / world_size)
                padded = torch.zeros(part * world_size, dtype=t.dtype)
                padded[:t.numel()] = t.reshape(-1)
                fragments[n] = padded[r * part:(r + 1) * part].clone()
        else:
            fragments = dict(frozen)
        _save({"module": module_state, "buffer_names": list(buffer_names), "optimizer": None,
               "param_shapes": param_shapes, "frozen_param_shapes": OrderedDict((n, t.shape) for n, t in frozen.items()),
               "shared_params": dict(shared), "frozen_param_fragments": fragments, "lr_scheduler": None,
               "data_sampler": None, "random_ltd": None, "skipped_steps": 0,
               "global_steps": 1, "global_samples": world_size, "dp_world_size": world_size, "mp_world_size": 1,
               "ds_config": {}, "ds_version": _VERSION}, os.path.join(tag_dir, fname))
    with open(os.path.join(save_dir, "latest"), "w") as f:
        f.write(tag)
    return tag_dir


def _sub_groups(shapes: "OrderedDict[str, torch.Size]", sub_group_numel: int | None) -> list[list[str]]:
    groups: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        if sub_group_numel is not None and groups[-1] and size + shape.numel() > sub_group_numel:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += shape.numel()
    return groups
