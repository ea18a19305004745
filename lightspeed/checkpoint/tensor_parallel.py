"""Checkpoints of a tensor-parallel run: the record of this run's layout, and reading any checkpoint at
any tp size.

A tensor-parallel run saves one tag like any other run (engine_checkpoint.py, one commit for every rank
of the mesh): every rank writes its fragments with their placements (universal.py's Note on placements),
and the module state is saved whole. An earlier layout wrote each tp column's checkpoint under
`save_dir/tp_rank_<RR>/<tag>/`, each recording its slices (`tensor_parallel`: the tp size and rank, and
per split parameter its plan style, role, whole shape and whether the whole tensor is a transposed
Conv1D); those still load.

Owns: `tp_record`, and `open_at_tp_size`, which opens any checkpoint (tp or not, lightspeed's
or DeepSpeed's) as a `TrainingStateSource` (source.py) in the layout a reader wants:
    - a checkpoint of placed fragments (or one without tensor parallelism) reads whole tensors, and a run
      with tensor parallelism cuts its slices out of them (`SlicedTPSource`);
    - an earlier tp_rank_<RR>/ checkpoint whose layout is this run's (same tp size and plan): this tp
      rank's own directory, as saved (nothing re-sliced);
    - otherwise `MergedTPSource` joins every tp rank's checkpoint into whole tensors (each split
      parameter's slices through `TPLayout.gather`, the inverse of the split the layers were made with;
      replicated parameters from tp rank 0), and for a run with tensor parallelism `SlicedTPSource` cuts
      this tp rank's slices out of them (`TPLayout.shard`, the split itself). Masters, elementwise
      optimizer state (a split parameter's Adam moments are split like the parameter) and the module state
      go through the same merge and split, so the fragments path (universal.py) then re-slices over the
      data-parallel ranks and ZeRO stage as for any checkpoint: tp size, dp world size and stage change
      together. A parameter whose whole shape differs from this run's is refused naming it.
Consolidation (`zero_to_fp32`, `lightspeed convert`) reads the directory holding `tp_rank_<RR>/` through
`MergedTPSource`; one tp rank's directory alone is refused (it holds slices). Must not: communicate (the
engine agrees failures), or change an engine (the reader only reads; universal.py applies).

Cost of a load at another tp size: every rank reads every tp rank's slices of the parameters it holds a
part of, one whole parameter at a time (the last one kept, as fragments of one parameter come in a row).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lightspeed._utils.logging import get_logger
from lightspeed.checkpoint.atomic import read_latest
from lightspeed.checkpoint.errors import CheckpointError
from lightspeed.checkpoint.source import MASTER_KEY
from lightspeed.checkpoint.universal import OneTensorCache, has_state, open_source
from lightspeed.parallel.placement import tp_placement
from lightspeed.parallel.tensor_parallel import TPLayout, tp_layouts

logger = get_logger(__name__)

_SUBDIR = "tp_rank_{:02d}"


def tp_record(module: torch.nn.Module, tp_size: int, tp_rank: int) -> dict[str, Any]:
    """The layout record saved with each tp rank's checkpoint (plain data)."""
    layouts = {name: [layout.style, layout.role, list(layout.full_shape), layout.transposed]
               for name, layout in sorted(tp_layouts(module).items())}
    return {"tp_size": tp_size, "tp_rank": tp_rank, "layouts": layouts}


def record_layouts(record: dict[str, Any], where) -> dict[str, TPLayout]:
    """{parameter name: TPLayout} of a saved (or this run's) `tp_record`."""
    try:
        size = int(record["tp_size"])
        return {str(name): TPLayout(str(style), str(role), tuple(int(s) for s in shape), bool(transposed), size)
                for name, (style, role, shape, transposed) in record["layouts"].items()}
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise CheckpointError(f"{where}: malformed tensor_parallel record ({err})") from None


class MergedTPSource:
    """Every tp rank's checkpoint of one tag (`sources`, in tp rank order, each a `LightspeedSource`) as one
    `TrainingStateSource` of whole tensors in the original module's layout (Conv1D [in, out] included)."""

    def __init__(self, sources: list, where):
        self.sources, self.where = sources, where
        records = [s.extra().get("tensor_parallel") for s in sources]
        for rank, record in enumerate(records):
            if not isinstance(record, dict) or record.get("tp_rank") != rank or record.get("tp_size") != len(sources):
                said = {k: record.get(k) for k in ("tp_size", "tp_rank")} if isinstance(record, dict) else None
                raise CheckpointError(f"{where}: {_SUBDIR.format(rank)} does not hold tp rank {rank} of "
                                      f"{len(sources)} (its record: {said})")
            if record.get("layouts") != records[0].get("layouts"):
                raise CheckpointError(f"{where}: tp ranks 0 and {rank} saved different tensor-parallel plans")
        self.record = records[0]
        self.layouts = record_layouts(self.record, where)
        names = sources[0].param_names()
        for rank, source in enumerate(sources):
            if set(source.param_names()) != set(names):
                raise CheckpointError(f"{where}: tp ranks 0 and {rank} saved different parameters")
            for name in names:
                layout = self.layouts.get(name)
                want = layout.shard_shape(rank) if layout is not None else tuple(sources[0].param_shape(name))
                if tuple(source.param_shape(name)) != want:
                    raise CheckpointError(f"{where}: tp rank {rank}'s {name} has shape "
                                          f"{tuple(source.param_shape(name))}, its saved layout says {want}")
        self._cache = OneTensorCache(self.read)

    def _split(self, name: str) -> TPLayout | None:
        layout = self.layouts.get(name)
        return layout if layout is not None and layout.sharded else None

    # ------------------------------------------------------------------ TrainingStateSource
    def param_names(self) -> list[str]:
        return self.sources[0].param_names()

    def param_shape(self, name: str) -> torch.Size:
        layout = self.layouts.get(name)
        return torch.Size(layout.full_shape) if layout is not None else self.sources[0].param_shape(name)

    def state_keys(self) -> list[str]:
        return self.sources[0].state_keys()

    def read(self, name: str, key: str = MASTER_KEY) -> torch.Tensor:
        layout = self._split(name)
        if layout is None:  # replicated: identical on every tp rank
            return self.sources[0].read(name, key)
        return layout.gather([source.read(name, key) for source in self.sources])

    def read_range(self, name: str, key: str, start: int, end: int) -> torch.Tensor:
        return self._cache.range(name, key, start, end)

    def has_state(self, name: str, key: str) -> bool:
        sources = self.sources if self._split(name) is not None else self.sources[:1]
        return all(has_state(source, name, key) for source in sources)

    def module_state(self) -> dict[str, torch.Tensor]:
        states = [source.module_state() for source in self.sources]
        out = dict(states[0])  # replicated entries (and tied names sharing storage) as tp rank 0 saved them
        for name, value in states[0].items():
            layout = self._split(name)
            if layout is None or not torch.is_tensor(value) or value.numel() == 0:
                continue
            if any(name not in state for state in states):
                raise CheckpointError(f"{self.where}: {name} is missing from a tp rank's module state")
            try:
                out[name] = layout.gather([state[name] for state in states])
            except (RuntimeError, ValueError) as err:
                raise CheckpointError(f"{self.where}: the tp slices of {name} do not join ({err})") from None
        return out

    def optimizer_groups(self) -> list[dict[str, Any]]:
        return self.sources[0].optimizer_groups()

    def extra(self) -> dict[str, Any]:
        # whole tensors: no tp layout left; what was saved stays readable under its own key
        return {**self.sources[0].extra(), "tensor_parallel": None, "saved_tensor_parallel": self.record}


class SlicedTPSource:
    """A source of whole tensors (`whole`) seen as tp rank `record["tp_rank"]` of a run whose split
    parameters are `record`'s (this run's `tp_record`): each split parameter, its optimizer state and its
    module-state entry are this rank's slice; everything else is as `whole` has it."""

    def __init__(self, whole, record: dict[str, Any]):
        self.whole, self.record = whole, record
        self.rank = int(record["tp_rank"])
        self.layouts = record_layouts(record, "this run")
        self._cache = OneTensorCache(self.read)

    def _layout(self, name: str, shape) -> TPLayout | None:
        layout = self.layouts.get(name)
        if layout is not None and tuple(shape) != layout.full_shape:
            raise CheckpointError(f"checkpoint: parameter {name} has whole shape {tuple(shape)}, this run's is "
                                  f"{layout.full_shape} (another model or plan)")
        return layout

    def param_names(self) -> list[str]:
        return self.whole.param_names()

    def param_shape(self, name: str) -> torch.Size:
        shape = self.whole.param_shape(name)
        layout = self._layout(name, shape)
        return torch.Size(layout.shard_shape(self.rank)) if layout is not None else shape

    def state_keys(self) -> list[str]:
        return self.whole.state_keys()

    def read(self, name: str, key: str = MASTER_KEY) -> torch.Tensor:
        layout = self._layout(name, self.whole.param_shape(name))
        if layout is not None and hasattr(self.whole, "read_slice"):  # the same slice as saved: read it alone
            local = self.whole.read_slice(name, key, tp_placement(name, layout, self.rank))
            if local is not None:
                return local
        full = self.whole.read(name, key)
        return layout.shard(full, self.rank) if layout is not None else full

    def read_range(self, name: str, key: str, start: int, end: int) -> torch.Tensor:
        return self._cache.range(name, key, start, end)

    def has_state(self, name: str, key: str) -> bool:
        return has_state(self.whole, name, key)

    def module_state(self) -> dict[str, torch.Tensor]:
        out = dict(self.whole.module_state())
        for name in self.layouts:
            value = out.get(name)
            if torch.is_tensor(value) and value.numel() > 0:  # empty: a ZeRO-3 placeholder, filled from the masters
                out[name] = self._layout(name, value.shape).shard(value, self.rank)
        return out

    def optimizer_groups(self) -> list[dict[str, Any]]:
        return self.whole.optimizer_groups()

    def extra(self) -> dict[str, Any]:
        return {**self.whole.extra(), "tensor_parallel": self.record}


def _is_tp_layout(load_dir: Path, tag: str | None) -> bool:
    """`load_dir` holds tp_rank_<RR>/ directories and no checkpoint of its own for `tag` (or `latest`)."""
    if not (load_dir / _SUBDIR.format(0)).is_dir():
        return False
    return not ((load_dir / "latest").exists() if tag is None else (load_dir / str(tag)).is_dir())


def open_at_tp_size(load_dir, tag: str | None = None, *, dp_rank: int = 0, current: dict[str, Any] | None = None,
                    param_names=None, mesh_rank: int | None = None, pipeline=None):
    """The checkpoint in `load_dir` as `(path, source, rng_state)` for tp rank `current["tp_rank"]` of a run
    whose layout is `current` (its `tp_record`; None: a run without tensor parallelism, or consolidation,
    which get whole tensors), or None when there is nothing to load (no `latest`, no tag). `dp_rank`,
    `param_names`, `mesh_rank`, `pipeline`: as `universal.open_source`. CheckpointError when the checkpoint cannot be
    read so."""
    load_dir = Path(load_dir)
    if not _is_tp_layout(load_dir, tag):
        opened = open_source(load_dir, tag, dp_rank=dp_rank, param_names=param_names, mesh_rank=mesh_rank,
                             pipeline=pipeline)
        if opened is None:
            return None
        path, source, rng = opened
        saved = source.extra().get("tensor_parallel")
        if saved is not None:
            raise CheckpointError(f"{path}: holds only tp rank {saved.get('tp_rank')}'s slices of a checkpoint saved "
                                  f"at tp size {saved.get('tp_size')}; read the directory that holds the "
                                  "tp_rank_<RR>/ directories")
        if current is None:
            return path, source, rng
        mesh = source.extra().get("mesh") or {}
        logger.info("checkpoint %s (saved at tp size %d): tp rank %d of %d cuts its slices from the whole tensors",
                    path, int(mesh.get("tp", 1)), current["tp_rank"], current["tp_size"])
        return path, SlicedTPSource(source, current), rng
    if tag is None:
        tag = read_latest(load_dir / _SUBDIR.format(0))
        if tag is None:
            return None
    rank = current["tp_rank"] if current is not None else 0
    own = load_dir / _SUBDIR.format(rank)
    probe_rank = rank if own.is_dir() else 0
    path, probe, rng = _open_rank(load_dir, probe_rank, tag, dp_rank)
    saved = probe.extra().get("tensor_parallel")
    if current is not None and saved == current:  # this tp rank's own slices, as saved
        return path, probe, rng
    if not isinstance(saved, dict) or not isinstance(saved.get("tp_size"), int) or saved["tp_size"] < 1:
        raise CheckpointError(f"{path}: no tensor_parallel record in a tp_rank_<RR>/ checkpoint")
    sources = [probe if r == probe_rank else _open_rank(load_dir, r, tag, dp_rank)[1] for r in range(saved["tp_size"])]
    whole = MergedTPSource(sources, load_dir)
    if probe_rank != rank:
        rng = None  # this tp rank did not exist in the saved run: its generators keep their state
    if current is None:
        return path, whole, rng
    logger.info("checkpoint %s was saved at tp size %d: tp rank %d of %d re-slices its whole tensors", load_dir,
                saved["tp_size"], rank, current["tp_size"])
    return path, SlicedTPSource(whole, current), rng


def _open_rank(load_dir: Path, rank: int, tag: str, dp_rank: int):
    directory = load_dir / _SUBDIR.format(rank)
    if not directory.is_dir():
        raise CheckpointError(f"{load_dir}: no {directory.name}/ (a tp rank's checkpoint is missing)")
    opened = open_source(directory, tag, dp_rank=dp_rank)
    if opened is None:  # a tag was given: open_source returns None only without one
        raise CheckpointError(f"{directory}: no checkpoint {tag}")
    return opened
