"""Loading a saved training state into any world size and ZeRO stage.

Owns: `LightspeedSource`, lightspeed's own saved fragments seen through the `TrainingStateSource`
protocol (`source.py`), and `read_training_state` / `apply_training_state`, which fill a strategy's
fragments (fp32 masters and optimizer state) from any source, whoever wrote it (at another tensor-parallel
size, through the merging and slicing sources of tensor_parallel.py). Must not: decide which
files a tag holds or check their integrity (`engine_checkpoint.py` does), or touch counters, the LR
schedule or the loss scaler (the engine does).

Note (transactional load): reading and applying are two steps. `read_training_state` reads and checks
everything this rank needs into new tensors (names, shapes, optimizer groups) and changes nothing; only
when every rank has read without error does `apply_training_state` copy it in, so a failed load leaves
the engine as it was. The price is one extra copy of this rank's shard of masters and optimizer state
while loading.

Note (re-slicing): a saved fragment covers elements [start, end) of one flattened parameter. To fill
one of its own fragments a rank reads, from each saved file that holds an overlapping fragment, only the
overlap (files are mapped with mmap, so untouched bytes are never read). No rank ever assembles more
than the parameters it holds a part of, one at a time.

Note (placements): a file of a mesh-wide save (tensor or pipeline parallelism) gives each fragment its
parameter's placement (parallel/placement.py) and the saving rank's mesh coordinates (`tp`, `pp`). A
fragment covers elements of the rank's local tensor; the whole tensor is assembled box by box from the
ranks whose copy counts: along a dim the parameter is sharded over (tp slices, a pipeline stage's
layers) every rank's, along any other only coordinate 0's, unless the file says its strategy
partitioned its state (`partitioned`) and the dim is one the parameter is reduced over (a tied
module of a pipeline, reduced over dp x pp: its pieces are disjoint over pp too; an expert, reduced
over edp x sp and sharded over ep: its pieces are disjoint over edp x sp x ep). An expert-parallel run
records its ep and data-parallel coordinates too (engine_checkpoint.py's Note on experts).

Note (optimizer state): elementwise state (a tensor with one value per element, e.g. exp_avg) is
re-sliced like the masters; scalar state (e.g. "step", or a small tensor of another size) is per optimizer
param group, taken from the first saved tensor of that group, and handed to the optimizer as a Python
number (a tensor with dimensions stays a tensor), so torch's
optimizers (which keep "step" as a tensor) and lightspeed's (an int) each convert it their way in
`load_state_dict`. Optimizer param groups are matched by index; their hyperparameters come from the
checkpoint, as in torch's `Optimizer.load_state_dict`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lightspeed._utils.logging import get_logger
from lightspeed._utils.progress import progress
from lightspeed.checkpoint import engine_checkpoint
from lightspeed.checkpoint.deepspeed_format import (
    is_deepspeed_checkpoint, is_deepspeed_tag_dir, resolve_deepspeed_tag_dir,
)  # fmt: skip
from lightspeed.checkpoint.deepspeed_autoep import open_deepspeed_source
from lightspeed.checkpoint.deepspeed_pipeline import (
    DeepSpeedPipelineSource, PipelineLayout, is_deepspeed_pipeline_tag_dir,
)  # fmt: skip
from lightspeed.checkpoint.errors import CheckpointError
from lightspeed.checkpoint.integrity import verification, verify_zip
from lightspeed.checkpoint.source import MASTER_KEY
from lightspeed.checkpoint.tag_reader import TagReader
from lightspeed.parallel.placement import Placement
from lightspeed.zero.fragments import Fragment, owner_groups

logger = get_logger(__name__)

FORMAT = "fragments"


@dataclass
class _Saved:
    """One saved fragment: which file, which owner tensor, and where; with its parameter's placement and
    the saving rank's mesh coordinates when a tensor-parallel run wrote it (see the Note on placements)."""

    file: int
    name: str
    shape: tuple[int, ...]
    start: int
    end: int
    owner: int
    offset: int
    placement: Placement | None = None
    coords: dict[str, int] | None = None
    partitioned: bool = False  # the saving rank's fragments are disjoint over its placement's reduced_over dims


class OneTensorCache:
    """The last whole tensor read, so the fragments of one parameter (which come in a row) read it once."""

    def __init__(self, produce):
        self._produce, self._key, self._value = produce, None, None

    def range(self, name: str, key: str, start: int, end: int) -> torch.Tensor:
        if self._key != (name, key):
            self._key = self._value = None  # dropped first: never two whole tensors alive
            self._value = self._produce(name, key).reshape(-1)
            self._key = (name, key)
        return self._value[start:end].clone()


def _elementwise(value: Any, owner: torch.Tensor) -> bool:
    """Whether an optimizer state value holds one value per element of its owner tensor (re-sliced on
    load); anything else (a number, a 0-dim "step", a small tensor of the optimizer's own) is per group."""
    return torch.is_tensor(value) and value.dim() > 0 and value.numel() == owner.numel()


def _scalar(value: Any) -> Any:
    """A per-group state value as it is handed back: a number for a number or 0-dim tensor (Note:
    optimizer state), a copy of a tensor with dimensions (an optimizer's own small state)."""
    if torch.is_tensor(value) and value.dim() > 0:
        return value.detach().to("cpu", copy=True)
    if torch.is_tensor(value):
        value = value.item()
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


class LightspeedSource:
    """A lightspeed checkpoint tag (`shared`: its model_states; `files`: its optimizer-state files as
    (name, writer rank), read through `reader`, which verifies each against its checksums) as a
    `TrainingStateSource`. Tensors are mapped (mmap), so only the elements read are brought in."""

    def __init__(self, shared: dict[str, Any], files: list[tuple[str, int]], reader):
        self.shared = shared
        self.paths = [reader.path / name for name, _ in files]
        self.states: list[dict[str, Any]] = []
        self.index: dict[str, list[_Saved]] = {}
        self.order: list[str] = []
        sizes = [p.stat().st_size if p.exists() else 0 for p in self.paths]
        with progress(total=sum(sizes), desc=f"loading checkpoint {reader.path.name}", unit="B", unit_scale=True,
                      unit_divisor=1024) as bar:
            for i, ((name, writer_rank), path) in enumerate(zip(files, self.paths)):
                state = reader.load(name, writer_rank=writer_rank, mmap=True)
                self._open(i, state, path, None if name == engine_checkpoint.REPLICATED_OPTIM_FILE else
                           (writer_rank, len(files)))
                bar.update(sizes[i])
        self._check_coverage()
        self._whole = OneTensorCache(self._read_placed)

    def _open(self, i: int, state: Any, path: Path, shard: tuple[int, int] | None) -> None:
        """Index one verified optimizer-state file's fragments; `shard`: (the rank whose file it is, of how
        many), for one rank's part of a sharded state."""
        if not isinstance(state, dict) or state.get("format") != FORMAT:
            raise CheckpointError(f"{path}: not a lightspeed optimizer-state file of the fragments layout "
                                  "(written by an older lightspeed, or not a checkpoint file)")
        # a file of a mesh-wide save (tensor parallelism) is named by the rank's place in the whole mesh
        said = (state.get("mesh_rank", state.get("dp_rank")), state.get("mesh_size", state.get("dp_world_size")))
        if shard is not None and said != shard:
            raise CheckpointError(f"{path}: holds the part of rank {said[0]} of {said[1]}, not of rank "
                                  f"{shard[0]} of {shard[1]} (a file from another checkpoint?)")
        owners = state.get("owners")
        if not isinstance(owners, list) or not all(isinstance(state.get(k), list) and len(state[k]) == len(owners)
                                                   for k in ("owner_groups", "state")):
            raise CheckpointError(f"{path}: its owners, owner_groups and state do not agree (malformed)")
        self.states.append(state)
        placed, coords = state.get("placements"), state.get("mesh_coords")
        if (placed is None) != (coords is None) or (placed is not None and not (
                isinstance(placed, dict) and isinstance(coords, dict))):
            raise CheckpointError(f"{path}: malformed placements or mesh coordinates")
        for entry in state["fragments"]:
            try:
                name, shape, start, end, owner, offset = entry
                placement = Placement.from_record(str(name), placed[str(name)]) if placed is not None else None
                saved = _Saved(i, str(name), tuple(int(s) for s in shape), int(start), int(end), int(owner),
                               int(offset), placement, {str(k): int(v) for k, v in coords.items()} if coords else None,
                               bool(state.get("partitioned", False)))
                if placement is not None and placement.local_shape != saved.shape:
                    raise ValueError(f"its placement holds {placement.local_shape}, the fragment says {saved.shape}")
                numel = state["owners"][saved.owner].numel()
            except (TypeError, ValueError, IndexError, AttributeError, KeyError) as err:
                raise CheckpointError(f"{path}: malformed fragment entry {entry!r} ({err})") from None
            if not 0 <= saved.start < saved.end or saved.offset + saved.end - saved.start > numel:
                raise CheckpointError(f"{path}: fragment of {saved.name} lies outside its tensor")
            if saved.name not in self.index:
                self.order.append(saved.name)
            self.index.setdefault(saved.name, []).append(saved)

    def _check_coverage(self) -> None:
        """Every saved parameter's elements are all in some file."""
        for name, pieces in self.index.items():
            if any(p.placement is not None for p in pieces):
                self._check_placed(name, pieces)
                continue
            if len({p.shape for p in pieces}) != 1:
                raise CheckpointError(f"{self.paths[0].parent}: parameter {name} saved with different shapes")
            pos = _covered_to(pieces)
            numel = _numel(pieces[0].shape)
            if pos < numel:
                raise CheckpointError(f"{self.paths[0].parent}: parameter {name}: elements {pos}.. are in no saved "
                                      f"file (a rank's optimizer-state file is missing?)")

    def _check_placed(self, name: str, pieces: list[_Saved]) -> None:
        """A placed parameter: every box of its whole tensor is held by some rank whose copy counts, and
        that rank's pieces cover its whole local tensor."""
        if any(p.placement is None for p in pieces) or len({p.placement.global_shape for p in pieces}) != 1:
            raise CheckpointError(f"{self.paths[0].parent}: parameter {name} saved with different placements")
        volume = 0
        for placement, held in self._placed_groups(name).items():
            pos = _covered_to(held)
            if pos < _numel(placement.local_shape):
                raise CheckpointError(f"{self.paths[0].parent}: parameter {name}: elements {pos}.. of the slice "
                                      f"{[list(b) for b in placement.boxes]} are in no saved file (a rank's "
                                      "optimizer-state file is missing?)")
            volume += _numel(placement.local_shape)
        if volume != _numel(pieces[0].placement.global_shape):
            raise CheckpointError(f"{self.paths[0].parent}: parameter {name}: the saved slices cover {volume} of "
                                  f"{_numel(pieces[0].placement.global_shape)} elements (a rank's file is missing?)")

    def _placed_groups(self, name: str) -> dict[Placement, list[_Saved]]:
        """The pieces of a placed parameter by the slice they belong to, from the ranks whose copy counts
        (a slice replicated over a mesh dim is read from coordinate 0 of it, zero/norm.py's rule, unless
        the saving strategy partitioned the parameter's state over that dim: a tied module of a pipeline
        is reduced, and so partitioned at ZeRO 1-2, over pp, its pieces disjoint across the stages)."""
        groups: dict[Placement, list[_Saved]] = {}
        for p in self._pieces(name):
            dims = [d for d in p.coords if not (p.partitioned and d in p.placement.reduced_over)]
            if p.placement.counts_on(p.coords, dims):
                groups.setdefault(p.placement, []).append(p)
        return groups

    def read_slice(self, name: str, key: str, placement: Placement) -> torch.Tensor | None:
        """The local tensor of `placement` when the checkpoint holds exactly that slice (a run resumed at
        the layout it saved: only that slice's pieces are read), else None."""
        pieces = self._pieces(name)
        if pieces[0].placement is None:
            return None
        held = [p for p in pieces if p.placement == placement]
        return self._local(name, key, placement, held) if held else None

    def _local(self, name: str, key: str, placement: Placement, held: list[_Saved]) -> torch.Tensor:
        """One slice's local tensor from its pieces."""
        local = torch.empty(_numel(placement.local_shape), dtype=torch.float32)
        for p in held:
            local[p.start:p.end].copy_(self._tensor(p, name, key).reshape(-1)[p.offset:p.offset + p.end - p.start])
        return local.view(placement.local_shape)

    def _read_placed(self, name: str, key: str) -> torch.Tensor:
        """The whole tensor of a placed parameter: each slice assembled from its pieces, then written into
        its boxes."""
        groups = self._placed_groups(name)
        whole = torch.empty(next(iter(groups)).global_shape, dtype=torch.float32)
        for placement, held in groups.items():
            placement.place_into(whole, self._local(name, key, placement, held))
        return whole

    def _tensor(self, p: _Saved, name: str, key: str) -> torch.Tensor:
        state = self.states[p.file]
        tensor = state["owners"][p.owner] if key == MASTER_KEY else state["state"][p.owner].get(key)
        if tensor is None:
            raise KeyError(f"parameter {name} has no optimizer state {key!r} in {self.paths[p.file].name}")
        return tensor

    # ------------------------------------------------------------------ TrainingStateSource
    def param_names(self) -> list[str]:
        return list(self.order)

    def param_shape(self, name: str) -> torch.Size:
        first = self._pieces(name)[0]
        return torch.Size(first.placement.global_shape if first.placement is not None else first.shape)

    def state_keys(self) -> list[str]:
        """The elementwise state keys (Note: optimizer state): tensors of one value per element of their owner."""
        keys: list[str] = []
        for state in self.states:
            for owner, owner_state in zip(state["owners"], state["state"]):
                for k, v in owner_state.items():
                    if _elementwise(v, owner) and k not in keys:
                        keys.append(k)
        return keys

    def read(self, name: str, key: str = MASTER_KEY) -> torch.Tensor:
        if self._pieces(name)[0].placement is not None:
            return self._read_placed(name, key)
        shape = self.param_shape(name)
        return self.read_range(name, key, 0, _numel(shape)).view(shape)

    def module_state(self) -> dict[str, torch.Tensor]:
        return dict(self.shared.get("module") or {})

    def optimizer_groups(self) -> list[dict[str, Any]]:
        hyper = self.states[0]["param_groups"] if self.states else []
        groups = [{**{k: v for k, v in h.items()}, "names": [], "scalars": None} for h in hyper]
        for name in self.order:
            piece = self._pieces(name)[0]
            gi = self.states[piece.file]["owner_groups"][piece.owner]
            if 0 <= gi < len(groups):
                groups[gi]["names"].append(name)
        for state in self.states:
            for gi, owner, owner_state in zip(state["owner_groups"], state["owners"], state["state"]):
                if 0 <= gi < len(groups) and groups[gi]["scalars"] is None and owner_state:
                    groups[gi]["scalars"] = {k: _scalar(v) for k, v in owner_state.items()
                                             if not _elementwise(v, owner)}
        for g in groups:
            g["scalars"] = g["scalars"] or {}
        return groups

    def extra(self) -> dict[str, Any]:
        shared = self.shared
        return {"lr_scheduler": shared.get("lr_scheduler"), "loss_scaler": shared.get("loss_scaler"),
                "counters": shared.get("counters"), "client_state": shared.get("client_state"),
                "zero_stage": shared.get("zero_stage"), "dp_world_size": shared.get("dp_world_size"),
                "excluded_frozen_parameters": shared.get("excluded_frozen_parameters"),
                "tensor_parallel": shared.get("tensor_parallel"), "mesh": shared.get("mesh"), "source": "lightspeed",
                # which module-state entries are buffers / frozen parameters (None: saved before recorded)
                "buffer_names": shared.get("buffer_names"), "frozen_param_names": shared.get("frozen_param_names")}

    # ------------------------------------------------------------------ ranges
    def _pieces(self, name: str) -> list[_Saved]:
        try:
            return self.index[name]
        except KeyError:
            raise KeyError(f"parameter {name} is not in the checkpoint") from None

    def has_state(self, name: str, key: str) -> bool:
        return all(key in self.states[p.file]["state"][p.owner] for p in self._pieces(name))

    def read_range(self, name: str, key: str, start: int, end: int) -> torch.Tensor:
        """Elements [start, end) of flattened parameter `name`'s `key` tensor, fp32, on the CPU."""
        if self._pieces(name)[0].placement is not None:  # whole tensors assembled from slices, one at a time
            return self._whole.range(name, key, start, end)
        out = torch.empty(end - start, dtype=torch.float32)
        filled = 0
        for p in self._pieces(name):
            a, b = max(start, p.start), min(end, p.end)
            if a >= b:
                continue
            src = self._tensor(p, name, key).reshape(-1)[p.offset + a - p.start:p.offset + b - p.start]
            out[a - start:b - start].copy_(src)
            filled += b - a
        if filled < end - start:  # pieces do not overlap, so a shortfall means a gap
            raise CheckpointError(f"parameter {name}: elements [{start}, {end}) are not all in the checkpoint")
        return out


def open_source(load_dir, tag: str | None = None, *, dp_rank: int = 0, param_names=None, mesh_rank: int | None = None,
                pipeline: PipelineLayout | None = None):
    """The checkpoint in `load_dir` (tag, or the one `latest` names) as `(path, source, rng_state)`, or None
    when there is no `latest` and no tag. lightspeed's layout gives a `LightspeedSource` and `dp_rank`'s saved
    RNG state (or None); DeepSpeed's layout a `DeepSpeedCheckpointSource`, or of AutoEP training a
    `DeepSpeedAutoEPSource` (`param_names`: the module's
    trainable parameter names in order, which DeepSpeed's stage-0 files do not record) and no RNG state,
    which DeepSpeed's engine does not save. A checkpoint saved over a mesh (tensor parallelism: `mesh` in its
    shared file) keeps one RNG state per rank of the mesh: `mesh_rank`'s is returned there. DeepSpeed's
    pipeline layout gives a `DeepSpeedPipelineSource`, whose layer files `pipeline` (the PipelineModule
    loading it) names."""
    if is_deepspeed_checkpoint(load_dir):
        tag_path = resolve_deepspeed_tag_dir(load_dir, tag)
        if is_deepspeed_pipeline_tag_dir(tag_path):
            source = DeepSpeedPipelineSource(tag_path, layout=pipeline)
            return Path(source.path), source, None
        source = open_deepspeed_source(load_dir, tag, param_names=param_names)  # AutoEP's layout too
        return Path(source.path), source, None
    loaded = engine_checkpoint.load(load_dir, tag, dp_rank=dp_rank, load_strategy=False, mesh_rank=mesh_rank)
    if loaded is None:
        return None
    return loaded.path, _lightspeed_source(loaded), loaded.rng_state


def _lightspeed_source(loaded: engine_checkpoint.LoadedCheckpoint) -> LightspeedSource:
    return LightspeedSource(loaded.shared, engine_checkpoint.strategy_files(loaded.reader), loaded.reader)


def check_tag(path, tag: str) -> tuple[list[str], list[str]]:
    """`lightspeed checkpoint verify` of one lightspeed tag directory: every file against its manifest,
    then what a load of the tag checks (`open_source`'s reads and checks, for every rank of the world that
    saved it: manifests and rank count agree, every rank's optimizer-state file is there and holds that
    rank's part, fragments cover every parameter, model_states and RNG files are lightspeed's), short of
    comparing with a model. A tag directory of DeepSpeed's layout is checked as its reader checks it: every
    file against the CRC-32s stored in it, and every rank's files there. Returns `(problems, notes)`: no
    problems when a load would find none."""
    if is_deepspeed_tag_dir(path):
        return _check_deepspeed_tag(Path(path))
    with verification(True):
        try:
            reader = TagReader(path, tag)
        except CheckpointError as err:
            return [str(err)], []
        problems, notes = reader.verify_all()
        if problems:  # a load stops at the first damaged file: nothing more to learn from reading them
            return problems, notes
        try:
            _lightspeed_source(engine_checkpoint.load_tag(reader, dp_rank=0, load_strategy=False))
            for rank in range(1, reader.num_ranks or 1):
                engine_checkpoint.read_rng(reader, rank)
        except (CheckpointError, KeyError, ValueError, RuntimeError) as err:  # what load_checkpoint refuses on
            problems.append(str(err) if isinstance(err, CheckpointError) else f"{path}: {type(err).__name__}: {err}")
    return problems, notes


def _check_deepspeed_tag(path: Path) -> tuple[list[str], list[str]]:
    problems: list[str] = []
    notes: list[str] = []
    for file in sorted(p for p in path.iterdir() if p.is_file() and p.suffix == ".pt"):
        try:
            if not verify_zip(file):
                notes.append(f"{file}: holds no CRC-32s to check (torch's legacy format, or saved without them)")
        except CheckpointError as err:
            problems.append(str(err))
    if not problems:
        try:
            if not is_deepspeed_pipeline_tag_dir(path):
                open_deepspeed_source(path, verify=False)  # every file was just checked
            elif any(p.name.endswith("_optim_states.pt") for p in path.iterdir()):
                DeepSpeedPipelineSource(path, verify=False)
            else:  # without ZeRO a stage's optimizer names its parameters by position: needs the model
                notes.append(f"{path}: a pipeline checkpoint without ZeRO: which parameter each stage's optimizer "
                             "state is, is checked when it is loaded into its PipelineModule")
        except CheckpointError as err:
            problems.append(str(err))
    return problems, notes


def _covered_to(pieces) -> int:
    """How far from element 0 the pieces' [start, end) ranges cover a flattened tensor without a gap."""
    pos = 0
    for a, b in sorted((p.start, p.end) for p in pieces):
        if a > pos:
            break
        pos = max(pos, b)
    return pos


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


@dataclass
class TrainingState:
    """What one rank read, ready to apply: a master piece per fragment and the optimizer's state dict."""

    masters: list[tuple[Fragment, torch.Tensor]] = field(default_factory=list)
    optimizer_state: dict[str, Any] | None = None


def _read_piece(source, name: str, key: str, start: int, end: int) -> torch.Tensor:
    if hasattr(source, "read_range"):
        return source.read_range(name, key, start, end)
    return source.read(name, key).reshape(-1)[start:end].to(torch.float32)


def has_state(source, name: str, key: str) -> bool:
    """Whether `source` holds optimizer state `key` of parameter `name`."""
    if hasattr(source, "has_state"):
        return source.has_state(name, key)
    try:
        source.read(name, key)
    except KeyError:
        return False
    return True


def read_training_state(source, fragments: list[Fragment], optimizer: torch.optim.Optimizer | None, *,
                        load_optimizer_states: bool = True) -> TrainingState:
    """Read (and check) everything `fragments` and `optimizer` need from `source`; change nothing."""
    names = set(source.param_names())
    out = TrainingState()
    for f in fragments:
        if f.name not in names:
            raise CheckpointError(f"checkpoint has no fp32 value for parameter {f.name} (saved: "
                                  f"{', '.join(sorted(names)[:6])}{', ...' if len(names) > 6 else ''})")
        saved_shape = tuple(source.param_shape(f.name))
        if saved_shape != tuple(f.shape):
            raise CheckpointError(f"checkpoint: parameter {f.name} has shape {saved_shape}, the model's is "
                                  f"{tuple(f.shape)}")
        out.masters.append((f, _read_piece(source, f.name, MASTER_KEY, f.start, f.end)))
    if load_optimizer_states and optimizer is not None:
        out.optimizer_state = _optimizer_state(source, fragments, optimizer)
    return out


def _optimizer_state(source, fragments: list[Fragment], optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
    """A state dict in torch's `Optimizer.state_dict()` form for `optimizer`'s current tensors."""
    saved_groups = _unsplit_moe_groups(source.optimizer_groups(), len(optimizer.param_groups))
    if not saved_groups:  # saved without an optimizer (e.g. converted from a model's weights): start fresh
        logger.info("checkpoint holds no optimizer state: the optimizer starts from its initial state")
        return None
    if len(saved_groups) != len(optimizer.param_groups):
        raise CheckpointError(f"checkpoint: the optimizer had {len(saved_groups)} param groups, this one has "
                              f"{len(optimizer.param_groups)} (pass load_optimizer_states=False to load the "
                              "weights only)")
    keys = source.state_keys()
    group_of = owner_groups(optimizer)
    by_owner: dict[int, list[Fragment]] = {}
    for f in fragments:
        by_owner.setdefault(id(f.owner), []).append(f)
    state: dict[int, dict[str, Any]] = {}
    param_groups = []
    index = 0
    for gi, group in enumerate(optimizer.param_groups):
        hyper = {k: v for k, v in saved_groups[gi].items() if k not in ("names", "scalars")}
        ids = []
        for tensor in group["params"]:
            ids.append(index)
            frags = by_owner.get(id(tensor), [])
            held = [f for f in frags if any(has_state(source, f.name, k) for k in keys)]
            if held and group_of.get(id(tensor)) == gi:
                entry: dict[str, Any] = dict(saved_groups[gi]["scalars"])
                for key in keys:  # only the keys its parameters had (Muon: momentum here, Adam moments there)
                    present = [f for f in frags if has_state(source, f.name, key)]
                    if not present:
                        continue
                    buf = torch.zeros(tensor.numel(), dtype=torch.float32)
                    for f in present:
                        buf[f.offset:f.offset + f.numel] = _read_piece(source, f.name, key, f.start, f.end)
                    entry[key] = buf.view(tensor.shape)
                state[index] = entry
            index += 1
        param_groups.append({**hyper, "params": ids})
    return {"state": state, "param_groups": param_groups}


def _unsplit_moe_groups(saved: list[dict[str, Any]], count: int) -> list[dict[str, Any]]:
    """DeepSpeed gives MoE experts param groups of their own (`moe` True, named after their ep size, with
    the hyperparameters of the group they came from: its AutoEP always does): for an optimizer of `count`
    groups that keeps the experts in their group, each such group joins the one before it when their
    hyperparameters and scalars agree. Anything else is returned as saved."""
    if len(saved) <= count or not any(g.get("moe") for g in saved):
        return saved

    def hyper(g: dict) -> dict:
        return {k: v for k, v in g.items() if k not in ("names", "name", "moe")}

    out: list[dict[str, Any]] = []
    for g in saved:
        if g.get("moe") and out and hyper(g) == hyper(out[-1]):
            out[-1] = {**out[-1], "names": out[-1]["names"] + g["names"]}
        else:
            out.append(g)
    return out if len(out) == count else saved


def apply_training_state(state: TrainingState, optimizer: torch.optim.Optimizer | None) -> None:
    """Copy what `read_training_state` read into the fragments' owners and the optimizer. The caller
    then makes the low-precision parameters follow the masters (`strategy.masters_loaded()`)."""
    with torch.no_grad():
        for f, values in state.masters:
            f.master_view().copy_(values)
    if state.optimizer_state is not None and optimizer is not None:
        optimizer.load_state_dict(state.optimizer_state)
