"""DeepSpeed 0.19.8's checkpoints of AutoEP training (`expert_parallel.enabled` at ZeRO 0-2), read as a
`TrainingStateSource` under the Hugging Face model's own names, the whole model's tensors (so a run with
AutoEP at any autoep_size, or the plain model, loads them: checkpoint/experts.py cuts a rank's rows).

Owns: telling such a checkpoint apart (`is_autoep_tag_dir`, `open_deepspeed_source`), its layout and
the renaming. Must not: unpickle DeepSpeed's classes (deepspeed_pickle.py), read the classic MoE layout
(deepspeed_format.py / deepspeed_moe.py), or write anything.

Note: [the layout] DeepSpeed replaces each MoE block P (e.g. `model.layers.0.mlp`) by an
`AutoEPMoELayer`: the router becomes `P.router.gate.*` (its own module, `P.router.*` for the rest of
it, e.g. DeepSeek's `e_score_correction_bias`; the state dict also holds the alias `P.gate.gate.*`,
the same values under the block's router name), the shared expert and its gate `P.shared_experts.*` /
`P.shared_experts_gate.*`, and the fused experts `P.experts.w1` (gate) [E/ep, I, H], `P.experts.w3`
(up) [E/ep, I, H] and `P.experts.w2` (down) [E/ep, H, I], ep rank e holding global experts
[e E/ep, (e+1) E/ep). Its save writes:
    - `mp_rank_00_model_states.pt`: the module without the experts, and `ds_autoep_layers`, one entry
      per block (module_path, num_experts, num_local_experts, ep_size, expert_key_prefix
      `P.experts`, checkpoint_format `per_expert_files`, ...); at ZeRO `param_shapes` (a dense group,
      then the experts' group: w1, w2, w3 of each block, local shapes).
    - `layer_<L>_expert_<G>_mp_rank_00_model_states.pt` per block L (its index in ds_autoep_layers,
      `moe_layer_id`) and global expert G: `P.experts.w1.<G>`, `.w2.<G>`, `.w3.<G>` (one expert's 2-D
      slices).
    - without ZeRO, `expp_rank_<e>_mp_rank_00_optim_states.pt` per ep rank: {"optimizer": the torch
      optimizer's state dict}: groups dense (every dense parameter, in module order) and `moe` (ep rank
      e's w1, w2, w3 of each block); with ZeRO 1/2 the usual `zero_pp_rank_<r>` files, the experts'
      group partitioned over the expert-data-parallel ranks (deepspeed_moe.py's Note).
    ZeRO 3 (checkpoint_format `zero3_partitioned`) and AutoEP beside AutoTP folding are not read.

Note: [the model's names] The Hugging Face model holds `P.<router>.*` (the lightspeed preset's router,
`gate` in every preset DeepSpeed has), `P.<shared_experts>.*`, `P.<shared_experts_gate>.*` and fused
`P.experts.gate_up_proj` [E, 2I, H] (gate rows, then up rows: DeepSpeed's w1 | w3 per expert) and
`P.experts.down_proj` [E, H, I] (w2). The preset is the checkpoint's `expert_parallel.preset_model`
(`preset` overrides it); with neither, a block holding shared experts is refused.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from lightspeed._utils.logging import get_logger, warn_once
from lightspeed.checkpoint.deepspeed_format import (DeepSpeedCheckpointSource, _hyperparameters, _number,
                                                    resolve_deepspeed_tag_dir)
from lightspeed.checkpoint.deepspeed_moe import expert_file_ids, expert_files, expert_group_ranks
from lightspeed.checkpoint.deepspeed_pickle import load_deepspeed_file
from lightspeed.checkpoint.errors import CheckpointError
from lightspeed.checkpoint.integrity import verification_enabled, verify_zip
from lightspeed.checkpoint.source import MASTER_KEY
from lightspeed.checkpoint.tag_reader import warn_unverified

__all__ = ["DeepSpeedAutoEPSource", "is_autoep_tag_dir", "open_deepspeed_source"]

logger = get_logger(__name__)

_MODEL_FILE = "mp_rank_00_model_states.pt"
_OPTIM = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")
_EXPP = re.compile(r"^expp_rank_(\d+)_mp_rank_00_optim_states\.pt$")
_WEIGHTS = ("w1", "w2", "w3")  # GroupedExperts' parameters, in their order
_FUSED = ("gate_up_proj", "down_proj")
_ENGINE_KEYS = frozenset({
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
    "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config",
    "ds_version", "checkpoint_parallel_dimensions", "pp_degree", "tp_degree", "universal_checkpoint_info",
    "num_experts", "ds_autoep_layers"})


def _autoep_layers(model: Any) -> list | None:
    layers = model.get("ds_autoep_layers") if isinstance(model, dict) else None
    return layers if isinstance(layers, list) and layers else None


def is_autoep_tag_dir(path: str | os.PathLike) -> bool:
    """Whether the DeepSpeed tag directory `path` holds a checkpoint of AutoEP training (its model file
    lists `ds_autoep_layers`)."""
    model_path = os.path.join(path, _MODEL_FILE)
    return os.path.isfile(model_path) and _autoep_layers(load_deepspeed_file(model_path, mmap=True)) is not None


def open_deepspeed_source(checkpoint_dir: str | os.PathLike, tag: str | int | None = None, **kwargs):
    """The reader of a DeepSpeed checkpoint: `DeepSpeedAutoEPSource` for AutoEP training's, else
    `DeepSpeedCheckpointSource` (same arguments)."""
    path = resolve_deepspeed_tag_dir(checkpoint_dir, tag)
    reader = DeepSpeedAutoEPSource if is_autoep_tag_dir(path) else DeepSpeedCheckpointSource
    return reader(path, **kwargs)


def _pieces(ranks: list[int], lengths: list[int], slot: int, offset: int, numel: int) -> tuple:
    """The (rank, slot, start, length) pieces of elements [offset, offset + numel) of a buffer split over
    `ranks` in order, rank k holding `lengths[k]` elements."""
    out, start = [], 0
    for r, n in zip(ranks, lengths):
        lo, hi = max(offset, start), min(offset + numel, start + n)
        if lo < hi:
            out.append((r, slot, lo - start, hi - lo))
        start += n
    return tuple(out)


class DeepSpeedAutoEPSource:
    """A checkpoint DeepSpeed's engine saved of AutoEP training (module Note), under the Hugging Face
    model's names, the experts whole. `param_names` is accepted for `DeepSpeedCheckpointSource`'s
    signature and, when given, must be the checkpoint's (any order). `preset`: a lightspeed AutoEP
    preset's name (parallel/experts/autoep.py), for the names of the router and shared experts."""

    def __init__(self, checkpoint_dir: str | os.PathLike, tag: str | int | None = None, *,
                 param_names: Sequence[str] | None = None, verify: bool | None = None, preset: str | None = None):
        self.path = resolve_deepspeed_tag_dir(checkpoint_dir, tag)
        self._verify = verification_enabled() if verify is None else bool(verify)
        if not self._verify:
            warn_unverified(self.path)
        names = sorted(os.listdir(self.path))
        self._cache: dict[str, Any] = {}
        self._model_path = os.path.join(self.path, _MODEL_FILE)
        if _MODEL_FILE not in names:
            raise CheckpointError(f"{self.path}: no {_MODEL_FILE}; not a DeepSpeed AutoEP checkpoint directory")
        self._model = self._load(self._model_path)
        layers = _autoep_layers(self._model)
        if self._model.get("frozen_param_shapes"):
            raise CheckpointError(f"{self._model_path}: frozen parameters; AutoEP checkpoints are read with every "
                                  "parameter trained")
        if layers is None or not isinstance(self._model.get("module"), Mapping):
            raise CheckpointError(f"{self._model_path}: no ds_autoep_layers or module: not DeepSpeed AutoEP's")
        self._layers = self._check_layers(layers)
        self._ep = self._layers[0]["ep_size"]
        self._names = self._model_names(preset)
        self._experts = self._read_expert_files(names)
        lowp = next((n for n in names if re.match(r"^(bf16|fp16)_zero_pp_rank_\d+_", n)), None)
        if lowp is not None:
            raise CheckpointError(f"{os.path.join(self.path, lowp)}: DeepSpeed's bf16/fp16 optimizer's files of AutoEP "
                                  "training are not read (ZeRO-2's zero_pp_rank files are, in any dtype)")
        self._optim_files = self._ranked(names, _OPTIM)
        self._expp_files = self._ranked(names, _EXPP)
        # DeepSpeed's own parameters: name (an expert's with "@<ep rank>") -> (shape, pieces)
        self._ds: dict[str, tuple[torch.Size, tuple]] = {}
        self._state_keys: list[str] | None = None
        if self._optim_files and not self._expp_files:
            self._read_zero()
        elif self._expp_files and not self._optim_files:
            self._read_stage0()
        else:
            raise CheckpointError(f"{self.path}: needs either zero_pp_rank_<r> or expp_rank_<e> optimizer files "
                                  f"(found {len(self._optim_files)} and {len(self._expp_files)})")
        self._params = self._model_params()
        if param_names is not None and set(param_names) != set(self._params):
            diff = sorted(set(param_names) ^ set(self._params))[:3]
            raise CheckpointError(f"{self.path}: param_names differ from the checkpoint's parameters (e.g. {diff})")

    # ------------------------------------------------------------------------------- files
    def _load(self, path: str) -> Any:
        if self._verify and not verify_zip(path):
            warn_once(f"{path}: holds no CRC-32s to check (torch's legacy format, or saved without them); read "
                      "unverified", logger)
        return load_deepspeed_file(path, mmap=True)

    def _file(self, name: str) -> Any:
        if name not in self._cache:
            self._cache[name] = self._load(os.path.join(self.path, name))
        return self._cache[name]

    def _ranked(self, names: list[str], pattern: re.Pattern) -> list[str]:
        found = {int(m.group(1)): n for n in names if (m := pattern.match(n))}
        if found and sorted(found) != list(range(len(found))):
            missing = min(set(range(max(found) + 1)) - set(found))
            raise CheckpointError(f"{self.path}: rank {missing}'s {pattern.pattern[1:].split('(')[0]}... optimizer "
                                  f"file is missing (rank {max(found)}'s is there)")
        return [found[r] for r in range(len(found))]

    def _check_layers(self, layers: list) -> list[dict]:
        where = f"{self._model_path}: ds_autoep_layers"
        need = ("module_path", "num_experts", "num_local_experts", "ep_size", "expert_key_prefix")
        for i, entry in enumerate(layers):
            if not isinstance(entry, dict) or any(k not in entry for k in need):
                raise CheckpointError(f"{where}[{i}] lacks one of {need}")
            if entry.get("checkpoint_format", "per_expert_files") != "per_expert_files":
                raise CheckpointError(f"{where}[{i}] has checkpoint_format {entry['checkpoint_format']!r}: only "
                                      "'per_expert_files' (ZeRO 0-2) is read, not AutoEP at ZeRO 3")
            if entry["num_local_experts"] * entry["ep_size"] != entry["num_experts"]:
                raise CheckpointError(f"{where}[{i}]: {entry['num_local_experts']} local experts x ep "
                                      f"{entry['ep_size']} is not {entry['num_experts']}")
            if entry["ep_size"] != layers[0]["ep_size"] or entry.get("moe_layer_id", i) != i:
                raise CheckpointError(f"{where}[{i}]: blocks of several ep sizes or out of order")
        if "folding" in self._model:  # AutoEP + AutoTP folding's metadata
            raise CheckpointError(f"{self._model_path}: AutoEP folded with AutoTP is not read")
        return layers

    def _model_names(self, preset: str | None) -> dict[str, str]:
        """{DeepSpeed's child name of a block: the model's} (the Note on the model's names)."""
        from lightspeed.parallel.experts.autoep import PRESETS

        if preset is None:
            section = (self._model.get("ds_config") or {}).get("expert_parallel") or {}
            preset = section.get("preset_model") if isinstance(section, dict) else None
        out = {"router": "gate", "shared_experts": "", "shared_experts_gate": ""}
        if preset is not None:
            if preset not in PRESETS:
                raise CheckpointError(f"{self._model_path}: expert_parallel.preset_model {preset!r} is not one of "
                                      f"{sorted(PRESETS)}")
            p = PRESETS[preset]
            out = {"router": p.router, "shared_experts": p.shared_experts, "shared_experts_gate": p.shared_experts_gate}
        return out

    def _read_expert_files(self, names: list[str]) -> dict[str, list[torch.Tensor]]:
        """'<P>.experts.w<k>' -> its experts' 2-D slices, by global expert."""
        files = expert_files(names)
        want = {(i, g) for i, e in enumerate(self._layers) for g in range(e["num_experts"])}
        found = {expert_file_ids(n): n for n in files}
        if set(found) != want:
            odd = sorted(set(found) ^ want)[0]
            raise CheckpointError(f"{os.path.join(self.path, f'layer_{odd[0]}_expert_{odd[1]}_mp_rank_00_model_states.pt')}"
                                  f": {'missing' if odd in want else 'not a file of the ds_autoep_layers'}")
        out: dict[str, list[torch.Tensor]] = {}
        for (i, g), name in sorted(found.items()):
            prefix = self._layers[i]["expert_key_prefix"]
            entries = self._file(name)
            expected = {f"{prefix}.{w}.{g}" for w in _WEIGHTS}
            if not isinstance(entries, Mapping) or set(entries) != expected:
                raise CheckpointError(f"{os.path.join(self.path, name)}: holds {sorted(entries)[:3]}, not expert {g} "
                                      f"of {prefix} ({sorted(expected)}): a mismatched expert file")
            for w in _WEIGHTS:
                out.setdefault(f"{prefix}.{w}", []).append(entries[f"{prefix}.{w}.{g}"])
            del self._cache[name]
        return out

    # ----------------------------------------------------------------------------- layouts
    def _expert_name(self, name: str) -> bool:
        return any(name == f"{e['expert_key_prefix']}.{w}" for e in self._layers for w in _WEIGHTS)

    def _read_zero(self) -> None:
        first = self._optim(0)
        self.zero_stage = int(first.get("zero_stage", -1))
        if self.zero_stage not in (1, 2):
            raise CheckpointError(f"{self._optim_path(0)}: ZeRO stage {self.zero_stage}; AutoEP checkpoints are "
                                  "read at ZeRO 0-2 (a bf16/fp16 optimizer's file has no zero_stage)")
        counts = first["partition_count"]
        counts = [int(c) for c in (counts if isinstance(counts, list) else [counts])]
        self.world_size = max(counts)
        if len(self._optim_files) != self.world_size:
            raise CheckpointError(f"{self.path}: {len(self._optim_files)} zero_pp_rank files for a world of "
                                  f"{self.world_size}")
        shapes = self._model.get("param_shapes")
        if not isinstance(shapes, list) or len(shapes) != len(counts):
            raise CheckpointError(f"{self._model_path}: param_shapes do not match the optimizer's param groups")
        paddings = first.get("param_alignment_paddings")
        base = first["base_optimizer_state"]
        if not isinstance(base, dict):
            raise CheckpointError(f"{self._optim_path(0)}: an elastic ZeRO checkpoint; not read for AutoEP")
        ids = [i for pg in base["param_groups"] for i in pg["params"]]
        self._groups = []
        for g, group_shapes in enumerate(shapes):
            experts = [self._expert_name(n) for n in group_shapes]
            if any(experts) and not all(experts):
                raise CheckpointError(f"{self._model_path}: param group {g} mixes experts and dense parameters")
            if all(experts) and experts:
                splits = list(enumerate(expert_group_ranks(self.world_size, counts[g])))
            elif counts[g] == self.world_size:
                splits = [(None, list(range(self.world_size)))]
            else:
                raise CheckpointError(f"{self._optim_path(0)}: dense param group {g} partitioned over {counts[g]} "
                                      f"of {self.world_size} ranks")
            for e, ranks in splits:
                lengths = [int(self._optim(r)["single_partition_of_fp32_groups"][g].numel()) for r in ranks]
                offset = 0
                for i, (name, shape) in enumerate(group_shapes.items()):
                    shape = torch.Size(shape)
                    key = name if e is None else f"{name}@{e}"
                    self._ds[key] = (shape, _pieces(ranks, lengths, g, offset, shape.numel()))
                    offset += shape.numel() + (int(paddings[g][i]) if paddings else 0)
                if offset > sum(lengths):
                    raise CheckpointError(f"{self._optim_path(ranks[0])}: param group {g} needs {offset} elements, "
                                          f"the ranks saved {sum(lengths)}")
            self._groups.append((base["param_groups"][g], list(group_shapes)))
        step = first.get("base_optimizer_state_step")
        self._master = lambda r, s: self._optim(r)["single_partition_of_fp32_groups"][s]
        self._state = lambda r, s: self._optim(r)["base_optimizer_state"]["state"].get(ids[s], {})
        self._scalars = [{k: _number(v) for k, v in self._state(0, g).items() if not _elementwise(v)}
                         for g in range(len(shapes))]
        for s in self._scalars:
            if step is not None:
                s.setdefault("step", _number(step))

    def _optim_path(self, rank: int) -> str:
        return os.path.join(self.path, self._optim_files[rank])

    def _optim(self, rank: int) -> dict:
        state = self._file(self._optim_files[rank])
        state = state.get("optimizer_state_dict") if isinstance(state, dict) else None
        if not isinstance(state, dict) or "single_partition_of_fp32_groups" not in state:
            raise CheckpointError(f"{self._optim_path(rank)}: not a DeepSpeed ZeRO 1/2 optimizer-states file")
        return state

    def _read_stage0(self) -> None:
        self.zero_stage, self.world_size = 0, int(self._model.get("dp_world_size") or 1)
        if len(self._expp_files) != self._ep:
            raise CheckpointError(f"{self.path}: {len(self._expp_files)} expp_rank files for ep {self._ep}")
        opts = []
        for e, name in enumerate(self._expp_files):
            opt = self._file(name).get("optimizer") if isinstance(self._file(name), dict) else None
            if not isinstance(opt, dict) or "state" not in opt or "param_groups" not in opt:
                raise CheckpointError(f"{os.path.join(self.path, name)}: no torch optimizer state dict under "
                                      "'optimizer' (fp16/bf16 optimizers without ZeRO are not read for AutoEP)")
            opts.append(opt)
        aliases = self._aliases()
        dense = [n for n in self._model["module"] if n not in aliases and n not in set(self._model["buffer_names"] or [])]
        experts = [f"{e['expert_key_prefix']}.{w}" for e in self._layers for w in _WEIGHTS]
        local = {n: torch.stack(t) for n, t in self._experts.items()}
        masters: dict[tuple[int, int], torch.Tensor] = {}
        self._groups = []
        for e, opt in enumerate(opts):
            slot = 0
            for g, pg in enumerate(opt["param_groups"]):
                names = experts if pg.get("moe") else dense
                if len(pg["params"]) != len(names):
                    raise CheckpointError(f"{os.path.join(self.path, self._expp_files[e])}: param group {g} holds "
                                          f"{len(pg['params'])} parameters, the model {len(names)} of its kind")
                for name, i in zip(names, pg["params"]):
                    if pg.get("moe"):
                        n = self._ep_rows(name)
                        tensor = local[name][e * n:(e + 1) * n]
                    else:
                        tensor = self._model["module"][name]
                    exp = [v for v in opt["state"].get(i, {}).values() if _elementwise(v)]
                    if exp and exp[0].shape != tensor.shape:
                        raise CheckpointError(f"{os.path.join(self.path, self._expp_files[e])}: optimizer state of "
                                              f"shape {tuple(exp[0].shape)} for {name} {tuple(tensor.shape)}")
                    masters[(e, slot)] = tensor
                    key = f"{name}@{e}" if pg.get("moe") else name
                    if e == 0 or pg.get("moe"):
                        self._ds[key] = (tensor.shape, ((e, slot, 0, tensor.numel()),))
                    slot += 1
                if e == 0:
                    self._groups.append((pg, names))
        ids = [[i for pg in opt["param_groups"] for i in pg["params"]] for opt in opts]
        self._master = lambda r, s: masters[(r, s)]
        self._state = lambda r, s: opts[r]["state"].get(ids[r][s], {})
        self._scalars = [{k: _number(v) for k, v in opts[0]["state"].get(pg["params"][0], {}).items()
                          if not _elementwise(v)} for pg, _ in self._groups]

    def _ep_rows(self, name: str) -> int:
        return next(e["num_local_experts"] for e in self._layers if name.startswith(e["expert_key_prefix"] + "."))

    # ------------------------------------------------------------------------------ renaming
    def _aliases(self) -> set[str]:
        """The module entries that repeat a block's router under the block's router name."""
        module = self._model["module"]
        out = set()
        for entry in self._layers:
            p = entry["module_path"]
            for key in module:
                if key.startswith(f"{p}.{self._names['router']}.") and \
                        f"{p}.router.{key[len(p) + len(self._names['router']) + 2:]}" in module:
                    out.add(key)
        return out

    def _rename(self, name: str) -> str:
        for entry in self._layers:
            p = entry["module_path"] + "."
            if not name.startswith(p):
                continue
            rest = name[len(p):]
            if rest.startswith("router."):
                rest = rest[len("router."):]
                rest = rest[len("gate."):] if rest.startswith("gate.") else rest
                return f"{p}{self._names['router']}.{rest}"
            for child in ("shared_experts_gate", "shared_experts"):
                if rest.startswith(child + "."):
                    if not self._names[child]:
                        raise CheckpointError(f"{self._model_path}: {name} needs the model's name of the block's "
                                              f"{child}: set expert_parallel.preset_model (lightspeed's preset)")
                    return f"{p}{self._names[child]}{rest[len(child):]}"
        return name

    def _model_params(self) -> dict[str, torch.Size]:
        out: dict[str, torch.Size] = {}
        self._renamed: dict[str, str] = {}
        for pg, names in self._groups:
            for name in names:
                if self._expert_name(name):
                    continue
                out[self._rename(name)] = self._ds[name][0]
                self._renamed[self._rename(name)] = name
        for entry in self._layers:
            prefix, e = entry["expert_key_prefix"], entry["num_experts"]
            w1, w2 = self._experts[f"{prefix}.w1"][0].shape, self._experts[f"{prefix}.w2"][0].shape
            out[f"{prefix}.{_FUSED[0]}"] = torch.Size((e, 2 * w1[0], w1[1]))
            out[f"{prefix}.{_FUSED[1]}"] = torch.Size((e, *w2))
        return out

    # ------------------------------------------------------------------------------ protocol
    def param_names(self) -> list[str]:
        return list(self._params)

    def param_shape(self, name: str) -> torch.Size:
        if name not in self._params:
            raise KeyError(f"{self.path}: no trainable parameter named {name!r}")
        return self._params[name]

    def state_keys(self) -> list[str]:
        if self._state_keys is None:
            keys: list[str] = []
            for slot in dict.fromkeys((p[0][0], p[0][1]) for _, p in self._ds.values() if p):
                for k, v in self._state(*slot).items():
                    if _elementwise(v) and k not in keys:
                        keys.append(k)
            self._state_keys = keys
        return list(self._state_keys)

    def _read_ds(self, name: str, key: str) -> torch.Tensor:
        shape, pieces = self._ds[name]
        parts = []
        for rank, slot, start, length in pieces:
            flat = self._master(rank, slot) if key == MASTER_KEY else self._state(rank, slot).get(key)
            flat = torch.zeros(start + length) if flat is None else flat.reshape(-1)
            if start + length > flat.numel():
                raise CheckpointError(f"{self.path}: rank {rank}'s {key} of {name} ends at {start + length}, past the "
                                      f"{flat.numel()} elements saved")
            parts.append(flat.narrow(0, start, length).float())
        out = torch.cat(parts) if parts else torch.empty(0)
        if out.numel() != shape.numel():
            raise CheckpointError(f"{self.path}: the files hold {out.numel()} of {name}'s {shape.numel()} elements")
        return out.view(shape).clone()

    def read(self, name: str, key: str = MASTER_KEY) -> torch.Tensor:
        self.param_shape(name)
        if key != MASTER_KEY and key not in self.state_keys():
            raise KeyError(f"{self.path}: no optimizer state {key!r}")
        if name in self._renamed:
            return self._read_ds(self._renamed[name], key)
        prefix, fused = name.rsplit(".", 1)
        rows = []
        for e in range(self._ep):
            if fused == _FUSED[0]:
                rows.append(torch.cat([self._read_ds(f"{prefix}.w1@{e}", key),
                                       self._read_ds(f"{prefix}.w3@{e}", key)], dim=1))
            else:
                rows.append(self._read_ds(f"{prefix}.w2@{e}", key))
        return torch.cat(rows)

    def module_state(self) -> dict[str, torch.Tensor]:
        aliases = self._aliases()
        out = {self._rename(k): v for k, v in self._model["module"].items() if k not in aliases}
        for entry in self._layers:
            prefix = entry["expert_key_prefix"]
            w1, w2, w3 = (self._experts[f"{prefix}.{w}"] for w in _WEIGHTS)
            out[f"{prefix}.{_FUSED[0]}"] = torch.stack([torch.cat([a, b]) for a, b in zip(w1, w3)])
            out[f"{prefix}.{_FUSED[1]}"] = torch.stack(w2)
        return out

    def optimizer_groups(self) -> list[dict[str, Any]]:
        out = []
        for (pg, names), scalars in zip(self._groups, self._scalars):
            renamed: list[str] = []
            for name in names:
                if not self._expert_name(name):
                    renamed.append(self._rename(name))
                elif name.endswith(".w1"):
                    renamed += [f"{name[:-3]}.{f}" for f in _FUSED]
            out.append({**_hyperparameters(pg), "names": renamed, "scalars": dict(scalars)})
        return out

    def extra(self) -> dict[str, Any]:
        m = self._model
        return {
            "lr_scheduler": m.get("lr_scheduler"), "loss_scaler": None,
            "counters": {"global_steps": m.get("global_steps"), "global_samples": m.get("global_samples"),
                         "micro_steps": None, "skipped_steps": m.get("skipped_steps")},
            "client_state": {k: v for k, v in m.items() if k not in _ENGINE_KEYS},
            "zero_stage": self.zero_stage, "dp_world_size": self.world_size, "source": "deepspeed",
            "buffer_names": [self._rename(n) for n in m.get("buffer_names") or []],
            "frozen_param_names": [], "shared_params": {},
            "ds_version": m.get("ds_version"), "ds_config": m.get("ds_config"),
        }

    def __repr__(self) -> str:
        return (f"DeepSpeedAutoEPSource({self.path!r}, zero_stage={self.zero_stage}, ep={self._ep}, "
                f"world_size={self.world_size}, params={len(self._params)})")


def _elementwise(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0
