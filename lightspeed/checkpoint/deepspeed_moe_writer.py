"""Writing a training state of DeepSpeed-style MoE layers (`...deepspeed_experts.<G>.*` entries) in the
layout DeepSpeed 0.19.8's engine saves MoE training in (ZeRO 0-2; it refuses its MoE layers at ZeRO 3),
so its engine resumes it at an expert-parallel size that divides the experts.

Owns `write_moe`: the model file without the experts' entries (plus DeepSpeed's ``num_experts``, one
count per MoE layer, and ``ds_autoep_layers`` None: its loader reads the expert files only when
``num_experts`` is a list), one ``layer_<L>_expert_<G>_mp_rank_00_model_states.pt`` per MoE layer L (in
module order) and global expert G holding that expert's entries under their global names (in the
training dtype), and the optimizer state: without ZeRO, per expert-parallel rank e
``expp_rank_<e>_mp_rank_00_optim_states.pt`` (``{"optimizer": ...}``, the state dict of e's optimizer:
the dense parameters and e's local experts; deepspeed_stage0.py's Note on MoE); at ZeRO 1-2
deepspeed_writer.py's rank files, an expert group's flat buffer being ep rank e's local experts (under
their local names) partitioned over its expert-data-parallel ranks e, e + ep, ... (deepspeed_moe.py).
Must not: write AutoEP's fused experts (deepspeed_autoep_writer.py does), or frozen experts at ZeRO (their
fragments are not written).

Note: [DeepSpeed's param groups]
    DeepSpeed's optimizer holds MoE training's parameters in its own groups, and its loader needs the
    saved ones to match them: the groups given (each with its experts taken out, empty ones dropped),
    then, per given group, one ``moe`` group of its experts (``name`` ``ep_size_<ep>``), cut where its
    parameters would pass DeepSpeed's ``max_group_size`` (178956971 elements), unless the groups given
    already are MoE groups (``moe`` in one of them: kept as they are, as DeepSpeed keeps them). Each
    rank's file holds, per group, its parameters in the module's order (a ``moe`` group: its own
    experts'); the model file's ``optimizer`` is ep rank 0's, as DeepSpeed writes it (its loader reads
    the ``expp_rank`` files instead).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from lightspeed.checkpoint.deepspeed_moe import expert_group_ranks, expert_id
from lightspeed.checkpoint.deepspeed_writer import (_Plan, _lowp_module, _model_file, _model_name, _param_state,
                                                    _save, _write_stage12)
from lightspeed.checkpoint.errors import CheckpointError
from lightspeed.checkpoint.source import TrainingStateSource

__all__ = ["has_moe_experts", "write_moe"]

_MAX_GROUP_SIZE = 178_956_971  # DeepSpeed's split_params_into_different_moe_groups_for_optimizer default


def has_moe_experts(module_names) -> bool:
    """Whether a module state's entry names include DeepSpeed-style MoE experts."""
    return any(expert_id(n) is not None for n in module_names)


@dataclass
class _Group:
    hyper: dict
    scalars: dict
    names: list[list[str]]  # per ep rank, in the module's order (a dense group: the same for every rank)


class _Experts:
    """The experts of a module state at expert-parallel size `ep`."""

    def __init__(self, module_names, ep: int, where: str):
        self.ep = ep
        self.of: dict[str, tuple[int, int]] = {}  # entry -> (layer, global expert)
        self.layers: list[str] = []
        self.counts: list[int] = []
        for name in module_names:
            found = expert_id(name)
            if found is None:
                continue
            prefix, g, _ = found
            if prefix not in self.layers:
                self.layers.append(prefix)
                self.counts.append(0)
            layer = self.layers.index(prefix)
            if g < self.counts[layer] - 1:  # DeepSpeed's optimizer holds the experts in the model's order
                raise CheckpointError(f"{where}: the module state lists {prefix[:-1]}'s expert {g} after expert "
                                      f"{self.counts[layer] - 1}, not in the model's order (an older lightspeed's "
                                      "save at ep > 1: load it into the engine and save it again)")
            self.counts[layer] = max(self.counts[layer], g + 1)
            self.of[name] = (layer, g)
        for prefix, count in zip(self.layers, self.counts):
            if count % ep:
                raise CheckpointError(f"{where}: {count} experts in {prefix[:-1]}, not a multiple of the "
                                      f"expert-parallel size {ep}")

    def local_name(self, name: str) -> str:
        """An expert entry's name on its ep rank (DeepSpeed's ZeRO files name experts so)."""
        layer, g = self.of[name]
        prefix, _, rest = expert_id(name)
        return f"{prefix}{g % (self.counts[layer] // self.ep)}{rest}"

    def ep_rank(self, name: str) -> int | None:
        """The ep rank holding entry `name`; None for a dense entry."""
        if name not in self.of:
            return None
        layer, g = self.of[name]
        return g // (self.counts[layer] // self.ep)


def _groups(plan: _Plan, experts: _Experts, source: TrainingStateSource, where: str) -> list[_Group]:
    ep = experts.ep
    given = plan.groups
    if any(hyper.get("moe") for _, hyper, _ in given):  # already DeepSpeed's MoE groups
        out = []
        for names, hyper, scalars in given:
            moe = bool(hyper.get("moe"))
            if any((experts.ep_rank(n) is not None) != moe for n in names):
                raise CheckpointError(f"{where}: param group {hyper.get('name', '?')!r} mixes experts and dense "
                                      "parameters beside MoE groups; DeepSpeed keeps each apart")
            per_rank = [[n for n in names if experts.ep_rank(n) == e] for e in range(ep)] if moe else [names] * ep
            # DeepSpeed names an expert group by the ep size it runs at (its expert groups' name)
            out.append(_Group({**hyper, "name": f"ep_size_{ep}"} if moe else dict(hyper), scalars, per_rank))
        return out
    dense = [_Group(dict(hyper), scalars, [[n for n in names if experts.ep_rank(n) is None]] * ep)
             for names, hyper, scalars in given]
    moe = []
    for names, hyper, scalars in given:
        chunks_per_rank = []
        for e in range(ep):
            chunks: list[list[str]] = []
            size = 0
            for n in (n for n in names if experts.ep_rank(n) == e):
                numel = source.param_shape(n).numel()
                if chunks and size + numel <= _MAX_GROUP_SIZE:
                    chunks[-1].append(n)
                    size += numel
                else:
                    chunks.append([n])
                    size = numel
            chunks_per_rank.append(chunks)
        if len({len(c) for c in chunks_per_rank}) != 1:
            raise CheckpointError(f"{where}: the ep ranks' experts of a param group fill different numbers of "
                                  "DeepSpeed's MoE groups (max_group_size)")
        for k in range(len(chunks_per_rank[0])):
            moe.append(_Group({**hyper, "name": f"ep_size_{ep}", "moe": True}, scalars,
                              [chunks_per_rank[e][k] for e in range(ep)]))
    return [g for g in dense + moe if g.names[0]]  # DeepSpeed drops empty groups


def write_moe(source: TrainingStateSource, plan: _Plan, tag_dir: str, ds_config: Any, ep: int, where: str) -> None:
    """Write DeepSpeed's MoE layout (the module docstring) at ZeRO stage 0, 1 or 2 for expert-parallel
    size `ep`."""
    if ep < 1:
        raise CheckpointError(f"{where}: expert-parallel size {ep}; it must be at least 1")
    if plan.world % ep:
        raise CheckpointError(f"{where}: expert-parallel size {ep} does not divide the {plan.world} ranks")
    if plan.stage not in (0, 1, 2):
        raise CheckpointError(f"{where}: a model with MoE experts at ZeRO stage {plan.stage}: DeepSpeed 0.19.8 "
                              "refuses its MoE layers at stage 3; write stage 0, 1 or 2")
    experts = _Experts(plan.module, ep, where)
    frozen = [n for n in plan.frozen if n in experts.of]
    if frozen and plan.stage:
        raise CheckpointError(f"{where}: frozen expert parameters ({frozen[:2]}) at ZeRO stage {plan.stage}: "
                              "DeepSpeed's frozen-parameter fragments of experts are not written")
    groups = _groups(plan, experts, source, where)
    module = _lowp_module(plan, source, empty_params=False)
    dense: OrderedDict[str, torch.Tensor] = OrderedDict()
    files: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    for name, tensor in module.items():
        if name in experts.of:
            files.setdefault(experts.of[name], {})[name] = tensor.detach().clone()
        else:
            dense[name] = tensor
    client = plan.extra.get("client_state") or {}
    extra = {"num_experts": list(experts.counts), "ds_autoep_layers": None}
    for key in extra:
        if key in client:
            raise CheckpointError(f"client_state key {key!r} is one of DeepSpeed's own MoE model-file entries")
    for (layer, g), entries in sorted(files.items()):
        _save(entries, os.path.join(tag_dir, f"layer_{layer}_expert_{g}_mp_rank_{plan.mp_rank:02d}_model_states.pt"))
    if plan.stage == 0:
        _write_stage0_optimizers(source, plan, tag_dir, ds_config, ep, groups, dense, extra)
        return
    # ZeRO 1/2: a dense group's flat buffer over every rank; ep rank e's experts' over its expert-data-
    # parallel group (ranks e, e + ep, ...), under its own (local) names (deepspeed_moe.py)
    edp = expert_group_ranks(plan.world, plan.world // ep)
    zero_groups = []
    for group in groups:
        if group.hyper.get("moe"):
            splits = [(edp[e], group.names[e], [experts.local_name(n) for n in group.names[e]]) for e in range(ep)]
        else:
            splits = [(list(range(plan.world)), group.names[0], group.names[0])]
        zero_groups.append((group.hyper, group.scalars, splits))
    _write_stage12(source, plan, tag_dir, ds_config, groups=zero_groups, module=dense, model_extra=extra)


def _write_stage0_optimizers(source: TrainingStateSource, plan: _Plan, tag_dir: str, ds_config: Any, ep: int,
                             groups: list[_Group], dense: dict, extra: dict) -> None:
    optimizers = []
    for e in range(ep):
        state, param_groups, masters, slot = {}, [], [], 0
        for group in groups:
            ids = []
            for name in group.names[e]:
                st = _param_state(plan, group.scalars, lambda key, n=name: source.read(n, key).clone())
                if st:
                    state[slot] = st
                ids.append(slot)
                slot += 1
            param_groups.append({**group.hyper, "params": ids})
            if plan.dtype != torch.float32:
                masters.append([source.read(n).clone() for n in group.names[e]])
        inner = {"state": state, "param_groups": param_groups}
        if plan.dtype == torch.float32:
            optimizers.append(inner)
        else:  # DeepSpeed's unfused bf16 optimizer (FP16_UnfusedOptimizer) without ZeRO
            steps = int((plan.extra.get("counters") or {}).get("global_steps") or 0)
            optimizers.append({"dynamic_loss_scale": False, "cur_scale": 1.0, "cur_iter": steps,
                               "optimizer_state_dict": inner, "fp32_groups": masters})
    state = _model_file(plan, dense, optimizer=optimizers[0], param_shapes=None, frozen_fragments=None, shared=None,
                        ds_config=ds_config)
    state.update(extra)
    for e, optimizer in enumerate(optimizers):
        name = f"expp_rank_{e}_mp_rank_{plan.mp_rank:02d}_optim_states.pt"
        _save({"optimizer": optimizer}, os.path.join(tag_dir, name))
    _save(state, os.path.join(tag_dir, _model_name(plan)))
