"""Engine checkpoints on disk: the layout of `save_dir/<tag>/`, and save / load of an engine's state
through the writer (checksums, atomic publish, optional background writing) and the tag reader.

Layout of a tag directory:
    model_states.pt         rank 0: module state_dict, LR scheduler, loss scaler, counters, client_state
    optim_states.pt         rank 0, when the strategy's state is the same on every rank (stage 0)
    optim_states_rank<R>.pt every rank, when each holds its own part (sharded stages)
    rng_rank<R>.pt          every rank: its python / torch / CUDA (/ numpy) RNG states
    checksums_rank<R>.json  every rank, written last: size and CRC-32s of each file that rank wrote
    module_states_pp<S>.pt  pipeline runs: the module state of stage S (its layers and the tied modules),
                            written by the stage's rank at data-parallel and tp coordinate 0
R is the rank's data-parallel rank (dp x sp), or, in a run over a larger mesh (tensor or pipeline
parallelism), its rank in the whole mesh: every rank then writes, its optimizer-state file holds its
fragments with their placements and mesh coordinates (universal.py's Note), model_states.pt `mesh`
(the sizes) and the whole module state, and the tag is published once for every rank of the mesh.

Note: [pipeline stages] Each stage holds only its layers, so at pp > 1 no rank has the whole module
state: each stage writes its own `module_states_pp<S>.pt`, model_states.pt lists them in
`module_parts` ([file name, writer rank]) and holds an empty `module`, and `load` merges them into
`module` (layers are named by their global index, so the merged state is the whole PipelineModule's,
whatever pp reads it; a tied module, on every stage, is taken from the first). No rank gathers the
model.

Note: [experts] A run with experts (parallel/experts/) saves over the mesh of tp x dp x sp (ep
included): R is the rank in it, each fragment file records the rank's ep and data-parallel coordinates
with its fragments' placements, and the tag holds the ep = 1 model (parallel/experts/names.py's Note on
global names): model_states.pt's `module` every expert, gathered over the ep group, and DeepSpeed-style
experts' fragments under their global names. So the layout does not depend on the saving ep size.

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
from lightspeed.checkpoint.errors import CheckpointAssertionError, CheckpointError
from lightspeed.checkpoint.integrity import manifest_rank
from lightspeed.checkpoint.rng import get_rng_state
from lightspeed.checkpoint.tag_reader import TagReader
from lightspeed.checkpoint.writer import CheckpointWriter
from lightspeed.comm.collectives import Communicator

__all__ = ["MODEL_FILE", "REPLICATED_OPTIM_FILE", "LoadedCheckpoint", "save", "load", "load_tag", "read_rng",
           "optim_file", "rng_file", "strategy_files", "is_tag_dir", "check_save_agreement"]

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


def module_file(pp_rank: int) -> str:
    return f"module_states_pp{pp_rank}.pt"


def _merge_module_parts(reader: TagReader, shared: dict[str, Any]) -> dict[str, Any]:
    """`shared` with `module` the whole module state, merged from the pipeline stages' files that
    `shared["module_parts"]` lists as [file name, writer rank] (an entry on several stages, a tied
    module's, is taken from the first)."""
    parts = shared.get("module_parts")
    if parts is None:
        return shared
    if not isinstance(parts, list) or not parts:
        raise CheckpointError(f"{reader.path / MODEL_FILE}: malformed module_parts {parts!r}")
    module: dict[str, Any] = dict(shared.get("module") or {})
    for entry in parts:
        try:
            name, writer = str(entry[0]), int(entry[1])
        except (TypeError, ValueError, IndexError):
            raise CheckpointError(f"{reader.path / MODEL_FILE}: malformed module_parts entry {entry!r}") from None
        if not reader.lists(name, writer_rank=writer):
            raise CheckpointError(f"{reader.path / name}: a pipeline stage's module-state file is missing")
        part = reader.load(name, writer_rank=writer)
        if not isinstance(part, dict):
            raise CheckpointError(f"{reader.path / name}: not a lightspeed module-state file")
        for key, value in part.items():
            module.setdefault(key, value)
    return {**shared, "module": module}


def _by_rank(values: list[str]) -> str:
    """ "'a' on ranks 0, 2; 'b' on rank 1" (at most 8 ranks named per value)."""
    ranks: dict[str, list[int]] = {}
    for rank, value in enumerate(values):
        ranks.setdefault(value, []).append(rank)
    parts = []
    for value, where in ranks.items():
        shown = ", ".join(map(str, where[:8])) + (f" and {len(where) - 8} more" if len(where) > 8 else "")
        parts.append(f"{value!r} on rank{'s' if len(where) > 1 else ''} {shown}")
    return "; ".join(parts)


def check_save_agreement(save_dir, tag: str, comm: Communicator, tag_validation: str = "WARN") -> str:
    """Every rank of `comm` (the world) must save into the same directory under one tag: one small
    object all-gather; returns the tag every rank saves under. Ranks passing different tags: with
    DeepSpeed's `checkpoint.tag_validation` "Fail" a `CheckpointAssertionError` on every rank naming
    which ranks had which (DeepSpeed asserts); with "Warn" (a warning) or "Ignore" every rank saves under
    rank 0's tag. DeepSpeed lets each rank write its part under its own tag there, which leaves every
    one of those tags incomplete; here rank 0 publishes a tag only once every rank wrote its part in
    it, so the parts go to one tag. Different directories are a `CheckpointError` (rank 0 would wait for
    parts that never come). An empty or missing `save_dir` is refused first (a ValueError, as DeepSpeed's)."""
    if save_dir is None or not os.fspath(save_dir):
        raise CheckpointError(f"save_checkpoint: save_dir must be a non-empty path (got {save_dir!r})")
    if comm.world_size == 1:
        return tag
    gathered = comm.all_gather_object((str(tag), os.path.abspath(os.fspath(save_dir))))
    tags, dirs = [t for t, _ in gathered], [d for _, d in gathered]
    tags_differ, fail = len(set(tags)) > 1, tag_validation.upper() == "FAIL"
    problems = []
    if len(set(dirs)) > 1:
        problems.append(f"save_dir differs between ranks: {_by_rank(dirs)}")
    if tags_differ and fail:
        problems.append(f"the checkpoint tag is not the same on every rank: {_by_rank(tags)} "
                        "(checkpoint.tag_validation is Fail)")
    if problems:
        # DeepSpeed asserts that the tags agree: an AssertionError too when they do not
        error = CheckpointAssertionError if tags_differ and fail else CheckpointError
        raise error("save_checkpoint: " + "; and ".join(problems) + "; pass the same save_dir and tag "
                    "(e.g. from the step count) on every rank")
    if tags_differ:
        log = logger.warning if tag_validation.upper() == "WARN" else logger.info
        log(f"save_checkpoint: the checkpoint tag is not the same on every rank ({_by_rank(tags)}); every rank "
            f"saves its part under rank 0's tag {tags[0]!r} (checkpoint.tag_validation is "
            f"{tag_validation.capitalize()})")
    return tags[0]


def save(save_dir, tag: str, *, shared: dict[str, Any], strategy_state: dict[str, Any], strategy_replicated: bool,
         comm: Communicator, dp_rank: int, save_latest: bool = True, writer: CheckpointWriter | None = None,
         module_part: dict[str, Any] | None = None, pp_rank: int = 0) -> Path:
    """Save this rank's part of the engine state as `save_dir/<tag>/` (collective; the ranks agreed on
    `save_dir` and `tag` first, `check_save_agreement`). With a decoupled `writer` the files are
    written in the background: the tag is complete once `writer.wait(comm)` (or the next save) has
    returned. `module_part`: this rank's pipeline stage's module state, written as
    `module_states_pp<S>.pt` (S = `pp_rank`; the layout's pipeline Note)."""
    tag = validate_tag(tag)
    _check_plain(shared.get("client_state", {}), "client_state")
    files: dict[str, Any] = {}
    if module_part is not None:
        files[module_file(pp_rank)] = module_part
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


def load(load_dir, tag: str | None, *, dp_rank: int, load_strategy: bool = True,
         mesh_rank: int | None = None) -> LoadedCheckpoint | None:
    """Read and verify the shared file and this rank's RNG state of `load_dir/<tag>` (tag None: the one
    `latest` names), and with `load_strategy` this rank's own optimizer-state file; every optimizer-state
    file can be read through `reader` (`strategy_files`), verified as it is opened (what the engine does:
    a run at another world size reads parts of each). Returns None when there is nothing to load (no tag
    given and no `latest`). A checkpoint saved over a mesh (`mesh` in the shared file: every rank of a
    tensor-parallel run wrote its own files) is read as rank `mesh_rank` of it (default `dp_rank`)."""
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
    return load_tag(TagReader(path, tag), dp_rank=dp_rank, load_strategy=load_strategy, mesh_rank=mesh_rank)


def load_tag(reader: TagReader, *, dp_rank: int, load_strategy: bool = True,
             mesh_rank: int | None = None) -> LoadedCheckpoint:
    """`load` of the tag `reader` reads."""
    path = reader.path
    shared = reader.load(MODEL_FILE, writer_rank=0)
    if not isinstance(shared, dict) or "module" not in shared or "counters" not in shared:
        raise CheckpointError(f"{path / MODEL_FILE}: not a lightspeed model_states file")
    shared = _merge_module_parts(reader, shared)
    if shared.get("mesh") is not None and mesh_rank is not None:
        dp_rank = mesh_rank
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
