"""Writing a training state in DeepSpeed 0.19.8's pipeline checkpoint layout, so DeepSpeed's
`PipelineEngine` resumes it.

Owns `write_pipeline_stages`: the files of every stage (deepspeed_pipeline.py's layout): per layer
DeepSpeed saves (`PipelineLayout.module_layers`) its `layer_<XX>-model_states.pt`, per stage its
`mp_rank_<SS>_model_states.pt` (`module` None) and, at ZeRO 1-2, its data-parallel ranks'
`zero_pp_rank_<D>_mp_rank_<SS>_optim_states.pt`. A stage's model and optimizer files are
deepspeed_writer.py's for the stage's own module (`_StageView`: the tied modules its layers use,
then its layers, in DeepSpeed's `parameters()` order), so they follow that writer's Note on what
DeepSpeed's loader reads. Must not: import deepspeed, or write ZeRO-3 (DeepSpeed's pipeline engine
refuses it).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any

import torch

from lightspeed.checkpoint.deepspeed_pipeline import PipelineLayout
from lightspeed.checkpoint.deepspeed_writer import _Plan, _save, _write_stage0, _write_stage12
from lightspeed.checkpoint.errors import CheckpointError
from lightspeed.checkpoint.source import MASTER_KEY

__all__ = ["write_pipeline_stages"]


class _StageView:
    """One stage of a whole-model `TrainingStateSource`: the entries under `prefixes`, in their order."""

    def __init__(self, source, prefixes: list[str]):
        self.source = source
        whole = source.module_state()
        self.module = OrderedDict((k, whole[k]) for prefix in prefixes for k in whole if k.startswith(prefix))
        self.names = [n for n in self.module if n in set(source.param_names())]

    def param_names(self) -> list[str]:
        return list(self.names)

    def param_shape(self, name: str) -> torch.Size:
        return self.source.param_shape(name)

    def state_keys(self) -> list[str]:
        return self.source.state_keys()

    def read(self, name: str, key: str = MASTER_KEY) -> torch.Tensor:
        return self.source.read(name, key)

    def module_state(self):
        return self.module

    def optimizer_groups(self) -> list[dict[str, Any]]:
        held = set(self.names)
        return [{**g, "names": [n for n in g["names"] if n in held]} for g in self.source.optimizer_groups()]

    def extra(self) -> dict[str, Any]:
        return self.source.extra()


def write_pipeline_stages(source, where: str, tag_dir: str, *, layout: PipelineLayout, num_stages: int,
                          stage: int | None, world_size: int | None, dtype, ds_config: Any) -> tuple[int, int]:
    """Write `source` (the whole model's state) into `tag_dir` as DeepSpeed's pipeline engine saves it
    over `num_stages` stages (bounds from `layout.parts_at`) and `world_size` data-parallel ranks at
    ZeRO `stage`. Returns (stage, world size) written."""
    if layout.parts_at is None:
        raise CheckpointError(f"{where}: writing DeepSpeed's pipeline layout needs the PipelineModule's partition")
    parts = [int(p) for p in layout.parts_at(num_stages)]
    plans = []
    for s in range(num_stages):
        view = _StageView(source, layout.stage_prefixes(parts, s))
        plan = _Plan(view, where, stage, world_size, dtype)
        plan.mp_rank, plan.pipeline_stages = s, num_stages
        if plan.stage == 0:
            _write_stage0(view, plan, tag_dir, ds_config)
        elif plan.stage in (1, 2):
            _write_stage12(view, plan, tag_dir, ds_config)
        else:
            raise CheckpointError(f"{where}: zero_optimization.stage {plan.stage} is not written in DeepSpeed's "
                                  "pipeline layout (DeepSpeed's PipelineEngine asserts stage < 2); keep "
                                  "checkpoint.format \"lightspeed\" for a ZeRO-3 pipeline")
        plans.append(plan)
        for index in range(parts[s], parts[s + 1]):
            if index in layout.module_layers:
                prefix = layout.layer_prefix(index)
                state = OrderedDict()
                for name, value in view.module.items():
                    if name.startswith(prefix):
                        tensor = view.read(name).to(plan.dtype) if name in set(view.names) else value
                        state[name[len(prefix):]] = tensor.detach().clone() if torch.is_tensor(tensor) else tensor
                _save(state, os.path.join(tag_dir, f"layer_{index:02d}-model_states.pt"))
    return plans[0].stage, plans[0].world
