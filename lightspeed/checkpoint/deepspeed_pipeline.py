"""DeepSpeed's pipeline-parallel checkpoints, read as one `TrainingStateSource` whatever pp or dp loads them.

Owns the layout DeepSpeed's `PipelineEngine` writes under ``<save_dir>/<tag>/`` (documented in
tests/fixtures/deepspeed_pipeline/README.md): ``layer_<XX>-model_states.pt`` (one per built layer,
XX its global index: the layer's own state_dict), ``mp_rank_<SS>_model_states.pt`` per stage SS
(`module` None; counters, and at ZeRO-0 the stage's torch optimizer state) and at ZeRO-1
``zero_pp_rank_<D>_mp_rank_<SS>_optim_states.pt`` per data-parallel rank D of stage SS. Must not:
unpickle anything but through deepspeed_pickle.py (every file is loaded by `DeepSpeedCheckpointSource`
or `load_deepspeed_file`, weights only, with inert stand-ins for DeepSpeed's classes), or know an engine.

Note: [names] Each stage is one `DeepSpeedCheckpointSource` (its mp_rank's files). The whole source
names parameters as lightspeed's PipelineModule does (`<index>.<name>`, tied modules
`tied_modules.<key>.<name>`), which are DeepSpeed's own names: ZeRO files name their parameters so.
The layer files are renamed from their index: `PipelineLayout.tied_layers` says which indices are a
tied module (DeepSpeed saves a tied module under the index of its first use without `forward_fn`). A
parameter on several stages (a tied module's) is read from the first stage that holds it: DeepSpeed
keeps the copies equal (their gradients are summed over the stages).

Note: [stage 0] Without ZeRO a stage's optimizer state names its parameters only by position in the
stage module's `parameters()`: the tied modules the stage uses (in order of first use), then its
layers. Which layers a stage held is the partition of the model at the saved number of stages, which
the checkpoint does not record: `PipelineLayout.parts_at` computes it from the model being loaded.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from lightspeed._utils.logging import get_logger
from lightspeed.checkpoint.deepspeed_format import DeepSpeedCheckpointSource, resolve_deepspeed_tag_dir
from lightspeed.checkpoint.deepspeed_pickle import load_deepspeed_file
from lightspeed.checkpoint.errors import CheckpointError
from lightspeed.checkpoint.integrity import verification_enabled, verify_zip
from lightspeed.checkpoint.source import MASTER_KEY
from lightspeed.checkpoint.tag_reader import warn_unverified

__all__ = ["PipelineLayout", "DeepSpeedPipelineSource", "is_deepspeed_pipeline_tag_dir"]

logger = get_logger(__name__)

_LAYER = re.compile(r"^layer_(\d+)-model_states\.pt$")
_STAGE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")


@dataclass(frozen=True)
class PipelineLayout:
    """What the model being loaded says about a pipeline checkpoint (see the Notes): global layer index
    -> tie key of each tied layer, and the stage bounds at a number of stages (None: unknown, enough
    at ZeRO 1-2 whose files name every parameter)."""

    tied_layers: Mapping[int, str] = field(default_factory=dict)
    parts_at: Callable[[int], list[int]] | None = None
    # the layers DeepSpeed saves a file for (a module; a tied one only where it has no forward_fn)
    module_layers: frozenset[int] = frozenset()

    def layer_prefix(self, index: int) -> str:
        """The module-state prefix of layer `index`'s entries."""
        key = self.tied_layers.get(index)
        return f"tied_modules.{key}." if key is not None else f"{index}."

    def stage_prefixes(self, parts: list[int], stage: int) -> list[str]:
        """The module-state prefixes of stage `stage` in DeepSpeed's `parameters()` order: the tied
        modules its layers use (in order of first use: DeepSpeed registers them before the layers),
        then its layers."""
        indices = range(parts[stage], parts[stage + 1])
        tied = [self.layer_prefix(i) for i in indices if i in self.tied_layers]
        return list(dict.fromkeys(tied)) + [f"{i}." for i in indices if i not in self.tied_layers]


def is_deepspeed_pipeline_tag_dir(path) -> bool:
    """Whether `path` is a tag directory of DeepSpeed's pipeline layout (layer files and stage files)."""
    if not os.path.isdir(path):
        return False
    names = os.listdir(path)
    return any(_LAYER.match(n) for n in names) and any(_STAGE.match(n) for n in names)


class DeepSpeedPipelineSource:
    """A checkpoint DeepSpeed's pipeline engine saved, as one source over every stage's files."""

    def __init__(self, checkpoint_dir, tag: str | int | None = None, *, layout: PipelineLayout | None = None,
                 verify: bool | None = None):
        self.path = resolve_deepspeed_tag_dir(checkpoint_dir, tag)
        if not is_deepspeed_pipeline_tag_dir(self.path):
            raise CheckpointError(f"{self.path}: not a DeepSpeed pipeline checkpoint (no layer_<XX>-model_states.pt "
                                  "and mp_rank_<SS>_model_states.pt files)")
        self.layout = layout or PipelineLayout()
        self._verify = verification_enabled() if verify is None else bool(verify)
        if not self._verify:
            warn_unverified(self.path)
        self._verified: set[str] = set()
        names = sorted(os.listdir(self.path))
        stages = sorted(int(m.group(1)) for n in names if (m := _STAGE.match(n)))
        if stages != list(range(len(stages))):
            missing = min(set(range(max(stages) + 1)) - set(stages))
            raise CheckpointError(f"{os.path.join(self.path, f'mp_rank_{missing:02d}_model_states.pt')}: missing")
        self.num_stages = len(stages)
        self.module = self._layers(names)
        first = self._load(os.path.join(self.path, "mp_rank_00_model_states.pt"))
        saved_stages = int((first.get("checkpoint_parallel_dimensions") or {}).get("pp_degree")
                           or first.get("mp_world_size") or self.num_stages) if isinstance(first, dict) else 0
        if saved_stages != self.num_stages:
            raise CheckpointError(f"{self.path}: saved by {saved_stages} pipeline stages but holds "
                                  f"{self.num_stages} mp_rank_<SS>_model_states.pt files")
        zero = any(n.startswith("zero_pp_rank_") and n.endswith("_optim_states.pt") for n in names)
        self.stages = [DeepSpeedCheckpointSource(self.path, mp_rank=s, verify=self._verify, verified=self._verified,
                                                 module={} if zero else self._stage_module(s))
                       for s in range(self.num_stages)]
        self._owner: dict[str, DeepSpeedCheckpointSource] = {}
        for stage in self.stages:
            for name in stage.param_names():
                self._owner.setdefault(name, stage)
        self.zero_stage = self.stages[0].zero_stage
        self.world_size = self.stages[0].world_size

    # ------------------------------------------------------------------ files
    def _load(self, path: str) -> Any:
        if self._verify and path not in self._verified:
            if not verify_zip(path):
                logger.warning("%s: holds no CRC-32s to check; read unverified", path)
            self._verified.add(path)
        return load_deepspeed_file(path, mmap=True)

    def _layers(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The module state from the layer files, named as the PipelineModule names it."""
        module: dict[str, torch.Tensor] = {}
        for name in sorted((n for n in names if _LAYER.match(n)), key=lambda n: int(_LAYER.match(n).group(1))):
            index = int(_LAYER.match(name).group(1))
            path = os.path.join(self.path, name)
            state = self._load(path)
            if not isinstance(state, Mapping):
                raise CheckpointError(f"{path}: not a layer's state_dict")
            for key, value in state.items():
                module.setdefault(self.layout.layer_prefix(index) + str(key), value)
        return module

    def _stage_module(self, stage: int) -> dict[str, torch.Tensor]:
        """Stage `stage`'s module state in its `parameters()` order (the Note on stage 0)."""
        if self.layout.parts_at is None:
            raise CheckpointError(f"{self.path}: a DeepSpeed pipeline checkpoint without ZeRO names its optimizer's "
                                  "parameters by position only; load it into the PipelineModule it was saved from")
        parts = [int(p) for p in self.layout.parts_at(self.num_stages)]
        out: dict[str, torch.Tensor] = {}
        for prefix in self.layout.stage_prefixes(parts, stage):
            held = {k: v for k, v in self.module.items() if k.startswith(prefix)}
            if not held and prefix.startswith("tied_modules."):
                raise CheckpointError(f"{self.path}: no layer file holds tied module {prefix[13:-1]!r}")
            out.update(held)
        return out

    # ------------------------------------------------------------------ TrainingStateSource
    def param_names(self) -> list[str]:
        return list(self._owner)

    def _stage_of(self, name: str) -> DeepSpeedCheckpointSource:
        try:
            return self._owner[name]
        except KeyError:
            raise KeyError(f"{self.path}: no trainable parameter named {name!r}") from None

    def param_shape(self, name: str) -> torch.Size:
        return self._stage_of(name).param_shape(name)

    def state_keys(self) -> list[str]:
        keys: list[str] = []
        for stage in self.stages:
            keys.extend(k for k in stage.state_keys() if k not in keys)
        return keys

    def read(self, name: str, key: str = MASTER_KEY) -> torch.Tensor:
        return self._stage_of(name).read(name, key)

    def module_state(self) -> dict[str, torch.Tensor]:
        return dict(self.module)

    def optimizer_groups(self) -> list[dict[str, Any]]:
        """Groups matched by index over the stages: hyperparameters and scalar state (the step) from the
        first stage, the names of every stage (each parameter once)."""
        per_stage = [stage.optimizer_groups() for stage in self.stages]
        if len({len(g) for g in per_stage}) != 1:
            raise CheckpointError(f"{self.path}: the stages' optimizers have different numbers of param groups "
                                  f"{[len(g) for g in per_stage]}")
        out = []
        for gi, group in enumerate(per_stage[0]):
            names = [n for groups in per_stage for n in groups[gi]["names"] if self._owner.get(n) is not None]
            out.append({**group, "names": list(dict.fromkeys(names))})
        return out

    def extra(self) -> dict[str, Any]:
        out = self.stages[0].extra()
        out["pipeline_stages"] = self.num_stages
        out["buffer_names"] = [n for s in self.stages for n in s.extra().get("buffer_names") or []]
        return out

    def __repr__(self) -> str:
        return (f"DeepSpeedPipelineSource({self.path!r}, stages={self.num_stages}, zero_stage={self.zero_stage}, "
                f"world_size={self.world_size}, params={len(self._owner)})")
