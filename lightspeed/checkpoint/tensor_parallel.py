"""Checkpoints of a tensor-parallel run: where each tp rank's files go, and the record of the layout.

Each rank of a tensor-parallel group holds different slices of the split layers, so the ranks of one tp
column (the same tp rank, every dp rank) write a checkpoint of their own under
`save_dir/tp_rank_<RR>/<tag>/`, through the same atomic protocol as a run without tensor parallelism
(engine_checkpoint.py), and load from there. The module state and the fragments' manifest of each rank
record the layout (`tensor_parallel`: the tp size and rank, and per split parameter its plan style, role,
whole shape and whether the whole tensor is a transposed Conv1D), so a load at another tp size, a tp
checkpoint loaded without tensor parallelism, or a plan that changed, is refused naming what differs.
Loading at another tp size: consolidate with `engine.save_16bit_model` (whole tensors) and load those
weights into a model split at the new size. Must not: communicate (the engine agrees failures).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lightspeed.checkpoint.errors import CheckpointError
from lightspeed.parallel.tensor_parallel import tp_layouts

_SUBDIR = "tp_rank_{:02d}"


def tp_record(module: torch.nn.Module, tp_size: int, tp_rank: int) -> dict[str, Any]:
    """The layout record saved with each tp rank's checkpoint (plain data)."""
    layouts = {name: [layout.style, layout.role, list(layout.full_shape), layout.transposed]
               for name, layout in sorted(tp_layouts(module).items())}
    return {"tp_size": tp_size, "tp_rank": tp_rank, "layouts": layouts}


def tp_save_dir(save_dir, tp_size: int, tp_rank: int) -> Path:
    return Path(save_dir) / _SUBDIR.format(tp_rank) if tp_size > 1 else Path(save_dir)


def tp_load_dir(load_dir, tp_size: int, tp_rank: int) -> Path:
    """Where this tp rank reads; CheckpointError when `load_dir` was written at another tp size."""
    load_dir = Path(load_dir)
    mine = load_dir / _SUBDIR.format(tp_rank)
    if tp_size > 1:
        if not mine.is_dir():
            raise CheckpointError(f"{load_dir}: no {mine.name}/: the checkpoint was not saved by a run with "
                                  f"tensor_parallel.autotp_size={tp_size} (load it at the tp size that saved it)")
        return mine
    if (load_dir / _SUBDIR.format(0)).is_dir() and not (load_dir / "latest").exists():
        raise CheckpointError(f"{load_dir}: the checkpoint was saved with tensor parallelism (tp_rank_<R>/ "
                              "directories); load it with the same tensor_parallel.autotp_size")
    return load_dir


def check_tp_record(saved: dict[str, Any] | None, current: dict[str, Any], where) -> None:
    """CheckpointError when the saved layout is not this run's."""
    if saved is None:
        raise CheckpointError(f"{where}: saved without tensor parallelism; this run has tp size {current['tp_size']}")
    if saved.get("tp_size") != current["tp_size"] or saved.get("tp_rank") != current["tp_rank"]:
        raise CheckpointError(f"{where}: saved by tp rank {saved.get('tp_rank')} of {saved.get('tp_size')}; this "
                              f"rank is tp rank {current['tp_rank']} of {current['tp_size']}")
    if saved.get("layouts") != current["layouts"]:
        differ = sorted(set(map(str, saved.get("layouts") or {})) ^ set(current["layouts"]))
        differ = differ or [n for n in current["layouts"] if saved["layouts"].get(n) != current["layouts"][n]]
        raise CheckpointError(f"{where}: the tensor-parallel plan differs from the saved one (first: {differ[0]})")
