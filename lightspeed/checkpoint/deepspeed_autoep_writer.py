"""Writing a training state of a Hugging Face MoE model trained with AutoEP in the layout DeepSpeed
0.19.8's engine saves AutoEP training in (ZeRO 0-2), so its engine, with `expert_parallel` at the
same autoep_size, resumes it.

Owns `AutoEPBlock` (what the writer must know of a block: its module path, experts, router and shared
expert's names, and the child DeepSpeed aliases its router under) and `write_autoep`: the layout of
deepspeed_autoep.py's Note, from a source under the model's names (whole fused [E, ...] experts):
the model file (the dense entries renamed as DeepSpeed's blocks hold them, its router alias beside
them, `num_experts` per block, `ds_autoep_layers` and `universal_checkpoint_info` as DeepSpeed's save
fills them for ep rank 0), `layer_<L>_expert_<G>` files (`w1` = the gate rows of `gate_up_proj[G]`,
`w3` its up rows, `w2` = `down_proj[G]`), and the optimizer state in DeepSpeed's MoE param groups
(deepspeed_moe_writer.py's Note; the experts' group holds each ep rank's w1, w2, w3 of every block,
[E/ep, ...] under their local names). Must not: write AutoEP at ZeRO 3, experts with biases or
transposed weights (no DeepSpeed 0.19.8 preset has them), or experts sliced over tp.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from lightspeed.checkpoint.deepspeed_moe import expert_group_ranks
from lightspeed.checkpoint.deepspeed_moe_writer import _MAX_GROUP_SIZE, _Group, _write_stage0_optimizers
from lightspeed.checkpoint.deepspeed_writer import _Plan, _save, _write_stage12
from lightspeed.checkpoint.errors import CheckpointError
from lightspeed.checkpoint.source import MASTER_KEY, TrainingStateSource

__all__ = ["AutoEPBlock", "deepspeed_router_alias", "write_autoep"]


@dataclass(frozen=True)
class AutoEPBlock:
    """One MoE block as the model names it: `path` the block module's name, `router` its router child,
    `router_alias` the child DeepSpeed's layer also registers its router under ("" none:
    `deepspeed_router_alias`), the shared expert and its gate ("" none), the experts child and its fused
    gate|up and down parameters."""

    path: str
    num_experts: int
    router: str = "gate"
    router_alias: str = "gate"
    shared_experts: str = ""
    shared_experts_gate: str = ""
    experts: str = "experts"
    gate_up: str = "gate_up_proj"
    down: str = "down_proj"
    preset: str = ""


# DeepSpeed 0.19.8's presets whose adapter records the router logits on the router (transformers' model-level
# OutputRecorder retargeted to it); the others keep what the model's classes declare
_ROUTER_RECORDED = ("mixtral", "qwen3_moe", "qwen3_5_moe")


def deepspeed_router_alias(preset: str, block: torch.nn.Module, router: torch.nn.Module, router_name: str) -> str:
    """The child name DeepSpeed 0.19.8's AutoEP layer also registers its router under (so the block's state
    dict holds it twice), "" for none: when the router logits are recorded on the router (the presets of
    `_ROUTER_RECORDED`, or a router class declaring transformers' `_can_record_outputs` in a block that
    does not), the recorder's `layer_name`, else the router's own name."""
    record = getattr(type(router), "_can_record_outputs", None)
    target = "router" if hasattr(type(router), "_can_record_outputs") else "none"
    if preset not in _ROUTER_RECORDED and getattr(block, "_can_record_outputs", None):
        target = "moe_block"
    if preset in _ROUTER_RECORDED:
        target = "router"
    layer_name = None
    if isinstance(record, dict):
        for value in record.values():
            if isinstance(value, dict):
                layer_name = value.get("layer_name")
    alias = layer_name or router_name
    if target != "router" or alias in ("router", "experts", "shared_experts") or "." in alias:
        return ""
    return alias


class _DeepSpeedView:
    """`source` under DeepSpeed's AutoEP names: a dense name as the replaced block holds it, an expert
    parameter as `<P>.experts.w<k>@<ep rank>` (that rank's [E/ep, ...] rows)."""

    def __init__(self, source: TrainingStateSource, blocks: list[AutoEPBlock], ep: int):
        self.source, self.blocks, self.ep = source, blocks, ep
        self.experts: dict[str, tuple[AutoEPBlock, str, int]] = {}  # view name -> (block, w<k>, ep rank)
        for b in blocks:
            for e in range(ep):
                for w in ("w1", "w2", "w3"):
                    self.experts[f"{b.path}.experts.{w}@{e}"] = (b, w, e)
        self.model_name: dict[str, str] = {}  # dense view name -> the model's

    def fused(self, b: AutoEPBlock) -> tuple[str, str]:
        return f"{b.path}.{b.experts}.{b.gate_up}", f"{b.path}.{b.experts}.{b.down}"

    def rename(self, name: str) -> str:
        """A dense entry's name in DeepSpeed's model."""
        for b in self.blocks:
            for child, theirs in ((b.shared_experts_gate, "shared_experts_gate"), (b.shared_experts, "shared_experts")):
                if child and name.startswith(f"{b.path}.{child}."):
                    out = f"{b.path}.{theirs}.{name[len(b.path) + len(child) + 2:]}"
                    break
            else:
                if name.startswith(f"{b.path}.{b.router}."):
                    rest = name[len(b.path) + len(b.router) + 2:]
                    out = f"{b.path}.router.{'gate.' if rest in ('weight', 'bias') else ''}{rest}"
                else:
                    continue
            self.model_name[out] = name
            return out
        self.model_name[name] = name
        return name

    def alias(self, ds_name: str) -> str | None:
        """The router alias entry of a renamed router entry."""
        for b in self.blocks:
            if b.router_alias and ds_name.startswith(f"{b.path}.router."):
                return f"{b.path}.{b.router_alias}.{ds_name[len(b.path) + len('.router.'):]}"
        return None

    def param_shape(self, name: str) -> torch.Size:
        if name not in self.experts:
            return self.source.param_shape(self.model_name[name])
        b, w, _ = self.experts[name]
        gate_up, down = (self.source.param_shape(n) for n in self.fused(b))
        local = b.num_experts // self.ep
        return torch.Size((local, gate_up[1] // 2, gate_up[2]) if w != "w2" else (local, *down[1:]))

    def read(self, name: str, key: str = MASTER_KEY) -> torch.Tensor:
        if name not in self.experts:
            return self.source.read(self.model_name[name], key)
        b, w, e = self.experts[name]
        local = b.num_experts // self.ep
        if w == "w2":
            return self.source.read(self.fused(b)[1], key)[e * local:(e + 1) * local].clone()
        gate_up = self.source.read(self.fused(b)[0], key)[e * local:(e + 1) * local]
        half = gate_up.shape[1] // 2
        return (gate_up[:, :half] if w == "w1" else gate_up[:, half:]).clone()


def _placement(num_experts: int, local: int, ep: int) -> dict:
    return {"version": 1, "num_experts": num_experts, "ep_size": ep,
            "ranks": [{"rank": r, "experts": list(range(r * local, (r + 1) * local))} for r in range(ep)]}


def _affine_map(shard: tuple[int, ...], num_experts: int, ep: int) -> dict:
    strides = [1] * len(shard)
    for d in range(len(shard) - 2, -1, -1):
        strides[d] = strides[d + 1] * shard[d + 1]
    numel = strides[0] * shard[0]
    return {"logical_shape": [num_experts, *shard[1:]],
            "ranks": {r: {"shard_shape": list(shard),
                          "pieces": [{"dest": [0, list(strides)], "locations": [r], "shape": list(shard),
                                      "source": [r * numel, list(strides)]}]} for r in range(ep)}}


def _layer_entries(view: _DeepSpeedView, world: int) -> list[dict]:
    """`ds_autoep_layers` as DeepSpeed's rank 0 records it."""
    out = []
    for layer, b in enumerate(view.blocks):
        local, prefix = b.num_experts // view.ep, f"{b.path}.experts"
        maps = {f"{prefix}.{w}": _affine_map(tuple(view.param_shape(f"{prefix}.{w}@0")), b.num_experts, view.ep)
                for w in ("w1", "w2", "w3")}
        out.append({"moe_layer_id": layer, "module_path": b.path, "num_experts": b.num_experts,
                    "num_local_experts": local, "ep_size": view.ep,
                    "expert_placement": _placement(b.num_experts, local, view.ep),
                    "affine_maps": {"version": 1, "params": maps}, "expert_key_prefix": prefix,
                    "checkpoint_format": "per_expert_files", "checkpoint_format_version": None,
                    "ep_group_name": f"ep_size_{view.ep}", "ep_rank": 0, "expert_data_parallel_rank": 0,
                    "expert_data_parallel_world_size": world // view.ep, "global_expert_start": 0,
                    "global_expert_end": local})
    return out


def write_autoep(source: TrainingStateSource, plan: _Plan, tag_dir: str, ds_config: Any, ep: int,
                 blocks: list[AutoEPBlock], where: str) -> None:
    """Write DeepSpeed's AutoEP layout (the module docstring) at ZeRO stage 0, 1 or 2 for autoep_size `ep`."""
    if ep < 1 or plan.world % ep:
        raise CheckpointError(f"{where}: autoep_size {ep} does not divide the {plan.world} ranks")
    if plan.stage not in (0, 1, 2):
        raise CheckpointError(f"{where}: AutoEP at ZeRO stage {plan.stage}: DeepSpeed's AutoEP layout is written at "
                              "stages 0-2 (its ZeRO-3 layout partitions the experts' state; not written)")
    view = _DeepSpeedView(source, blocks, ep)
    fused = {n for b in blocks for n in view.fused(b)}
    for b in blocks:
        if b.num_experts % ep:
            raise CheckpointError(f"{where}: autoep_size {ep} does not divide the {b.num_experts} experts of {b.path}")
        extra = [n for n in plan.module if n.startswith(f"{b.path}.{b.experts}.") and n not in fused]
        if extra:
            raise CheckpointError(f"{where}: the experts of {b.path} hold {extra[:2]}: DeepSpeed's AutoEP layout "
                                  "holds fused gate|up and down weights only")
    trainable = set(plan.trainable)
    if any(n in fused and n not in trainable for n in plan.module):
        raise CheckpointError(f"{where}: frozen AutoEP experts are not written in DeepSpeed's layout")
    groups: list[_Group] = []
    moe: list[_Group] = []
    for names, hyper, scalars in plan.groups:
        dense = [view.rename(n) for n in names if n not in fused]
        if dense:
            # DeepSpeed names the dense group of a plain parameter list "dense-params"
            groups.append(_Group({"name": "dense-params", **{k: v for k, v in hyper.items() if k != "moe"}}, scalars,
                                 [dense] * ep))
        held = [b for b in blocks if any(n in names for n in view.fused(b))]
        if any(not all(n in names for n in view.fused(b)) for b in held):
            raise CheckpointError(f"{where}: a block's gate_up_proj and down_proj are in different param groups; "
                                  "DeepSpeed's AutoEP keeps them in one")
        chunks: list[list[list[str]]] = [[] for _ in range(ep)]
        for e in range(ep):
            size = 0
            for n in (f"{b.path}.experts.{w}@{e}" for b in held for w in ("w1", "w2", "w3")):
                numel = view.param_shape(n).numel()
                if chunks[e] and size + numel <= _MAX_GROUP_SIZE:
                    chunks[e][-1].append(n)
                    size += numel
                else:
                    chunks[e].append([n])
                    size = numel
        for k in range(len(chunks[0])):
            moe.append(_Group({**hyper, "name": f"ep_size_{ep}", "moe": True}, scalars, [c[k] for c in chunks]))
    groups += moe
    for n in plan.module:  # names every dense entry (buffers too) for the view
        if n not in fused:
            view.rename(n)
    module: OrderedDict[str, torch.Tensor] = OrderedDict()
    for n, tensor in plan.module.items():
        if n in fused:
            continue
        ds = view.rename(n)
        module[ds] = source.read(n).to(plan.dtype) if n in trainable else tensor
        alias = view.alias(ds)
        if alias is not None:
            module[alias] = module[ds].clone()
    plan.buffers = [view.rename(n) for n in plan.buffers]
    for layer, b in enumerate(blocks):
        gate_up, down = (source.read(n).to(plan.dtype) for n in view.fused(b))
        half = gate_up.shape[1] // 2
        for g in range(b.num_experts):
            prefix = f"{b.path}.experts"
            entries = {f"{prefix}.w1.{g}": gate_up[g, :half].clone(), f"{prefix}.w2.{g}": down[g].clone(),
                       f"{prefix}.w3.{g}": gate_up[g, half:].clone()}
            _save(entries, os.path.join(tag_dir, f"layer_{layer}_expert_{g}_mp_rank_{plan.mp_rank:02d}_model_states.pt"))
    layers = _layer_entries(view, plan.world)
    model_extra = {"num_experts": [b.num_experts for b in blocks], "ds_autoep_layers": layers,
                   "universal_checkpoint_info": {"universal_checkpoint_version": 0.4,
                                                 "expert_parameter_patterns": [r".*\.experts\.w[123]$"],
                                                 "ds_autoep_layers": layers}}
    clash = sorted(set(plan.extra.get("client_state") or {}) & set(model_extra))
    if clash:
        raise CheckpointError(f"client_state keys {clash} are DeepSpeed's own AutoEP model-file entries")
    if ds_config is None and blocks[0].preset:
        ds_config = {"expert_parallel": {"enabled": True, "autoep_size": ep, "preset_model": blocks[0].preset}}
    if plan.stage == 0:
        _write_stage0_optimizers(view, plan, tag_dir, ds_config, ep, groups, module, model_extra)
        return
    edp = expert_group_ranks(plan.world, plan.world // ep)
    zero_groups = []
    for group in groups:
        if group.hyper.get("moe"):
            splits = [(edp[e], group.names[e], [n.rsplit("@", 1)[0] for n in group.names[e]]) for e in range(ep)]
        else:
            splits = [(list(range(plan.world)), group.names[0], group.names[0])]
        zero_groups.append((group.hyper, group.scalars, splits))
    _write_stage12(view, plan, tag_dir, ds_config, groups=zero_groups, module=module, model_extra=model_extra)
