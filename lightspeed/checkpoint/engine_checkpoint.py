"""Engine checkpoints on disk: the layout of `save_dir/<tag>/`, and save / load of an engine's state
through the writer (checksums, atomic publish, optional background writing) and the tag reader.

Layout of a tag directory:
    model_states.pt         rank 0: module state_dict, LR scheduler, loss scaler, counters, client_state
    optim_states.pt         rank 0, when the strategy's state is the same on every rank (stage 0)
    optim_states_rank<R>.pt every rank, when each holds its own part (sharded stages)
    rng_rank<R>.pt          every rank: its python / torch / CUDA (/ numpy) RNG states
    checksums_rank<R>.json  every rank, written last: size and CRC-32s of each file that rank wrote

Note (atomic save, verified load): every rank writes into `save_dir/.<tag>.tmp/`; rank 0 publishes
it as `save_dir/<tag>` once every rank's manifest is there, and only then writes `latest`
(tag_dir.py and writer.py say how, and why a kill at any instant leaves `latest` naming a complete
checkpoint, old or new). `load` reads and verifies every file it returns before it returns; a
damaged, truncated or missing file (a checksum manifest included, unless the caller turned
verification off) is one `CheckpointError` naming the file (and the tensor), and
nothing is applied to the caller's state: even the RNG state is handed back, not set. Everything
is loaded with `weights_only=True`: no code in a checkpoint runs.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, NamedTuple

import torch

from lightspeed._utils.logging import get_logger
from lightspeed.checkpoint import tag_dir
from lightspeed.checkpoint.atomic import read_latest, validate_tag
from lightspeed.checkpoint.errors import CheckpointError
from lightspeed.checkpoint.integrity import manifest_rank
from lightspeed.checkpoint.rng import get_rng_state
from lightspeed.checkpoint.tag_reader import TagReader
from lightspeed.checkpoint.writer import CheckpointWriter
from lightspeed.comm.collectives import Communicator

__all__ = ["MODEL_FILE", "REPLICATED_OPTIM_FILE", "LoadedCheckpoint", "save", "load", "load_tag", "read_rng",
           "optim_file", "rng_file", "strategy_files", "is_tag_dir", "check_tag_agreement"]

logger = get_logger(__name__)

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


def check_tag_agreement(tag: str, comm: Communicator, mode: str = "WARN") -> None:
    """DeepSpeed's `checkpoint.tag_validation`: every rank must save the same tag. "IGNORE" skips the
    check; "WARN" logs a mismatch; "FAIL" raises. Collective (one small object all-gather) unless IGNORE."""
    mode = mode.upper()
    if mode == "IGNORE" or comm.world_size == 1:
        return
    tags = comm.all_gather_object(tag)
    if len(set(tags)) == 1:
        return
    shown = ", ".join(f"{t!r}" for t in sorted(set(tags))[:4])
    message = (f"checkpoint tag {tag!r} is not the same on every rank (saw {shown}); pass the same tag (e.g. from "
               "the step count) on all ranks")
    if mode == "FAIL":
        raise CheckpointError(message + " (checkpoint.tag_validation is Fail)")
    logger.warning(message)


def save(save_dir, tag: str, *, shared: dict[str, Any], strategy_state: dict[str, Any], strategy_replicated: bool,
         comm: Communicator, dp_rank: int, save_latest: bool = True, writer: CheckpointWriter | None = None,
         tag_validation: str = "WARN") -> Path:
    """Save this rank's part of the engine state as `save_dir/<tag>/` (collective). With a decoupled
    `writer` the files are written in the background: the tag is complete once `writer.wait(comm)`
    (or the next save) has returned."""
    tag = validate_tag(tag)
    _check_plain(shared.get("client_state", {}), "client_state")
    check_tag_agreement(tag, comm, tag_validation)
    files: dict[str, Any] = {}
    if dp_rank == 0:
        files[MODEL_FILE] = shared
    if not strategy_replicated:
        files[optim_file(dp_rank)] = strategy_state
    elif dp_rank == 0:
        files[optim_file(None)] = strategy_state
    files[rng_file(dp_rank)] = get_rng_state()
    writer = writer if writer is not None else CheckpointWriter()
    return writer.save(save_dir, tag, files, comm=comm, dp_rank=dp_rank, num_ranks=comm.world_size,
                       save_latest=save_latest)


def strategy_files(reader: TagReader) -> list[tuple[str, int]]:
    """The optimizer-state files of a tag as (file name, writer rank): the replicated one, or one per
    data-parallel rank of the run that saved it (all of them: a run at another world size reads parts of
    each)."""
    if reader.lists(optim_file(None), writer_rank=0):
        return [(optim_file(None), 0)]
    if reader.num_ranks is not None:
        ranks = list(range(reader.num_ranks))
    else:  # read unverified: the files present say how many ranks wrote
        found = [p.name[len("optim_states_rank"):-3] for p in reader.path.glob("optim_states_rank*.pt")]
        ranks = sorted(int(r) for r in found if r.isdigit())
        if ranks != list(range(len(ranks))):
            missing = sorted(set(range(max(ranks) + 1)) - set(ranks))
            raise CheckpointError(f"{reader.path}: optimizer-state file of data-parallel rank {missing[0]} is missing")
    if not ranks:
        raise CheckpointError(f"{reader.path}: no optimizer state (neither {REPLICATED_OPTIM_FILE} nor "
                              "optim_states_rank<R>.pt)")
    for r in ranks:
        if not reader.lists(optim_file(r), writer_rank=r):
            why = f" (rank {r}'s checksum manifest does not list it)" if reader.has_checksums else ""
            raise CheckpointError(f"{reader.path / optim_file(r)}: optimizer-state file of data-parallel rank {r} "
                                  f"is missing{why}")
    return [(optim_file(r), r) for r in ranks]


class LoadedCheckpoint(NamedTuple):
    """What `load` read, verified (nothing of it applied yet), and the reader for the tag's other files."""

    path: Path
    shared: dict[str, Any]
    strategy_state: dict[str, Any]  # this rank's own optimizer-state file ({} unless asked for)
    rng_state: dict[str, Any] | None  # None when the checkpoint has none for this rank
    reader: TagReader


def load(load_dir, tag: str | None, *, dp_rank: int, load_strategy: bool = True) -> LoadedCheckpoint | None:
    """Read and verify the shared file and this rank's RNG state of `load_dir/<tag>` (tag None: the one
    `latest` names), and with `load_strategy` this rank's own optimizer-state file; every optimizer-state
    file can be read through `reader` (`strategy_files`), verified as it is opened (what the engine does:
    a run at another world size reads parts of each). Returns None when there is nothing to load (no tag
    given and no `latest`)."""
    load_dir = Path(load_dir)
    if tag is None:
        tag = read_latest(load_dir)
        if tag is None:
            return None
    tag = validate_tag(tag)
    path = tag_dir.resolve(load_dir, tag)
    if path.name != tag:
        logger.warning("%s: a save of tag %s was interrupted while replacing it; loading the previous, complete "
                       "one from %s", load_dir / tag, tag, path)
    return load_tag(TagReader(path, tag), dp_rank=dp_rank, load_strategy=load_strategy)


def load_tag(reader: TagReader, *, dp_rank: int, load_strategy: bool = True) -> LoadedCheckpoint:
    """`load` of the tag `reader` reads."""
    path = reader.path
    shared = reader.load(MODEL_FILE, writer_rank=0)
    if not isinstance(shared, dict) or "module" not in shared or "counters" not in shared:
        raise CheckpointError(f"{path / MODEL_FILE}: not a lightspeed model_states file")
    strategy_state: dict[str, Any] = {}
    if load_strategy:
        name, writer = next(((n, r) for n, r in strategy_files(reader) if r == dp_rank or n == optim_file(None)),
                            (None, None))
        if name is None:
            raise CheckpointError(f"{path}: no optimizer state for data-parallel rank {dp_rank}")
        strategy_state = reader.load(name, writer_rank=writer)
    return LoadedCheckpoint(path, shared, strategy_state, read_rng(reader, dp_rank), reader)


def read_rng(reader: TagReader, dp_rank: int) -> dict[str, Any] | None:
    """Data-parallel rank `dp_rank`'s saved RNG state, verified; None when the tag has none for it."""
    if not reader.lists(rng_file(dp_rank), writer_rank=dp_rank):
        logger.info("%s: no RNG state for data-parallel rank %d (saved by %s ranks); the generators keep their state",
                    reader.path, dp_rank, reader.num_ranks if reader.num_ranks is not None else "fewer")
        return None
    rng_state = reader.load(rng_file(dp_rank), writer_rank=dp_rank)
    if not isinstance(rng_state, dict):
        raise CheckpointError(f"{reader.path / rng_file(dp_rank)}: not a lightspeed RNG state file")
    return rng_state


def is_tag_dir(path) -> bool:
    """Whether `path` is one tag directory of lightspeed's layout (its model_states file or a checksum
    manifest is there), rather than a save directory holding tags."""
    path = Path(path)
    return path.is_dir() and ((path / MODEL_FILE).is_file() or any(manifest_rank(n) is not None
                                                                     for n in os.listdir(path)))
