"""Finding and reading inference checkpoint files (`checkpoint.py` loads them into a model and saves
one): a Hugging Face model directory (sharded or not, safetensors or torch `.bin`), DeepSpeed's
checkpoint JSON `{"type": "ds_model", "checkpoints": [...], "version": 1.0}` (its split form for a
model saved under tensor parallelism), a file or a list of files; `CheckpointReader` gives their
tensors by key, one at a time, without unpickling arbitrary objects."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from lightspeed.checkpoint.atomic import safe_torch_load
from lightspeed.checkpoint.errors import CheckpointError
from lightspeed.ops.wquant.reference import FORMATS

INDEX_NAMES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
SINGLE_NAMES = ("model.safetensors", "pytorch_model.bin")
DS_CONFIG_NAME = "ds_inference_config.json"
TP_RANKS_KEY = "lightspeed_tp_ranks"
QUANT_METADATA_KEY = "lightspeed.quant"
_DS_TYPES = ("ds_model", "bloom")


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: checkpoint file not found") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path}: is not a readable JSON file ({err})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object (got {type(data).__name__})")
    return data


def _existing(path: str) -> str:
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: checkpoint file not found")
    return path


@dataclass(frozen=True)
class SplitFiles:
    """A checkpoint saved under tensor parallelism: each rank's own files (already its slices)."""

    ranks: list[list[str]]


def _ds_json_files(data: Mapping, base_dir: str, json_dir: str | None, where: str) -> list[str] | SplitFiles:
    """Files named by DeepSpeed's checkpoint JSON. Relative names are joined to `base_dir` (the
    argument, else the JSON's own "base_dir"); with neither, to the working directory as in DeepSpeed,
    or to the JSON's directory where the file is there instead (what a saved directory needs)."""
    if "checkpoints" not in data:
        raise CheckpointError(f"{where}: a DeepSpeed checkpoint JSON needs a 'checkpoints' list of files")
    kind = str(data.get("type", "ds_model"))
    if kind.lower() not in _DS_TYPES:
        raise NotImplementedError(f"init_inference: checkpoint['type']={kind!r} is not implemented (this loader reads "
                                  f"{' / '.join(_DS_TYPES)}: a model's own state-dict files)")
    names = data["checkpoints"]
    if isinstance(names, dict) and set(names) == {TP_RANKS_KEY}:  # saved split for tensor parallelism
        ranks = names[TP_RANKS_KEY]
        if not isinstance(ranks, list) or not ranks:
            raise CheckpointError(f"{where}: '{TP_RANKS_KEY}' must be a list of file lists, one per rank")
        return SplitFiles([_ds_json_files({**data, "checkpoints": files}, base_dir, json_dir, where)
                           for files in ranks])
    if isinstance(names, dict):
        raise NotImplementedError("init_inference: checkpoint['checkpoints'] as {'tp': ..., 'non_tp': ...} (DeepSpeed's "
                                  "tensor-parallel shards of injected kernels) is not implemented")
    if isinstance(names, str):
        names = [names]
    if not isinstance(names, (list, tuple)) or not names or not all(isinstance(n, str) for n in names):
        raise CheckpointError(f"{where}: 'checkpoints' must be a non-empty list of file names")
    base = base_dir or str(data.get("base_dir") or "")
    files = []
    for name in names:
        if base or os.path.isabs(name):
            files.append(_existing(os.path.join(base, name)))
        elif os.path.isfile(name) or json_dir is None:
            files.append(_existing(name))
        else:
            files.append(_existing(os.path.join(json_dir, name)))
    return files


def _index_files(path: str) -> list[str]:
    data = _read_json(path)
    weight_map = data.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{path}: an index needs a non-empty 'weight_map'")
    directory = os.path.dirname(path)
    return [_existing(os.path.join(directory, name)) for name in sorted(set(weight_map.values()))]


def resolve_checkpoint_files(checkpoint, base_dir: str = "") -> list[str] | SplitFiles:
    """The files a `checkpoint` argument names: DeepSpeed's JSON (a dict, or a path to one), a Hugging
    Face index JSON, a model directory, one file, or a list of files (relative names joined to
    `base_dir`); `SplitFiles` for a checkpoint saved under tensor parallelism."""
    base_dir = os.fspath(base_dir or "")
    if isinstance(checkpoint, Mapping):
        return _ds_json_files(checkpoint, base_dir, None, "checkpoint")
    if isinstance(checkpoint, (list, tuple)):
        if not checkpoint:
            raise CheckpointError("checkpoint: an empty list of files")
        return [_existing(os.path.join(base_dir, os.fspath(f))) for f in checkpoint]
    if not isinstance(checkpoint, (str, os.PathLike)):
        raise ValueError(f"init_inference: checkpoint must be a path, a list of files or DeepSpeed's checkpoint "
                         f"dict (got {type(checkpoint).__name__})")
    path = os.path.join(base_dir, os.fspath(checkpoint))
    if os.path.isdir(path):
        for name in (DS_CONFIG_NAME, *INDEX_NAMES):
            if os.path.isfile(os.path.join(path, name)):
                return resolve_checkpoint_files(os.path.join(path, name))
        for name in SINGLE_NAMES:
            if os.path.isfile(os.path.join(path, name)):
                return [os.path.join(path, name)]
        found = sorted(glob.glob(os.path.join(glob.escape(path), "*.safetensors")))
        if not found:
            raise CheckpointError(f"{path}: no checkpoint files in this directory (looked for {DS_CONFIG_NAME}, "
                                  f"{', '.join(INDEX_NAMES + SINGLE_NAMES)}, *.safetensors)")
        return found
    if path.endswith(".json"):
        data = _read_json(path)
        if "weight_map" in data:
            return _index_files(path)
        return _ds_json_files(data, base_dir if base_dir else "", os.path.dirname(path), path)
    return [_existing(path)]


class CheckpointReader:
    """Tensors of several checkpoint files by key, read one at a time on the CPU (safetensors through
    its mapped file, torch files loaded with mmap and weights_only). `quant` holds the quantized
    layers recorded in safetensors metadata: {layer name: (format, group_size)}."""

    def __init__(self, files: Iterable[str]):
        from safetensors import SafetensorError, safe_open

        self._error = SafetensorError
        self._where: dict[str, tuple[str, object]] = {}
        self.quant: dict[str, tuple[str, int | None]] = {}
        for path in files:
            if path.endswith(".safetensors"):
                try:
                    handle = safe_open(path, framework="pt", device="cpu")
                    keys, metadata = list(handle.keys()), handle.metadata() or {}
                except (SafetensorError, OSError) as err:
                    raise CheckpointError(f"{path}: is not a readable safetensors file ({err})") from None
                self._read_quant_metadata(path, metadata)
            else:
                handle = self._torch_state_dict(path)
                keys = list(handle)
            for key in keys:
                if key in self._where:
                    raise CheckpointError(f"{path}: tensor {key!r} is also in {self._where[key][0]}")
                self._where[key] = (path, handle)

    @staticmethod
    def _torch_state_dict(path: str) -> dict:
        data = safe_torch_load(path, map_location="cpu", mmap=True)
        for nested in ("module", "state_dict", "model"):  # DeepSpeed / Lightning / other trainers' wrappers
            if isinstance(data, dict) and isinstance(data.get(nested), dict) and not any(
                    isinstance(v, torch.Tensor) for v in data.values()):
                data = data[nested]
        if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                 for k, v in data.items()):
            raise CheckpointError(f"{path}: expected a state dict (names to tensors)")
        return data

    def _read_quant_metadata(self, path: str, metadata: Mapping[str, str]) -> None:
        text = metadata.get(QUANT_METADATA_KEY)
        if text is None:
            return
        try:
            entries = json.loads(text)
            for name, entry in entries.items():
                fmt, group = entry["weight"], entry.get("group_size")
                if fmt not in FORMATS or not (group is None or isinstance(group, int)):
                    raise ValueError(f"layer {name!r}: {entry!r}")
                self.quant[name] = (fmt, group)
        except (ValueError, TypeError, KeyError, AttributeError) as err:
            raise CheckpointError(f"{path}: bad {QUANT_METADATA_KEY} metadata ({err})") from None

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def keys(self) -> list[str]:
        return list(self._where)

    def shape(self, key: str) -> tuple[int, ...]:
        path, handle = self._where[key]
        if isinstance(handle, dict):
            return tuple(handle[key].shape)
        return tuple(handle.get_slice(key).get_shape())

    def get(self, key: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """The tensor, or only `index` of it (safetensors reads just those bytes)."""
        path, handle = self._where[key]
        if isinstance(handle, dict):
            return handle[key] if index is None else handle[key][index]
        try:
            return handle.get_tensor(key) if index is None else handle.get_slice(key)[index]
        except (self._error, OSError) as err:
            raise CheckpointError(f"{path}: tensor {key!r} cannot be read ({err})") from None
