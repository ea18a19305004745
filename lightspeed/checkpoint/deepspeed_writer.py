"""Writing a training state in DeepSpeed 0.19.8's checkpoint layout, so DeepSpeed's engine resumes it.

Owns `write_deepspeed_checkpoint`: any checkpoint lightspeed reads (a `TrainingStateSource`: lightspeed's
own, or DeepSpeed's at another stage or world size) written as the files ``DeepSpeedEngine.save_checkpoint``
writes at ZeRO stage 0, 1, 2 or 3 for a data-parallel world size, in fp32 or bf16 (MoE experts:
deepspeed_moe_writer.py, ZeRO 0-2; AutoEP: deepspeed_autoep_writer.py, ZeRO 0-2), and
`convert_tag_in_place` (the engine's ``checkpoint.format: "deepspeed"``). The layout is the one
deepspeed_format.py's Note describes (that reader reads these files back). Must not: import deepspeed,
or write what DeepSpeed's loader would not accept (the module Note says what it reads).

Note: [what DeepSpeed's loader reads, and so what is written]
    ``load_checkpoint`` reads the model file (``module`` into the model, strictly; ``lr_scheduler``,
    ``global_steps``, ``global_samples``, ``skipped_steps``, ``dp_world_size``, which must equal its
    own at ZeRO stages 1-3; stage 2/3: ``frozen_param_fragments``, one entry per frozen parameter)
    and, at ZeRO, this rank's optimizer file:
    - stages 1/2 (``_load_legacy_checkpoint``, rigid): the torch optimizer's state dict of the rank's
      flat partition per group (moments with the partition's padding), the partition's masters without
      the padding, ``ds_version``, ``param_alignment_paddings`` (all 0: DeepSpeed's default alignment).
      ``clip_grad`` is left out: DeepSpeed then keeps its configured ``gradient_clipping``.
    - stage 3 (``_rigid_load_state_dict``): ``loss_scaler`` (assigned as the optimizer's loss scaler,
      so DeepSpeed's ``LossScaler`` object, see deepspeed_pickle_writer.py), ``dynamic_loss_scale``,
      ``overflow``, the torch optimizer's state dict (a param group's params: its sub-groups' flats) and
      ``fp32_flat_groups``. Sub-groups follow DeepSpeed's rule (`_stage3_sub_groups`), so the
      ``sub_group_size`` written for must be the one DeepSpeed runs with (its default 1e9).
    - stage 0: the model file's ``optimizer``: the torch optimizer's state dict (fp32), or the unfused
      bf16 optimizer's (``cur_scale``, ``cur_iter``, the torch state dict, ``fp32_groups``).
    The parameters of a group are laid out in the module's order (``model.parameters()``): DeepSpeed
    copies flat buffers without names, so its param groups must list them in that order, as they do
    when built from ``model.parameters()`` or ``named_parameters()``. fp16 is refused: DeepSpeed
    pickles its dynamic loss scaler's full state, which a lightspeed checkpoint does not map onto.
    Everything is written by one process, and it holds the whole fp32 state (masters and moments, 3x
    the fp32 model with Adam) while writing. The moments are written in torch.optim's format (``step``
    a float tensor in each slot's state), which is what DeepSpeed holds with a torch optimizer
    (``torch_adam``, or a client optimizer); its fused CUDA Adam is not exercised here (no GPU).
    DeepSpeed saves no RNG state; lightspeed's per-rank RNG files are not carried over.
"""

from __future__ import annotations

import math
import os
import shutil
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch

from lightspeed._utils.logging import get_logger
from lightspeed.checkpoint.atomic import atomic_write_via, fsync_dir, validate_tag, write_latest
from lightspeed.checkpoint.deepspeed_pickle_writer import (FragmentAddress, LossScaler, ZeroStageEnum,
                                                            save_with_deepspeed_objects)
from lightspeed.checkpoint.errors import CheckpointError
from lightspeed.checkpoint.source import MASTER_KEY, TrainingStateSource

__all__ = ["write_deepspeed_checkpoint", "convert_tag_in_place", "save_as_deepspeed", "module_entry_names",
           "DEEPSPEED_VERSION"]

logger = get_logger(__name__)

DEEPSPEED_VERSION = "0.19.8"
DEFAULT_SUB_GROUP_SIZE = 1_000_000_000  # DeepSpeed's zero_optimization.sub_group_size default
_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}


def module_entry_names(module: torch.nn.Module) -> tuple[list[str], list[str]]:
    """(persistent buffer names, frozen parameter names) of `module`, by DeepSpeed's rules (the model
    file's ``buffer_names`` and ``frozen_param_shapes``): what a checkpoint records so that its module
    state's entries can be told apart without the module."""
    buffers: list[str] = []

    def walk(mod: torch.nn.Module, prefix: str) -> None:
        for name, buf in mod.named_buffers(recurse=False):
            if buf is not None and name not in mod._non_persistent_buffers_set:
                buffers.append(prefix + name)
        for name, child in mod.named_children():
            if child is not None:
                walk(child, prefix + name + ".")

    walk(module, "")
    frozen = [n for n, p in module.named_parameters() if not p.requires_grad]
    return buffers, frozen


class _Plan:
    """What the files need from the source, in DeepSpeed's terms."""

    def __init__(self, source: TrainingStateSource, where: str, stage: int | None, world_size: int | None,
                 dtype: str | torch.dtype | None):
        extra = source.extra()
        self.mp_rank, self.pipeline_stages = 0, None  # a pipeline stage's files (deepspeed_pipeline_writer.py)
        if int((extra.get("mesh") or {}).get("tp", 1)) > 1 or extra.get("tensor_parallel"):
            raise CheckpointError(f"{where}: a tensor-parallel checkpoint; DeepSpeed's layout is written for "
                                  "data parallelism only (mp_rank_00)")
        self.extra = extra
        self.stage = int(extra.get("zero_stage") or 0) if stage is None else int(stage)
        if self.stage not in (0, 1, 2, 3):
            raise CheckpointError(f"{where}: ZeRO stage {self.stage}; DeepSpeed has stages 0-3")
        self.world = int(extra.get("dp_world_size") or 1) if world_size is None else int(world_size)
        if self.world < 1:
            raise CheckpointError(f"{where}: world size {self.world}; it must be at least 1")
        self.module: Mapping[str, torch.Tensor] = source.module_state()
        trainable = set(source.param_names())
        order = [n for n in self.module if n in trainable]
        missing = sorted(trainable - set(order))
        if missing:
            raise CheckpointError(f"{where}: trainable parameters {missing[:3]} are not in the saved module state")
        rank_of = {n: i for i, n in enumerate(order)}
        self.groups = []
        for g in source.optimizer_groups():
            names = sorted(g["names"], key=rank_of.__getitem__)
            hyper = {k: v for k, v in g.items() if k not in ("names", "scalars")}
            if isinstance(hyper.get("betas"), list):  # torch's optimizers hold a tuple
                hyper["betas"] = tuple(hyper["betas"])
            self.groups.append((names, hyper, dict(g.get("scalars") or {})))
        self.trainable = order
        buffers, frozen = extra.get("buffer_names"), extra.get("frozen_param_names")
        others = [n for n in self.module if n not in trainable]
        self.aliases = self._aliases(extra, trainable)
        others = [n for n in others if n not in self.aliases]
        if buffers is None or frozen is None:
            if others and self.stage >= 2:
                raise CheckpointError(f"{where}: the checkpoint does not record which of its module entries "
                                      f"({others[:3]}) are buffers and which frozen parameters (saved by an older "
                                      "lightspeed); DeepSpeed's stages 2/3 need to know. Load and save it again")
            buffers, frozen = others, []
            if others:
                logger.warning("%s: the checkpoint does not record which module entries are buffers; %s written "
                               "as DeepSpeed's buffer_names (only zero_to_fp32 reads them)", where, others[:3])
        self.buffers = [n for n in buffers if n in self.module]
        self.frozen = [n for n in frozen if n in self.module and n not in trainable]
        self.dtype = self._dtype(dtype, where)
        self.state_keys = list(source.state_keys())

    def _aliases(self, extra: dict, trainable: set[str]) -> dict[str, str]:
        """Tied parameters: alias -> the name kept (DeepSpeed's ``shared_params``)."""
        if isinstance(extra.get("shared_params"), dict):
            return dict(extra["shared_params"])
        seen: dict[tuple, str] = {}
        out = {}
        for name, t in self.module.items():
            if not isinstance(t, torch.Tensor) or not t.numel():
                continue
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
            if key in seen and seen[key] in trainable:
                out[name] = seen[key]
            else:
                seen.setdefault(key, name)
        return out

    def _dtype(self, dtype: str | torch.dtype | None, where: str) -> torch.dtype:
        if dtype is None:
            first = next((self.module[n] for n in self.trainable), None)
            dtype = first.dtype if first is not None else torch.float32
        elif isinstance(dtype, str):
            if dtype.lower() not in _DTYPES:
                raise CheckpointError(f"{where}: dtype {dtype!r}; write fp32 or bf16")
            dtype = _DTYPES[dtype.lower()]
        if dtype not in (torch.float32, torch.bfloat16):
            raise CheckpointError(f"{where}: a {dtype} training state; DeepSpeed's layout is written for fp32 and "
                                  "bf16 only (fp16 needs DeepSpeed's dynamic loss scaler, see deepspeed_writer.py)")
        return dtype


def _step_tensor(scalars: dict) -> torch.Tensor | None:
    step = scalars.get("step")
    return None if step is None else torch.tensor(float(step), dtype=torch.float32)


def _param_state(plan: _Plan, scalars: dict, flat_of: Any) -> dict:
    """The torch optimizer's state of one slot: ``step`` plus each moment laid out by `flat_of(key)`."""
    step = _step_tensor(scalars)
    if step is None:
        return {}
    state: dict[str, Any] = {"step": step}
    for key in plan.state_keys:
        state[key] = flat_of(key)
    for k, v in scalars.items():
        if k != "step":
            state[k] = v
    return state


def _model_file(plan: _Plan, module: "OrderedDict[str, torch.Tensor]", *, optimizer: Any, param_shapes: Any,
                frozen_fragments: Any, shared: Any, ds_config: Any) -> dict:
    extra = plan.extra
    counters = extra.get("counters") or {}
    zero = plan.stage > 0
    state = {
        "module": module if plan.pipeline_stages is None else None,  # a pipeline's layers have their own files
        "buffer_names": list(plan.buffers),
        "optimizer": optimizer,
        "param_shapes": param_shapes,
        "frozen_param_shapes": (OrderedDict((n, plan.module[n].shape) for n in plan.frozen)
                                if plan.stage >= 2 else None),
        "shared_params": shared if zero else None,
        "frozen_param_fragments": frozen_fragments if plan.stage >= 2 else None,
        "lr_scheduler": extra.get("lr_scheduler"),
        "data_sampler": None,
        "random_ltd": None,
        "skipped_steps": int(counters.get("skipped_steps") or 0),
        "global_steps": int(counters.get("global_steps") or 0),
        "global_samples": int(counters.get("global_samples") or 0),
        "dp_world_size": plan.world,
        "mp_world_size": plan.pipeline_stages or 1,
        "checkpoint_parallel_dimensions": {"pp_degree": plan.pipeline_stages or 1, "tp_degree": 1},
        "ds_config": ds_config if ds_config is not None else {},
        "ds_version": DEEPSPEED_VERSION,
    }
    client = extra.get("client_state") or {}
    clash = sorted(set(client) & set(state))
    if clash:
        raise CheckpointError(f"client_state keys {clash} are DeepSpeed's own model-file entries")
    state.update(client)  # DeepSpeed merges client_state into the model file
    return state


def _lowp_module(plan: _Plan, source: TrainingStateSource, empty_params: bool) -> "OrderedDict[str, torch.Tensor]":
    """The ``module`` entry: trainable parameters as their masters in the training dtype (stage 3: empty
    placeholders, and frozen ones too), everything else as saved."""
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    trainable = set(plan.trainable)
    params = trainable | set(plan.frozen) | set(plan.aliases)
    kept: dict[str, torch.Tensor] = {}
    for name, tensor in plan.module.items():
        if empty_params and name in params:
            out[name] = torch.empty(0, dtype=plan.dtype)
        elif name in trainable:
            kept[name] = out[name] = source.read(name).to(plan.dtype)
        elif name in plan.aliases and plan.aliases[name] in kept:
            out[name] = kept[plan.aliases[name]]  # the same tensor, as torch saves tied parameters
        else:
            out[name] = tensor
    return out


def _save(obj: Any, path: str) -> None:
    atomic_write_via(path, lambda tmp: save_with_deepspeed_objects(obj, tmp))


def _optim_name(plan: _Plan, rank: int) -> str:
    return f"{'bf16_' if plan.dtype == torch.bfloat16 else ''}zero_pp_rank_{rank}_mp_rank_{plan.mp_rank:02d}_optim_states.pt"


def _model_name(plan: _Plan) -> str:
    return f"mp_rank_{plan.mp_rank:02d}_model_states.pt"


# ------------------------------------------------------------------------------------------- stage 0

def _write_stage0(source: TrainingStateSource, plan: _Plan, tag_dir: str, ds_config: Any) -> None:
    state, param_groups, masters, slot = {}, [], [], 0
    for names, hyper, scalars in plan.groups:
        ids = []
        for name in names:
            st = _param_state(plan, scalars, lambda key, n=name: source.read(n, key).clone())
            if st:
                state[slot] = st
            ids.append(slot)
            slot += 1
        param_groups.append({**hyper, "params": ids})
        if plan.dtype != torch.float32:
            masters.append([source.read(n).clone() for n in names])
    inner = {"state": state, "param_groups": param_groups}
    if plan.dtype == torch.float32:
        optimizer = inner
    else:  # DeepSpeed's unfused bf16 optimizer (FP16_UnfusedOptimizer) without ZeRO
        steps = int((plan.extra.get("counters") or {}).get("global_steps") or 0)
        optimizer = {"dynamic_loss_scale": False, "cur_scale": 1.0, "cur_iter": steps,
                     "optimizer_state_dict": inner, "fp32_groups": masters}
    module = _lowp_module(plan, source, empty_params=False)
    _save(_model_file(plan, module, optimizer=optimizer, param_shapes=None, frozen_fragments=None, shared=None,
                      ds_config=ds_config), os.path.join(tag_dir, _model_name(plan)))


# --------------------------------------------------------------------------------------- stages 1, 2

def _write_stage12(source: TrainingStateSource, plan: _Plan, tag_dir: str, ds_config: Any,
                   groups: list | None = None, module: Any = None, model_extra: dict | None = None) -> None:
    """`groups`: per param group (hyperparameters, scalars, splits), each split (the ranks its flat buffer
    is partitioned over, the parameters' names in the source, their names in the files): an MoE expert
    group has one split per ep rank (deepspeed_moe_writer.py); default: `plan.groups`, each over every
    rank. `module` (default: the whole module) and `model_extra` (added entries) make the model file."""
    world = plan.world
    if groups is None:
        groups = [(hyper, scalars, [(list(range(world)), names, names)]) for names, hyper, scalars in plan.groups]
    per_rank: list[dict] = [{"masters": [], "states": {}, "groups": [], "paddings": [], "mappings": [],
                             "counts": [], "aligned": []} for _ in range(world)]
    param_shapes = []
    for g, (hyper, scalars, splits) in enumerate(groups):
        for ranks, names, saved in splits:
            count = len(ranks)
            numels = [source.param_shape(n).numel() for n in names]
            total = sum(numels)
            part = math.ceil(total / (2 * count)) * 2  # DeepSpeed aligns the flat group to 2 x count elements

            def flat(key: str) -> torch.Tensor:
                out = torch.zeros(part * count)
                offset = 0
                for n, numel in zip(names, numels):
                    out[offset:offset + numel] = source.read(n, key).reshape(-1)
                    offset += numel
                return out

            master = flat(MASTER_KEY)
            moments = {key: flat(key) for key in plan.state_keys} if _step_tensor(scalars) is not None else {}
            starts = [sum(numels[:i]) for i in range(len(names))]
            if 0 in ranks:  # the model file's param_shapes are rank 0's
                param_shapes.append(OrderedDict((s, source.param_shape(n)) for n, s in zip(names, saved)))
            for k, r in enumerate(ranks):
                mine = per_rank[r]
                lo, hi = k * part, (k + 1) * part
                lean = max(0, min(part, total - lo))
                mine["masters"].append(master[lo:lo + lean].clone())
                mine["paddings"].append(part - lean)
                mine["counts"].append(count)
                mine["aligned"].append([0] * len(names))
                st = _param_state(plan, scalars, lambda key: moments[key][lo:hi].clone())
                if st:
                    mine["states"][g] = st
                mine["groups"].append({**hyper, "params": [g]})
                mapping = OrderedDict()
                for s, start, numel in zip(saved, starts, numels):
                    a, b = max(start, lo), min(start + numel, hi)
                    if a < b:
                        mapping[s] = FragmentAddress(numel=b - a, start=a - lo)
                mine["mappings"].append(mapping)
    for r, mine in enumerate(per_rank):
        osd = {
            "loss_scaler": LossScaler(1.0),
            "dynamic_loss_scale": False,
            "overflow": False,
            "base_optimizer_state": {"state": mine["states"], "param_groups": mine["groups"]},
            "single_partition_of_fp32_groups": mine["masters"],
            "zero_stage": ZeroStageEnum(plan.stage),
            "group_paddings": mine["paddings"],
            "param_alignment_paddings": mine["aligned"],
            "partition_count": mine["counts"],
            "ds_version": DEEPSPEED_VERSION,
            "param_slice_mappings": mine["mappings"],
        }
        _save({"optimizer_state_dict": osd, "ds_config": ds_config if ds_config is not None else {},
               "ds_version": DEEPSPEED_VERSION}, os.path.join(tag_dir, _optim_name(plan, r)))
    if module is None:
        module = _lowp_module(plan, source, empty_params=False)
    fragments = OrderedDict((n, plan.module[n].detach().clone()) for n in plan.frozen)
    state = _model_file(plan, module, optimizer=None, param_shapes=param_shapes, frozen_fragments=fragments,
                        shared=dict(plan.aliases), ds_config=ds_config)
    state.update(model_extra or {})
    _save(state, os.path.join(tag_dir, _model_name(plan)))


# ------------------------------------------------------------------------------------------- stage 3

def _stage3_sub_groups(names: list[str], numels: list[int], world: int, sub_group_size: int) -> list[list[str]]:
    """DeepSpeed's ``_create_fp16_sub_groups``: sizes are per-rank partition sizes; a sub-group closes
    once it reaches `sub_group_size` (or at the group's last parameter)."""
    parts = [math.ceil(n / world) for n in numels]
    if sub_group_size >= sum(parts):
        return [list(names)]
    out, current, size = [], [], 0
    for i, (name, p) in enumerate(zip(names, parts)):
        current.append(name)
        size += p
        if size >= sub_group_size or i == len(names) - 1:
            out.append(current)
            current, size = [], 0
    return out


def _write_stage3(source: TrainingStateSource, plan: _Plan, tag_dir: str, ds_config: Any,
                  sub_group_size: int) -> None:
    world = plan.world
    masters: list[list[torch.Tensor]] = [[] for _ in range(world)]
    states: list[dict] = [{} for _ in range(world)]
    groups: list[list[dict]] = [[] for _ in range(world)]
    param_shapes = []
    k = 0
    for names, hyper, scalars in plan.groups:
        numels = [source.param_shape(n).numel() for n in names]
        subs = _stage3_sub_groups(names, numels, world, sub_group_size)
        for r in range(world):  # DeepSpeed's torch optimizer: a param group's sub-groups' flats are its params
            groups[r].append({**hyper, "params": list(range(k, k + len(subs)))})
        for sub in subs:
            param_shapes.append(OrderedDict((n, source.param_shape(n)) for n in sub))

            def rank_flats(key: str) -> list[torch.Tensor]:
                per_rank: list[list[torch.Tensor]] = [[] for _ in range(world)]
                for n in sub:
                    value = source.read(n, key).reshape(-1)
                    part = math.ceil(value.numel() / world)
                    padded = torch.zeros(part * world)
                    padded[:value.numel()] = value
                    for r in range(world):
                        per_rank[r].append(padded[r * part:(r + 1) * part])
                return [torch.cat(p) if p else torch.zeros(0) for p in per_rank]

            for r, flat in enumerate(rank_flats(MASTER_KEY)):
                masters[r].append(flat)
            moments = ({key: rank_flats(key) for key in plan.state_keys}
                       if _step_tensor(scalars) is not None else {})
            for r in range(world):
                st = _param_state(plan, scalars, lambda key, r=r: moments[key][r])
                if st:
                    states[r][k] = st
            k += 1
    module = _lowp_module(plan, source, empty_params=True)
    for r in range(world):
        osd = {
            "zero_stage": ZeroStageEnum(3),
            "loss_scaler": LossScaler(1.0),
            "dynamic_loss_scale": False,
            "overflow": False,
            "partition_count": world,
            "optimizer_state_dict": {"state": states[r], "param_groups": groups[r]},
            "fp32_flat_groups": masters[r],
        }
        _save({"optimizer_state_dict": osd, "ds_config": ds_config if ds_config is not None else {},
               "ds_version": DEEPSPEED_VERSION}, os.path.join(tag_dir, _optim_name(plan, r)))
        fragments = OrderedDict()
        for n in plan.frozen:
            t = plan.module[n].reshape(-1)
            part = math.ceil(t.numel() / world)
            padded = torch.zeros(part * world, dtype=t.dtype)
            padded[:t.numel()] = t
            fragments[n] = padded[r * part:(r + 1) * part].clone()
        shared = dict(plan.aliases) if r == 0 else {}  # DeepSpeed records tied parameters on rank 0 only
        _save(_model_file(plan, module, optimizer=None, param_shapes=param_shapes, frozen_fragments=fragments,
                          shared=shared, ds_config=ds_config),
              os.path.join(tag_dir, f"zero_pp_rank_{r}_mp_rank_00_model_states.pt"))


# ------------------------------------------------------------------------------------------- entry

def write_deepspeed_checkpoint(checkpoint: str | os.PathLike | TrainingStateSource, output_dir: str | os.PathLike,
                               *, tag: str | None = None, source_tag: str | None = None, stage: int | None = None,
                               world_size: int | None = None, dtype: str | torch.dtype | None = None,
                               sub_group_size: int = DEFAULT_SUB_GROUP_SIZE, ds_config: dict | None = None,
                               save_latest: bool = True, verify: bool = True, pipeline: tuple | None = None,
                               ep_size: int | None = None, autoep: list | None = None) -> str:
    """Write `checkpoint` (a directory any lightspeed reader opens, or a source) as DeepSpeed 0.19.8's
    ``<output_dir>/<tag>/`` for ZeRO `stage` over `world_size` data-parallel ranks (default: the
    saved ones), then ``<output_dir>/latest`` (unless `save_latest` is False). `tag` defaults to the
    source's tag (``global_step<N>``). `dtype` (fp32 / bf16) defaults to the saved module's; at stage 3
    `sub_group_size` must be DeepSpeed's ``zero_optimization.sub_group_size``. `ds_config` is recorded
    as the files' ``ds_config``. `pipeline`: (a `PipelineLayout`, the number of stages) to write
    DeepSpeed's pipeline layout (deepspeed_pipeline_writer.py). A module with DeepSpeed-style MoE experts
    is written in DeepSpeed's MoE layout (deepspeed_moe_writer.py; ZeRO 0-2) for expert-parallel
    size `ep_size` (default: the saved one). `autoep`: the model's AutoEP blocks (deepspeed_autoep_writer's
    `AutoEPBlock`s) to write DeepSpeed's AutoEP layout for autoep_size `ep_size` (ZeRO 0-2). Returns the
    tag directory; an existing one is an error."""
    from lightspeed.checkpoint.deepspeed_moe_writer import has_moe_experts, write_moe
    from lightspeed.checkpoint.convert import open_checkpoint  # convert imports the readers this needs

    where = os.fspath(checkpoint) if isinstance(checkpoint, (str, os.PathLike)) else repr(checkpoint)
    source = open_checkpoint(checkpoint, source_tag, verify=verify)
    plan = _Plan(source, where, stage, world_size, dtype)
    moe = has_moe_experts(plan.module)
    if autoep and (moe or pipeline is not None):
        raise CheckpointError(f"{where}: DeepSpeed's AutoEP layout is written without MoE layers or pipeline stages")
    if moe and pipeline is not None:
        raise CheckpointError(f"{where}: a model with MoE experts; DeepSpeed's MoE layout is not written over "
                              "pipeline stages")
    if ep_size is not None and int(ep_size) != 1 and not moe and not autoep:
        raise CheckpointError(f"{where}: expert-parallel size {ep_size} for a model without MoE experts "
                              "(...deepspeed_experts.<G>.* entries)")
    ep = int(ep_size) if ep_size is not None else int((plan.extra.get("mesh") or {}).get("ep") or 1)
    if tag is None:
        counters = plan.extra.get("counters") or {}
        saved = getattr(source, "path", None)
        tag = os.path.basename(os.fspath(saved)) if saved else f"global_step{int(counters.get('global_steps') or 0)}"
    tag = validate_tag(tag)
    tag_dir = os.path.join(os.fspath(output_dir), tag)
    if os.path.exists(tag_dir):
        raise CheckpointError(f"{tag_dir}: already exists; remove it or write into another output directory")
    staging = os.path.join(os.fspath(output_dir), f".{tag}.deepspeed.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    try:
        if pipeline is not None:
            from lightspeed.checkpoint.deepspeed_pipeline_writer import write_pipeline_stages

            layout, num_stages = pipeline
            write_pipeline_stages(source, where, staging, layout=layout, num_stages=int(num_stages), stage=stage,
                                  world_size=world_size, dtype=dtype, ds_config=ds_config)
        elif autoep:
            from lightspeed.checkpoint.deepspeed_autoep_writer import write_autoep

            write_autoep(source, plan, staging, ds_config, ep, list(autoep), where)
        elif moe:
            write_moe(source, plan, staging, ds_config, ep, where)
        elif plan.stage == 0:
            _write_stage0(source, plan, staging, ds_config)
        elif plan.stage in (1, 2):
            _write_stage12(source, plan, staging, ds_config)
        else:
            _write_stage3(source, plan, staging, ds_config, int(sub_group_size))
        os.replace(staging, tag_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    fsync_dir(output_dir)
    if save_latest:
        write_latest(output_dir, tag)
    logger.info("wrote DeepSpeed %s checkpoint %s (ZeRO stage %d, %d ranks, %s)", DEEPSPEED_VERSION, tag_dir,
                plan.stage, plan.world, str(plan.dtype).replace("torch.", ""))
    return tag_dir


def convert_tag_in_place(save_dir: str | os.PathLike, tag: str, *, stage: int, world_size: int,
                         dtype: torch.dtype | None, sub_group_size: int, ds_config: dict | None,
                         pipeline: tuple | None = None, ep_size: int | None = None,
                         autoep: list | None = None) -> str:
    """Replace lightspeed's files of ``save_dir/tag`` by DeepSpeed's layout of the same state (one process;
    the caller has every rank's files in place and waits for this before going on). The converted tag
    is written next to it, then swapped in: a crash leaves the lightspeed tag or the DeepSpeed one."""
    save_dir = os.fspath(save_dir)
    tag_dir = os.path.join(save_dir, validate_tag(tag))
    scratch = os.path.join(save_dir, f".{tag}.deepspeed.out")
    shutil.rmtree(scratch, ignore_errors=True)
    write_deepspeed_checkpoint(tag_dir, scratch, tag=tag, stage=stage, world_size=world_size, dtype=dtype,
                               sub_group_size=sub_group_size, ds_config=ds_config, save_latest=False,
                               pipeline=pipeline, ep_size=ep_size, autoep=autoep)
    old = os.path.join(save_dir, f".{tag}.lightspeed.old")
    shutil.rmtree(old, ignore_errors=True)
    os.replace(tag_dir, old)
    os.replace(os.path.join(scratch, tag), tag_dir)
    fsync_dir(save_dir)
    shutil.rmtree(old, ignore_errors=True)
    shutil.rmtree(scratch, ignore_errors=True)
    return tag_dir


def save_as_deepspeed(save_dir: str | os.PathLike, tag: str, *, comm: Any, rank: int, stage: int, world_size: int,
                      sub_group_size: int, pipeline: tuple | None = None, ep_size: int | None = None,
                      autoep: list | None = None) -> None:
    """The engine's ``checkpoint.format: "deepspeed"``: every rank has written its part of lightspeed's
    ``save_dir/tag``; rank `rank` 0 converts it in place (`convert_tag_in_place`) while the others wait.
    Collective over `comm` (a `Communicator`); a failure on rank 0 is raised on every rank."""
    error = None
    if rank == 0:
        try:
            convert_tag_in_place(save_dir, tag, stage=stage, world_size=world_size, dtype=None,
                                 sub_group_size=sub_group_size, ds_config=None, pipeline=pipeline,
                                 ep_size=ep_size, autoep=autoep)
        except Exception as exc:  # every rank raises it below, so none waits forever
            error = f"{type(exc).__name__}: {exc}"
    errors = comm.all_gather_object(error) if comm.world_size > 1 else [error]
    if errors[0] is not None:
        raise CheckpointError(f"{os.path.join(os.fspath(save_dir), tag)}: writing DeepSpeed's layout "
                              f"(checkpoint.format) failed on rank 0: {errors[0]}")
