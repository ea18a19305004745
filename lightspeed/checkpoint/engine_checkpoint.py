"""Engine checkpoints on disk: the layout of `save_dir/<tag>/` and the protocol that makes a save
atomic across ranks.

Layout of a tag directory:
    model_states.pt         rank 0: module state_dict, LR scheduler, loss scaler, counters, client_state
    optim_states.pt         rank 0, when the strategy's state is the same on every rank (stage 0)
    optim_states_rank<R>.pt every rank, when each holds its own part (sharded stages)
    rng_rank<R>.pt          every rank: its python / torch / CUDA (/ numpy) RNG states

Note (atomic save): every rank writes into `save_dir/.<tag>.tmp/`; after a barrier rank 0 swaps that
directory in place of `save_dir/<tag>` (renames are atomic) and only then writes `latest`. A save
killed at any point therefore leaves `latest` naming a complete checkpoint, and a tag that is being
overwritten is either the old one or the new one, never a mix. Everything is loaded with
`weights_only=True`: no code in a checkpoint runs.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch

from lightspeed._utils.progress import progress
from lightspeed.checkpoint.atomic import atomic_torch_save, fsync_dir, read_latest, safe_torch_load, validate_tag, write_latest
from lightspeed.checkpoint.errors import CheckpointError
from lightspeed.checkpoint.rng import get_rng_state, set_rng_state
from lightspeed.comm.collectives import Communicator

MODEL_FILE = "model_states.pt"
REPLICATED_OPTIM_FILE = "optim_states.pt"

_PLAIN = (str, int, float, bool, type(None), torch.dtype, torch.device, torch.Size)


def _check_plain(obj: Any, where: str) -> None:
    """client_state must hold only what `weights_only=True` loads back: tensors, numbers, strings,
    and lists / tuples / dicts of them. Checked before anything is written."""
    if torch.is_tensor(obj) or isinstance(obj, _PLAIN):
        return
    if isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _check_plain(v, f"{where}[{i}]")
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not isinstance(k, (str, int, float, bool)):
                raise CheckpointError(f"{where}: dict key {k!r} of type {type(k).__name__} cannot be saved safely")
            _check_plain(v, f"{where}[{k!r}]")
        return
    raise CheckpointError(f"{where}: a {type(obj).__name__} cannot be saved in a checkpoint that loads without "
                          "unpickling code; store tensors, numbers, strings, lists or dicts")


def optim_file(dp_rank: int | None) -> str:
    return REPLICATED_OPTIM_FILE if dp_rank is None else f"optim_states_rank{dp_rank}.pt"


def rng_file(dp_rank: int) -> str:
    return f"rng_rank{dp_rank}.pt"


def save(save_dir, tag: str, *, shared: dict[str, Any], strategy_state: dict[str, Any], strategy_replicated: bool,
         comm: Communicator, dp_rank: int, save_latest: bool = True) -> Path:
    tag = validate_tag(tag)
    _check_plain(shared.get("client_state", {}), "client_state")
    save_dir = Path(save_dir)
    final, tmp = save_dir / tag, save_dir / f".{tag}.tmp"
    if dp_rank == 0:
        save_dir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    comm.barrier()
    if dp_rank == 0:
        atomic_torch_save(shared, tmp / MODEL_FILE)
    if not strategy_replicated:
        atomic_torch_save(strategy_state, tmp / optim_file(dp_rank))
    elif dp_rank == 0:
        atomic_torch_save(strategy_state, tmp / optim_file(None))
    atomic_torch_save(get_rng_state(), tmp / rng_file(dp_rank))
    comm.barrier()
    if dp_rank == 0:
        old = save_dir / f".{tag}.old"
        shutil.rmtree(old, ignore_errors=True)
        if final.exists():
            os.replace(final, old)
        os.replace(tmp, final)
        fsync_dir(save_dir)
        shutil.rmtree(old, ignore_errors=True)
        if save_latest:
            write_latest(save_dir, tag)
    comm.barrier()
    return final


def load(load_dir, tag: str | None, *, dp_rank: int, load_strategy: bool = True):
    """Returns `(path, shared, strategy_state)` or None when there is nothing to load. Restores this
    rank's RNG state when the checkpoint has one for it."""
    load_dir = Path(load_dir)
    if tag is None:
        tag = read_latest(load_dir)
        if tag is None:
            return None
    tag = validate_tag(tag)
    path = load_dir / tag
    if not path.is_dir():
        raise CheckpointError(f"{path}: checkpoint directory not found")
    optim = None
    if load_strategy:
        replicated, own = path / optim_file(None), path / optim_file(dp_rank)
        optim = replicated if replicated.exists() else own if own.exists() else None
    rng = path / rng_file(dp_rank)
    files = [f for f in (path / MODEL_FILE, optim, rng if rng.exists() else None) if f is not None]
    # a bar by bytes, advanced file by file: the model and optimizer files are most of a large checkpoint
    sizes = [f.stat().st_size if f.exists() else 0 for f in files]
    with progress(total=sum(sizes), desc=f"loading checkpoint {tag}", unit="B", unit_scale=True,
                  unit_divisor=1024) as bar:
        shared = safe_torch_load(path / MODEL_FILE)
        bar.update(sizes[0])
        if not isinstance(shared, dict) or "module" not in shared or "counters" not in shared:
            raise CheckpointError(f"{path / MODEL_FILE}: not a lightspeed model_states file")
        strategy_state: dict[str, Any] = {}
        if load_strategy and optim is None:
            raise CheckpointError(f"{path}: no optimizer state for data-parallel rank {dp_rank} "
                                  f"(neither {REPLICATED_OPTIM_FILE} nor {optim_file(dp_rank)})")
        if optim is not None:
            strategy_state = safe_torch_load(optim)
            bar.update(sizes[1])
        if rng.exists():
            set_rng_state(safe_torch_load(rng))
            bar.update(sizes[-1])
    return path, shared, strategy_state
