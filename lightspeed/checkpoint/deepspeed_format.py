"""DeepSpeed's own checkpoints, read as a `TrainingStateSource` (so runs can move over mid-training).

Owns the layout DeepSpeed's engine writes under ``<save_dir>/<tag>/``: ``mp_rank_00_model_states.pt``
(stages 0-2) or ``zero_pp_rank_<r>_mp_rank_00_model_states.pt`` (stage 3, one per rank), and
``[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` (ZeRO, one per data-parallel rank), in fp32,
fp16 and bf16, and at ZeRO 0-2 with MoE experts (their ``layer_<L>_expert_<G>_...`` model files and
expert param groups, deepspeed_moe.py, or without ZeRO an ``expp_rank_<E>_mp_rank_00_optim_states.pt``
per expert-parallel rank, deepspeed_stage0.py: read under the experts' global names, the ep = 1 model's;
AutoEP's layout: deepspeed_autoep.py). Must not: unpickle DeepSpeed's classes (deepspeed_pickle.py turns them into plain data),
read more of a file than a call needs, or write anything.

Note: [where a parameter's fp32 values live]
    Each trainable parameter is a list of *pieces*, (rank, slot, start, length): a range of a 1-D fp32
    tensor, the slot's master values or one of its optimizer states in that rank's file, laid end to end
    and cut to the parameter's numel. Every layout reduces to that:
    - stages 1 and 2 (``DeepSpeedZeroOptimizer``) and the bf16 optimizer (``BF16_Optimizer``, files
      prefixed ``bf16_``, no ``zero_stage`` key): per param group one flat buffer, the parameters of
      ``param_shapes[g]`` end to end (each followed by its ``param_alignment_paddings`` gap, when saved),
      split over the ranks in order; rank r saved its range as ``single_partition_of_fp32_groups[g]``
      (stages 1/2 drop the trailing padding, the bf16 optimizer keeps it). A slot is a group.
    - stage 3: per sub-group (``param_shapes`` has one dict per sub-group) every parameter is padded to
      a multiple of the world size and rank r holds the r-th ``ceil(numel / W)`` elements; a rank's
      ``fp32_flat_groups[k]`` is its parts of sub-group k's parameters end to end. A slot is a sub-group.
    - stage 0: the model file's ``optimizer`` entry (with MoE experts: each ep rank's ``expp_rank`` file,
      a piece's rank its ep rank): a torch optimizer's state (fp32: the masters are
      the module's own parameters), the unfused fp16/bf16 optimizer's ``fp32_groups`` (a tensor per
      parameter) or the fused one's ``fp32_groups_flat`` (a flat tensor per group). Nothing in the
      file names the parameters, so they are matched to the module's parameters in order (see
      `_match_stage0`); pass ``param_names`` when that is ambiguous.
    The optimizer state of a slot (``exp_avg``, ...) has the master's layout (stages 1/2 keep the padding
    on it: only its first elements are read).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Sequence

import torch

from lightspeed._utils.logging import get_logger, warn_once
from lightspeed.checkpoint.atomic import read_latest, validate_tag
from lightspeed.checkpoint.deepspeed_moe import (expert_files, expert_group_ranks, global_name, num_local_experts,
                                                 read_expert_entries)
from lightspeed.checkpoint.deepspeed_pickle import load_deepspeed_file
from lightspeed.checkpoint.errors import CheckpointError
from lightspeed.checkpoint.integrity import verification_enabled, verify_zip
from lightspeed.checkpoint.source import MASTER_KEY
from lightspeed.checkpoint.tag_reader import warn_unverified

__all__ = ["DeepSpeedCheckpointSource", "is_deepspeed_checkpoint", "is_deepspeed_tag_dir", "resolve_deepspeed_tag_dir"]

logger = get_logger(__name__)

_MODEL_FILE = "mp_rank_00_model_states.pt"
_ZERO3_MODEL = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_00_model_states\.pt$")
_OPTIM = re.compile(r"^(bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")
_EXPP = re.compile(r"^expp_rank_(\d+)_mp_rank_00_optim_states\.pt$")  # MoE without ZeRO: per ep rank
_UNSUPPORTED = (
    (re.compile(r"^(zero_pp_rank_\d+_)?mp_rank_(?!00_)\d+_model_states\.pt$"), "model (tensor) parallelism"),
    (re.compile(r"^expert_\d+_mp_rank_.*\.pt$"), "MoE experts in DeepSpeed's older expert_<X> layout"),
    (re.compile(r"^layer_\d+-model_\d+-model_states\.pt$"), "pipeline parallelism"),
)
# Entries of the model file that are DeepSpeed's own; anything else came from save_checkpoint's client_state.
_ENGINE_KEYS = frozenset({
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
    "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config",
    "ds_version", "checkpoint_parallel_dimensions", "pp_degree", "tp_degree", "universal_checkpoint_info",
    "num_experts", "ds_autoep_layers",  # MoE: per MoE layer its number of experts; AutoEP's layers
})


# Pages of a memory-mapped file that were read stay resident (counted in RSS, though the kernel may drop
# them) while the file is mapped; after this many bytes read the optimizer files are unmapped (and
# mapped again when next needed), so a pass over a big checkpoint does not show its whole size as RSS.
_REMAP_AFTER_BYTES = 1 << 30


@dataclass(frozen=True)
class _Param:
    shape: torch.Size
    pieces: tuple[tuple[int, int, int, int], ...]  # (rank, slot, start, length)


def _is_model_file(name: str) -> bool:
    return name == _MODEL_FILE or _ZERO3_MODEL.match(name) is not None


def is_deepspeed_checkpoint(path: str | os.PathLike) -> bool:
    """Whether `path` (a save dir with ``latest`` or tag dirs, or a tag dir) holds DeepSpeed's layout."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        return False
    names = os.listdir(path)
    if any(_is_model_file(n) for n in names):
        return True
    tag = read_latest(path) if os.path.isfile(os.path.join(path, "latest")) else None
    candidates = [tag] if tag else [n for n in names if os.path.isdir(os.path.join(path, n))]
    return any(os.path.isdir(os.path.join(path, c)) and any(_is_model_file(n) for n in os.listdir(os.path.join(path, c)))
               for c in candidates)


def is_deepspeed_tag_dir(path: str | os.PathLike) -> bool:
    """Whether `path` is one tag directory of DeepSpeed's layout (a model-states file is in it)."""
    return os.path.isdir(path) and any(_is_model_file(n) for n in os.listdir(path))


def resolve_deepspeed_tag_dir(checkpoint_dir: str | os.PathLike, tag: str | int | None = None) -> str:
    """The directory holding one checkpoint's files: ``checkpoint_dir/tag``, with `tag` read from
    ``checkpoint_dir/latest`` when None; `checkpoint_dir` itself when it already is a tag directory."""
    checkpoint_dir = os.fspath(checkpoint_dir)
    if not os.path.isdir(checkpoint_dir):
        raise CheckpointError(f"{checkpoint_dir}: checkpoint directory not found")
    if tag is None:
        if any(_is_model_file(n) for n in os.listdir(checkpoint_dir)):
            return checkpoint_dir
        tag = read_latest(checkpoint_dir)
        if tag is None:
            raise CheckpointError(f"{os.path.join(checkpoint_dir, 'latest')}: not found; pass the tag "
                                  f"(one of the checkpoint's directories, e.g. global_step100)")
    tag_dir = os.path.join(checkpoint_dir, validate_tag(tag))
    if not os.path.isdir(tag_dir):
        raise CheckpointError(f"{tag_dir}: checkpoint tag directory not found")
    return tag_dir


def _number(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _hyperparameters(group: dict) -> dict:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items() if k not in ("params", "names")}


class StitchedModuleState(Mapping):
    """A stage-3 module state: entries as saved, but each frozen parameter (saved as one part per rank,
    zero-padded to a multiple of the world size) stitched from its parts when looked up, and not kept,
    so going through the entries holds one frozen parameter at a time. `entry_meta` gives an entry's
    shape and dtype without stitching it. `part_files` names the file of each rank's parts (in rank
    order, one per rank of the world that saved it); a part not found is an error naming its file."""

    def __init__(self, saved: dict, frozen_shapes: dict, load_fragments: Callable[[], list[dict]],
                 part_files: Sequence[str]):
        self._saved = saved
        self._shapes = {n: torch.Size(s) for n, s in frozen_shapes.items()}
        self._load_fragments = load_fragments
        self._part_files = list(part_files)
        self._fragments: list[dict] | None = None
        self._names = list(saved) + [n for n in self._shapes if n not in saved]

    def entry_meta(self, name: str) -> tuple[torch.Size, torch.dtype]:
        if name in self._shapes:
            return self._shapes[name], self._part(0, name).dtype
        return self._saved[name].shape, self._saved[name].dtype

    def _parts(self) -> list[dict]:
        if self._fragments is None:
            fragments = self._load_fragments()
            if len(fragments) != len(self._part_files):
                raise CheckpointError(f"{os.path.dirname(self._part_files[0])}: {len(fragments)} ranks' parts of "
                                      f"the frozen parameters for {len(self._part_files)} rank files")
            self._fragments = fragments
        return self._fragments

    def _part(self, rank: int, name: str) -> torch.Tensor:
        part = self._parts()[rank].get(name) if isinstance(self._parts()[rank], dict) else None
        if not isinstance(part, torch.Tensor):
            raise CheckpointError(f"{self._part_files[rank]}: holds no part of frozen parameter {name} "
                                  "(frozen_param_fragments)")
        return part

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._shapes:
            return self._saved[name]
        shape = self._shapes[name]
        parts = [self._part(r, name).reshape(-1) for r in range(len(self._part_files))]
        numel = shape.numel()
        held = 0
        for rank, part in enumerate(parts):
            if held >= numel:
                break
            held += part.numel()
            if held < numel and rank == len(parts) - 1:
                raise CheckpointError(f"{self._part_files[rank]}: the ranks' parts of frozen parameter {name} hold "
                                      f"{held} of its {numel} elements (a rank's file missing or cut short?)")
        out = torch.empty(numel, dtype=parts[0].dtype)  # every element is written below: held >= numel
        offset = 0
        for part in parts:
            take = min(part.numel(), numel - offset)
            if take <= 0:
                break
            out[offset:offset + take].copy_(part[:take])
            offset += take
        return out.view(shape)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


class DeepSpeedCheckpointSource:
    """A checkpoint DeepSpeed's engine saved, parameter by parameter in fp32 (see `TrainingStateSource`).

    `checkpoint_dir` is the save dir (with ``latest``, or give `tag`) or one tag directory. `param_names`:
    the names of the parameters the optimizer held, in its order, e.g. ``[n for n, p in
    model.named_parameters() if p.requires_grad]``; needed only at stage 0 when the file alone leaves that
    ambiguous (ZeRO files name them, and given names must agree).
    Files are memory-mapped and each is opened when first needed, after the CRC-32s torch stored in it
    are checked (one pass over the file; `verify` False, or None inside `integrity.verification(False)`,
    skips that, with a warning).
    """

    def __init__(self, checkpoint_dir: str | os.PathLike, tag: str | int | None = None, *,
                 param_names: Sequence[str] | None = None, verify: bool | None = None,
                 mp_rank: int | None = None, module: Mapping[str, torch.Tensor] | None = None,
                 verified: set[str] | None = None):
        """`mp_rank`, `module`, `verified`: for one stage of a pipeline checkpoint (deepspeed_pipeline.py):
        the stage's model-parallel rank (its files' `mp_rank_<SS>`), its module state (DeepSpeed's
        pipeline engine saves `module` None and each layer in its own file), and the set of files
        already checked, shared between the stages."""
        self.path = resolve_deepspeed_tag_dir(checkpoint_dir, tag)
        self._verify = verification_enabled() if verify is None else bool(verify)
        self._verified: set[str] = verified if verified is not None else set()
        if not self._verify and mp_rank is None:
            warn_unverified(self.path)
        names = sorted(os.listdir(self.path))
        if mp_rank is None and any(re.match(r"^layer_\d+-model_states\.pt$", n) for n in names):
            raise CheckpointError(f"{self.path}: a DeepSpeed pipeline checkpoint (layer_<XX>-model_states.pt files); "
                                  "read it with deepspeed_pipeline.DeepSpeedPipelineSource")
        for pattern, feature in _UNSUPPORTED[1:] if mp_rank is not None else _UNSUPPORTED:
            found = next((n for n in names if pattern.match(n)), None)
            if found:
                raise CheckpointError(f"{os.path.join(self.path, found)}: DeepSpeed checkpoints with {feature} "
                                      "are not supported")
        mp = 0 if mp_rank is None else int(mp_rank)
        model_name = f"mp_rank_{mp:02d}_model_states.pt"
        self._optim_re = _OPTIM if mp == 0 else re.compile(
            rf"^(bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_{mp:02d}_optim_states\.pt$")
        self._optim_files = self._ranked(names, self._optim_re, group=2)
        self._zero3_model_files = self._ranked(names, _ZERO3_MODEL, group=1) if mp == 0 else []
        model_file = model_name if model_name in names else (self._zero3_model_files[0] if self._zero3_model_files else None)
        if model_file is None:
            raise CheckpointError(f"{self.path}: no {model_name} or zero_pp_rank_0_mp_rank_00_model_states.pt; "
                                  "not a DeepSpeed checkpoint directory")
        self._model_path = os.path.join(self.path, model_file)
        self._model = self._load(self._model_path)
        if not isinstance(self._model, dict) or "module" not in self._model:
            raise CheckpointError(f"{self._model_path}: is not a DeepSpeed model-states file (no 'module' entry)")
        if module is not None:
            self._model = {**self._model, "module": dict(module)}
        elif not isinstance(self._model["module"], Mapping):
            raise CheckpointError(f"{self._model_path}: holds no module state (a pipeline stage's file: its layers "
                                  "are in the layer_<XX>-model_states.pt files)")
        self._expert_files = expert_files(names) if mp == 0 else []  # MoE layers' experts (deepspeed_moe.py)
        self._optim_cache: dict[int, dict] = {}
        self._bytes_since_map = 0
        self._params: dict[str, _Param] = {}
        self._groups: list[dict] = []
        self._loss_scaler: Any = None
        self._state_keys: list[str] = []
        self._expp_files = self._ranked(names, _EXPP, group=1) if mp == 0 else []
        self._experts: dict[str, torch.Tensor] | None = None
        if self._expert_files and not self._optim_files and not self._expp_files:
            raise CheckpointError(f"{self.path}: a DeepSpeed MoE checkpoint ({self._expert_files[0]}) with neither "
                                  "ZeRO optimizer files nor expp_rank_<E>_mp_rank_00_optim_states.pt (saved without "
                                  "ZeRO); a file missing?")
        if self._expp_files and (self._optim_files or not self._expert_files):
            raise CheckpointError(f"{os.path.join(self.path, self._expp_files[0])}: DeepSpeed writes expp_rank_<E> "
                                  "optimizer files for MoE without ZeRO only, beside layer_<L>_expert_<G> files and no "
                                  "ZeRO optimizer files; this directory mixes layouts")
        if self._optim_files:
            self._read_zero_layout()
            # ZeRO files name their parameters; names given anyway must agree with them.
            if param_names is not None and set(param_names) != set(self._params):
                diff = sorted(set(param_names) ^ set(self._params))[:3]
                raise CheckpointError(f"{self.path}: param_names differ from the parameters the checkpoint names "
                                      f"(e.g. {diff})")
        else:
            self._read_stage0_layout(param_names)

    # ------------------------------------------------------------------------------------ files
    def _ranked(self, names: list[str], pattern: re.Pattern, group: int) -> list[str]:
        matches = {int(m.group(group)): m for n in names if (m := pattern.match(n))}
        if not matches:
            return []
        if sorted(matches) != list(range(len(matches))):
            missing = min(set(range(max(matches) + 1)) - set(matches))
            like = matches[max(matches)]
            raise CheckpointError(f"{os.path.join(self.path, self._rank_file(like, group, missing))}: missing "
                                  f"(rank {max(matches)}'s file {like.string} is there)")
        return [matches[r].string for r in range(len(matches))]

    def _check_rank_count(self, files: list[str], pattern: re.Pattern, group: int) -> None:
        if len(files) < self.world_size:
            name = self._rank_file(pattern.match(files[0]), group, len(files))
            raise CheckpointError(f"{os.path.join(self.path, name)}: missing (the checkpoint was saved by "
                                  f"{self.world_size} ranks)")
        if len(files) > self.world_size:
            raise CheckpointError(f"{self.path}: the checkpoint was saved by {self.world_size} ranks but holds "
                                  f"{len(files)} files like {files[0]} (an overwritten or incomplete save?)")

    @staticmethod
    def _rank_file(like: re.Match, group: int, rank: int) -> str:
        """The name of `rank`'s file of the kind `like` (a match of one rank's file name) is."""
        name = like.string
        return name[:like.start(group)] + str(rank) + name[like.end(group):]

    def _load(self, path: str) -> Any:
        # DeepSpeed writes no checksum manifest; torch's zip writer stored a CRC-32 of every record, which
        # torch's reader never checks: checked here, once per file, before anything of it is used
        if self._verify and path not in self._verified:
            if not verify_zip(path):
                warn_once(f"{path}: holds no CRC-32s to check (torch's legacy format, or saved without them); "
                          "read unverified", logger)
            self._verified.add(path)
        return load_deepspeed_file(path, mmap=True)

    def _optim(self, rank: int) -> dict:
        if rank not in self._optim_cache:
            path = os.path.join(self.path, self._optim_files[rank])
            loaded = self._load(path)
            state = loaded.get("optimizer_state_dict") if isinstance(loaded, dict) else None
            if not isinstance(state, dict):
                raise CheckpointError(f"{path}: is not a DeepSpeed optimizer-states file (no 'optimizer_state_dict')")
            self._optim_cache[rank] = state
        return self._optim_cache[rank]

    # ----------------------------------------------------------------------------- ZeRO layouts
    def _read_zero_layout(self) -> None:
        first = self._optim(0)
        path0 = os.path.join(self.path, self._optim_files[0])
        self._bf16_optimizer = "zero_stage" not in first
        self.zero_stage = 1 if self._bf16_optimizer else int(first["zero_stage"])
        counts = first.get("partition_count")
        counts = [int(c) for c in (counts if isinstance(counts, list) else [counts])]
        if self._expert_files and self.zero_stage not in (1, 2):
            raise CheckpointError(f"{path0}: a DeepSpeed MoE checkpoint at ZeRO stage {self.zero_stage}: read at "
                                  "stages 0-2 only (DeepSpeed 0.19.8 refuses its MoE layers at stage 3; AutoEP's "
                                  "layout at ZeRO 0-2: deepspeed_autoep.py)")
        self.world_size = max(counts)
        if (len(set(counts)) != 1 and not self._expert_files) or any(self.world_size % c for c in counts):
            raise CheckpointError(f"{path0}: param groups partitioned over world sizes {counts}, and no "
                                  "layer_<L>_expert_<G> files (not a DeepSpeed MoE checkpoint of this layout)")
        self._counts = counts
        self._check_rank_count(self._optim_files, self._optim_re, 2)
        if self.zero_stage == 3 and self._zero3_model_files:  # each rank's model file holds its frozen parts
            self._check_rank_count(self._zero3_model_files, _ZERO3_MODEL, 1)
        shapes = self._model.get("param_shapes")
        if not isinstance(shapes, list):
            raise CheckpointError(f"{self._model_path}: has no param_shapes (saved without ZeRO?)")
        self._loss_scaler = first.get("loss_scaler")
        if isinstance(self._loss_scaler, dict):
            self._loss_scaler = {**self._loss_scaler, "dynamic_loss_scale": first.get("dynamic_loss_scale")}
        if self.zero_stage in (1, 2):
            self._layout_partitioned_groups(shapes, first)
        elif self.zero_stage == 3:
            self._layout_stage3(shapes, first)
        else:
            raise CheckpointError(f"{path0}: unknown zero_stage {self.zero_stage}")

    def _base_state(self, rank: int) -> Any:
        state = self._optim(rank)
        return state["base_optimizer_state"] if self.zero_stage in (1, 2) else state["optimizer_state_dict"]

    def _layout_partitioned_groups(self, shapes: list[dict], first: dict) -> None:
        key = "single_partition_of_fp32_groups"
        paddings = first.get("param_alignment_paddings")
        local = num_local_experts([n for group_shapes in shapes for n in group_shapes])
        group_names: list[list[str]] = []
        for g, group_shapes in enumerate(shapes):
            count = self._counts[g] if g < len(self._counts) else self.world_size
            # a dense group over every rank; an expert group once per ep rank (deepspeed_moe.py)
            splits = [(list(range(self.world_size)), None)] if count == self.world_size else \
                [(ranks, e) for e, ranks in enumerate(expert_group_ranks(self.world_size, count))]
            group_names.append([])
            align_to = 2 * count
            for ranks, ep_rank in splits:
                lengths = [int(self._optim(r)[key][g].numel()) for r in ranks]
                starts = [sum(lengths[:k]) for k in range(len(ranks) + 1)]
                offset = 0
                for i, (name, shape) in enumerate(group_shapes.items()):
                    shape = torch.Size(shape)
                    numel = shape.numel()
                    pieces = []
                    for k, r in enumerate(ranks):
                        lo, hi = max(offset, starts[k]), min(offset + numel, starts[k + 1])
                        if lo < hi:
                            pieces.append((r, g, lo - starts[k], hi - lo))
                    if ep_rank is not None:
                        renamed = global_name(name, ep_rank, local)
                        if renamed is None:  # e.g. DeepSpeed's AutoEP layers' fused experts.w1 / w2 / w3
                            raise CheckpointError(f"{self.path}: {name} is in an expert param group but is not a "
                                                  "`MoE` layer's expert (deepspeed_experts.<i>); AutoEP's layout is "
                                                  "read by deepspeed_autoep.DeepSpeedAutoEPSource")
                        name = renamed
                    self._params[name] = _Param(shape, tuple(pieces))
                    group_names[g].append(name)
                    offset += numel + (int(paddings[g][i]) if paddings else 0)
                total = starts[-1]
                if offset > total or (not self._bf16_optimizer
                                      and math.ceil(offset / align_to) != math.ceil(total / align_to)):
                    raise CheckpointError(f"{os.path.join(self.path, self._optim_files[ranks[0]])}: param_shapes of "
                                          f"group {g} need {offset} elements but the ranks saved {total}")
        base = self._base_state(0)
        step = first.get("base_optimizer_state_step")
        if isinstance(base, list):  # elastic checkpoint: per group, the state with the padding removed
            self._slot_states = lambda r, s: self._base_state(r)[s]
            self._groups = [{"names": list(gs), "scalars": {}} for gs in group_names]
        else:
            ids = [i for pg in base["param_groups"] for i in pg["params"]]
            self._slot_states = lambda r, s: self._base_state(r)["state"].get(ids[s], {})
            self._groups = [{**_hyperparameters(pg), "names": list(group_names[g]), "scalars": {}}
                            for g, pg in enumerate(base["param_groups"])]
        for g, group in enumerate(self._groups):
            scalars = {k: _number(v) for k, v in self._slot_states(0, g).items() if not self._is_elementwise(v)}
            if step is not None and "step" not in scalars:
                scalars["step"] = _number(step)
            group["scalars"] = scalars
        self._master = lambda r, s: self._optim(r)[key][s]
        self._collect_state_keys(len(shapes))

    def _layout_stage3(self, shapes: list[dict], first: dict) -> None:
        world = self.world_size
        for k, group_shapes in enumerate(shapes):
            offset = 0
            for name, shape in group_shapes.items():
                shape = torch.Size(shape)
                part = math.ceil(shape.numel() / world)
                self._params[name] = _Param(shape, tuple((r, k, offset, part) for r in range(world)))
                offset += part
            saved = int(first["fp32_flat_groups"][k].numel())
            if offset != saved:
                raise CheckpointError(f"{os.path.join(self.path, self._optim_files[0])}: sub-group {k} holds "
                                      f"{saved} elements per rank but param_shapes need {offset}")
        torch_state = first["optimizer_state_dict"]
        ids = [i for pg in torch_state["param_groups"] for i in pg["params"]]
        if len(ids) != len(shapes):
            raise CheckpointError(f"{os.path.join(self.path, self._optim_files[0])}: {len(ids)} optimizer slots "
                                  f"for {len(shapes)} sub-groups")
        self._slot_states = lambda r, s: self._optim(r)["optimizer_state_dict"]["state"].get(ids[s], {})
        self._master = lambda r, s: self._optim(r)["fp32_flat_groups"][s]
        slot = 0
        for pg in torch_state["param_groups"]:
            slots = range(slot, slot + len(pg["params"]))
            slot += len(pg["params"])
            scalars = {k: _number(v) for s in slots[:1] for k, v in self._slot_states(0, s).items()
                       if not self._is_elementwise(v)}
            self._groups.append({**_hyperparameters(pg), "names": [n for s in slots for n in shapes[s]],
                                 "scalars": scalars})
        self._collect_state_keys(len(shapes))

    @staticmethod
    def _is_elementwise(value: Any) -> bool:
        return isinstance(value, torch.Tensor) and value.dim() > 0

    def _collect_state_keys(self, num_slots: int) -> None:
        keys: list[str] = []
        for s in range(num_slots):
            for k, v in self._slot_states(0, s).items():
                if self._is_elementwise(v) and k not in keys:
                    keys.append(k)
        self._state_keys = keys

    # ------------------------------------------------------------------------------- stage 0
    def _read_stage0_layout(self, param_names: Sequence[str] | None) -> None:
        from lightspeed.checkpoint.deepspeed_stage0 import moe_stage0_layout, stage0_layout

        self.zero_stage, self.world_size = 0, int(self._model.get("dp_world_size") or 1)
        if self._expert_files:
            paths = [os.path.join(self.path, f) for f in self._expp_files]
            optimizers = []
            for path in paths:
                loaded = self._load(path)
                if not isinstance(loaded, dict) or "optimizer" not in loaded:
                    raise CheckpointError(f"{path}: is not a DeepSpeed expert-parallel optimizer-states file "
                                          "(no 'optimizer' entry)")
                optimizers.append(loaded["optimizer"])
            layout = moe_stage0_layout(self._model, self._expert_entries(), optimizers, paths, param_names)
        else:
            layout = stage0_layout(self._model, self._model_path, param_names)
        self._params = {n: _Param(shape, pieces) for n, (shape, pieces) in layout.params.items()}
        self._groups, self._loss_scaler = layout.groups, layout.loss_scaler
        self._master, self._slot_states = layout.master, layout.slot_states
        self._state_keys = layout.state_keys
        self._stage0_names = {"frozen_param_names": layout.frozen, "shared_params": layout.shared}

    # ------------------------------------------------------------------------------- protocol
    def param_names(self) -> list[str]:
        return list(self._params)

    def param_shape(self, name: str) -> torch.Size:
        return self._param(name).shape

    def state_keys(self) -> list[str]:
        return list(self._state_keys)

    def _param(self, name: str) -> _Param:
        try:
            return self._params[name]
        except KeyError:
            raise KeyError(f"{self.path}: no trainable parameter named {name!r}") from None

    def read(self, name: str, key: str = MASTER_KEY) -> torch.Tensor:
        param = self._param(name)
        if key != MASTER_KEY and key not in self._state_keys:
            raise KeyError(f"{self.path}: no optimizer state {key!r} (this checkpoint has {self._state_keys})")
        parts = []
        for rank, slot, start, length in param.pieces:
            flat = self._master(rank, slot) if key == MASTER_KEY else self._slot_states(rank, slot).get(key)
            if flat is None:  # a parameter the optimizer has not stepped yet has no state
                flat = torch.zeros(start + length)
            flat = flat.reshape(-1)
            if start + length > flat.numel():
                raise CheckpointError(f"{self.path}: rank {rank}'s {key} of {name} ends at {start + length} but "
                                      f"the file holds {flat.numel()} elements there")
            parts.append(flat.narrow(0, start, length))
        numel = param.shape.numel()
        held = sum(p.numel() for p in parts)
        self._bytes_since_map += sum(p.numel() * p.element_size() for p in parts)
        if held < numel:
            raise CheckpointError(f"{self.path}: the files hold {held} of {name}'s {numel} elements")
        # One copy, in fp32, of exactly the parameter: never a view of a memory-mapped file, and no
        # second temporary the size of the parameter.
        out = torch.empty(numel, dtype=torch.float32)
        offset = 0
        for part in parts:
            take = min(part.numel(), numel - offset)
            if take <= 0:
                break
            out[offset:offset + take].copy_(part[:take])
            offset += take
        del parts
        if self._bytes_since_map >= _REMAP_AFTER_BYTES and self._optim_files:
            self._optim_cache.clear()  # nothing else holds the mapped tensors: `out` is a copy
            self._bytes_since_map = 0
        return out.view(param.shape)

    def module_state(self) -> Mapping[str, torch.Tensor]:
        """The module's state dict as saved. At stage 3 a frozen parameter is saved in parts, one per
        rank: it is stitched together each time it is looked up (see `StitchedModuleState`)."""
        saved = self._model["module"]
        shapes = self._model.get("frozen_param_shapes") or {}
        if self.zero_stage == 3 and shapes and self._model.get("frozen_param_fragments") is not None:
            files = [os.path.join(self.path, f) for f in self._zero3_model_files]
            return StitchedModuleState(saved, shapes, self._frozen_fragments, files)
        out = dict(saved)
        out.update(self._expert_entries())
        return out

    def _expert_entries(self) -> dict[str, torch.Tensor]:
        """Every MoE expert's entries, under its global name (deepspeed_moe.read_expert_entries)."""
        if self._experts is None:
            self._experts = read_expert_entries([(n, os.path.join(self.path, n)) for n in self._expert_files],
                                                self._load, self._model["module"])
        return self._experts

    def _frozen_fragments(self) -> list[dict[str, torch.Tensor]]:
        first = self._model.get("frozen_param_fragments") or {}
        return [first] + [self._load(os.path.join(self.path, f)).get("frozen_param_fragments", {})
                          for f in self._zero3_model_files[1:]]

    def optimizer_groups(self) -> list[dict[str, Any]]:
        return [dict(g, names=list(g["names"]), scalars=dict(g["scalars"])) for g in self._groups]

    def extra(self) -> dict[str, Any]:
        m = self._model
        out = {
            "lr_scheduler": m.get("lr_scheduler"),
            "loss_scaler": self._loss_scaler,
            "counters": {"global_steps": m.get("global_steps"), "global_samples": m.get("global_samples"),
                         "micro_steps": None, "skipped_steps": m.get("skipped_steps")},
            "client_state": {k: v for k, v in m.items() if k not in _ENGINE_KEYS},
            "zero_stage": self.zero_stage,
            "dp_world_size": self.world_size,
            "source": "deepspeed",
            # DeepSpeed's names for what consolidation needs (deepspeed.utils.zero_to_fp32's semantics):
            "buffer_names": list(m.get("buffer_names") or []),
            "frozen_param_names": list((m.get("frozen_param_shapes") or {}).keys()),
            "shared_params": dict(m.get("shared_params") or {}),
            "ds_version": m.get("ds_version"),
            "ds_config": m.get("ds_config"),
        }
        if self.zero_stage == 0:  # DeepSpeed records neither without ZeRO: found from the module itself
            out.update(self._stage0_names)
        return out

    def __repr__(self) -> str:
        return (f"DeepSpeedCheckpointSource({self.path!r}, zero_stage={self.zero_stage}, "
                f"world_size={self.world_size}, params={len(self._params)})")
