"""Reading a checkpoint into a run whose experts are split over expert parallelism (any ep size).

A checkpoint of expert-parallel training holds the whole model's expert state (parallel/experts/
names.py's Note on global names): DeepSpeed-style experts under their global index, AutoEP's fused
experts as whole [E, ...] tensors assembled from the ranks' rows (universal.py's Note on placements).
`ExpertSource` shows such a source as this ep rank sees it.

Owns: `ExpertSource`. Must not: communicate (the engine agrees failures), or change an engine.
"""

from __future__ import annotations

from typing import Any

import torch

from lightspeed.checkpoint.errors import CheckpointError
from lightspeed.checkpoint.source import MASTER_KEY
from lightspeed.checkpoint.universal import OneTensorCache, has_state
from lightspeed.parallel.experts.names import ExpertNames
from lightspeed.parallel.placement import Placement


class ExpertSource:
    """A source of the whole model's state (`whole`: ep = 1 names, whole tensors) seen by one ep rank:
    its DeepSpeed-style experts under their local names (the other ranks' experts left out), its rows
    of each fused expert tensor (`fused`: name -> this rank's placement), everything else as `whole`
    has it."""

    def __init__(self, whole, names: ExpertNames, fused: dict[str, Placement]):
        self.whole, self.names, self.fused = whole, names, fused
        self._cache = OneTensorCache(self.read)
        self._saved: dict[str, str] = {}  # this rank's name -> the saved one, for the names held here
        for saved in whole.param_names():
            local = self._local(saved)
            if local is not None:
                self._saved[local] = saved

    def _local(self, saved: str) -> str | None:
        try:
            return self.names.to_local(saved)
        except ValueError as err:
            raise CheckpointError(f"checkpoint: {err} (saved with more experts than this model has)") from None

    def _placement(self, name: str, shape) -> Placement | None:
        placement = self.fused.get(name)
        if placement is not None and tuple(shape) != placement.global_shape:
            raise CheckpointError(f"checkpoint: the experts {name} have whole shape {tuple(shape)}, this model's "
                                  f"is {placement.global_shape} (another number of experts?)")
        return placement

    def _saved_name(self, name: str) -> str:
        try:
            return self._saved[name]
        except KeyError:
            raise KeyError(f"parameter {name} is not in the checkpoint") from None

    # ------------------------------------------------------------------ TrainingStateSource
    def param_names(self) -> list[str]:
        return list(self._saved)

    def param_shape(self, name: str) -> torch.Size:
        shape = self.whole.param_shape(self._saved_name(name))
        placement = self._placement(name, shape)
        return torch.Size(placement.local_shape) if placement is not None else shape

    def state_keys(self) -> list[str]:
        return self.whole.state_keys()

    def read(self, name: str, key: str = MASTER_KEY) -> torch.Tensor:
        saved = self._saved_name(name)
        placement = self._placement(name, self.whole.param_shape(saved))
        if placement is None:
            return self.whole.read(saved, key)
        if hasattr(self.whole, "read_slice"):  # the rows this rank saved: read them alone
            local = self.whole.read_slice(saved, key, placement)
            if local is not None:
                return local
        return placement.slice_of(self.whole.read(saved, key))

    def read_range(self, name: str, key: str, start: int, end: int) -> torch.Tensor:
        if name not in self.fused and hasattr(self.whole, "read_range"):
            return self.whole.read_range(self._saved_name(name), key, start, end)
        return self._cache.range(name, key, start, end)

    def has_state(self, name: str, key: str) -> bool:
        return has_state(self.whole, self._saved_name(name), key)

    def module_state(self) -> dict[str, torch.Tensor]:
        out: dict[str, Any] = {}
        for saved, value in self.whole.module_state().items():
            local = self._local(saved)
            if local is None:
                continue  # another ep rank's expert
            placement = self.fused.get(local)
            if placement is not None and torch.is_tensor(value) and value.numel() > 0:  # empty: a ZeRO-3 placeholder
                self._placement(local, value.shape)  # refuses another whole shape
                value = placement.slice_of(value)
            out[local] = value
        return out

    def optimizer_groups(self) -> list[dict[str, Any]]:
        groups = []
        for group in self.whole.optimizer_groups():
            local = [n for n in (self._local(s) for s in group.get("names", ())) if n is not None]
            groups.append({**group, "names": local})
        return groups

    def extra(self) -> dict[str, Any]:
        extra = dict(self.whole.extra())
        for key in ("excluded_frozen_parameters", "buffer_names", "frozen_param_names"):  # lists of names
            if isinstance(extra.get(key), (list, tuple)):
                extra[key] = [n for n in (self._local(str(s)) for s in extra[key]) if n is not None]
        return extra
