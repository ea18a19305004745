"""Consolidating a saved training state into one module state dict, and writing it out, streaming.

Owns: picking the reader for a checkpoint directory (`open_checkpoint`), the consolidated state dict's
contents and order (`consolidation_plan`, DeepSpeed's zero_to_fp32 semantics: buffers, frozen
parameters, trainable parameters in fp32, then tied aliases), its split into shards (Hugging Face's
rule and names, so `from_pretrained` loads the result), and writing the shards one at a time
(`write_consolidated`). Works over any `TrainingStateSource`. Must not: know a format's layout on disk
(the readers do), or hold the whole model: a `.bin` shard is built in memory and saved, a safetensors
shard is streamed a tensor at a time (peak about one tensor), and each trainable parameter is read only
when its shard is written.

Note: [what the consolidated state dict holds] (deepspeed.utils.zero_to_fp32's choices, kept)
    - buffers named in the checkpoint's ``buffer_names`` (persistent buffers), floating ones in fp32;
    - frozen parameters (``frozen_param_names``) as saved (their low-precision dtype), unless
      ``exclude_frozen_parameters``;
    - trainable parameters, the fp32 masters, in the reader's order;
    - tied parameters (``shared_params``: alias -> name kept) as the same tensor as the one they alias.
    A source whose ``extra()`` lacks those names falls back to: every module-state entry that is not a
    trainable parameter and does not share storage with an earlier entry is kept as saved.
    When writing files (`write_consolidated`), every floating tensor is cast to the output dtype (fp32 by
    default). Safetensors cannot store two names over one storage, so there an alias is a copy;
    ``from_pretrained`` re-ties it.
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass
from collections.abc import Mapping
from typing import Any, Callable, Iterator, Protocol, runtime_checkable

import torch

from lightspeed._utils.logging import get_logger
from lightspeed.checkpoint.atomic import LATEST_FILENAME, atomic_torch_save, atomic_write_bytes, atomic_write_via
from lightspeed.checkpoint.deepspeed_format import (
    is_deepspeed_checkpoint, resolve_deepspeed_tag_dir,
)  # fmt: skip
from lightspeed.checkpoint.deepspeed_autoep import open_deepspeed_source
from lightspeed.checkpoint.deepspeed_pipeline import DeepSpeedPipelineSource, is_deepspeed_pipeline_tag_dir
from lightspeed.checkpoint.engine_checkpoint import is_tag_dir
from lightspeed.checkpoint.errors import CheckpointError
from lightspeed.checkpoint.integrity import verification
from lightspeed.checkpoint.safetensors_stream import write_safetensors_streaming
from lightspeed.checkpoint.source import MASTER_KEY, TrainingStateSource

__all__ = ["open_checkpoint", "Entry", "consolidation_plan", "produce", "parse_size", "split_shards",
           "write_consolidated", "OUTPUT_DTYPES"]

log = get_logger(__name__)

OUTPUT_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "fp16": torch.float16,
                 "float16": torch.float16, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def open_checkpoint(checkpoint_dir: str | os.PathLike | TrainingStateSource,
                    tag: str | int | None = None, *, verify: bool = True) -> TrainingStateSource:
    """The reader for what is in `checkpoint_dir`: DeepSpeed's files -> `DeepSpeedCheckpointSource` (its
    pipeline layout -> `DeepSpeedPipelineSource`, which without the model names tied layers by index and
    needs ZeRO files);
    otherwise lightspeed's own reader (`lightspeed.checkpoint.universal.open_source`), every tp rank's
    slices joined into whole tensors for a tensor-parallel run's directory (`tensor_parallel.MergedTPSource`).
    `checkpoint_dir` is a save directory (the tag `latest` names, or `tag`) or one tag directory. Every file
    is verified as it is read unless `verify` is False (then a warning says the result is unverified).
    A source given instead of a path is returned as it is."""
    if isinstance(checkpoint_dir, TrainingStateSource) and not isinstance(checkpoint_dir, (str, os.PathLike)):
        return checkpoint_dir
    path = os.fspath(checkpoint_dir)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: checkpoint directory not found")
    with verification(verify):
        if is_deepspeed_checkpoint(path):
            tag_path = resolve_deepspeed_tag_dir(path, tag)
            if is_deepspeed_pipeline_tag_dir(tag_path):  # without the model: layers named by their index
                return DeepSpeedPipelineSource(tag_path)
            return open_deepspeed_source(path, tag)  # AutoEP's layout too
        if tag is None and is_tag_dir(path) and not os.path.isfile(os.path.join(path, LATEST_FILENAME)):
            # one tag directory of lightspeed's layout: read it as its save directory's tag
            path, tag = os.path.split(os.path.abspath(path))
        # after the DeepSpeed reader, which universal imports; a tensor-parallel checkpoint's tp ranks are
        # merged into whole tensors there
        from lightspeed.checkpoint.tensor_parallel import open_at_tp_size

        opened = open_at_tp_size(path, tag)
    if opened is None:
        raise CheckpointError(f"{path}: no checkpoint to read (no 'latest' file and no tag given)")
    return opened[1]


@runtime_checkable
class ModuleStateMeta(Protocol):
    """A module state that can tell an entry's shape and dtype without producing it (e.g. a stage-3
    frozen parameter saved in parts): the plan then reads nothing."""

    def entry_meta(self, name: str) -> tuple[torch.Size, torch.dtype]: ...


def _meta(module: Mapping[str, torch.Tensor], name: str) -> tuple[torch.Size, torch.dtype]:
    if isinstance(module, ModuleStateMeta):
        return module.entry_meta(name)
    return module[name].shape, module[name].dtype


@dataclass(frozen=True)
class Entry:
    """One name of the consolidated state dict. `kind`: "buffer", "frozen", "param" (an fp32 master read
    from the source) or "alias" (the same tensor as `target`). `dtype` is the consolidated dtype."""

    name: str
    kind: str
    shape: torch.Size
    dtype: torch.dtype
    target: str | None = None


def _storage_key(t: torch.Tensor) -> tuple | None:
    if t.numel() == 0 or t.device.type == "meta":
        return None
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


def consolidation_plan(source: TrainingStateSource, exclude_frozen_parameters: bool = False,
                       module: Mapping[str, torch.Tensor] | None = None) -> list[Entry]:
    """The consolidated state dict's entries, in order, from shapes alone (no parameter is read).
    `module`: the source's ``module_state()``, when the caller already has it."""
    module = source.module_state() if module is None else module
    extra = source.extra()
    trainable = source.param_names()
    entries: list[Entry] = []
    buffer_names, frozen_names = extra.get("buffer_names"), extra.get("frozen_param_names")
    shared = extra.get("shared_params")
    if buffer_names is None or frozen_names is None or shared is None:
        return _fallback_plan(source, module, trainable, exclude_frozen_parameters)
    for name in buffer_names:
        if name in module:
            shape, dtype = _meta(module, name)
            entries.append(Entry(name, "buffer", shape, torch.float32 if dtype.is_floating_point else dtype))
    if not exclude_frozen_parameters:
        for name in frozen_names:
            if name not in module:
                raise CheckpointError(f"frozen parameter {name} is not in the checkpoint's module state")
            entries.append(Entry(name, "frozen", *_meta(module, name)))
    for name in trainable:
        entries.append(Entry(name, "param", torch.Size(source.param_shape(name)), torch.float32))
    present = {e.name: e for e in entries}
    for alias, target in shared.items():
        if target in present and alias not in present:
            t = present[target]
            present[alias] = Entry(alias, "alias", t.shape, t.dtype, target)
            entries.append(present[alias])
    return entries


def _fallback_plan(source, module, trainable, exclude_frozen_parameters) -> list[Entry]:
    entries = [Entry(n, "param", torch.Size(source.param_shape(n)), torch.float32) for n in trainable]
    seen = {}
    for name, t in module.items():
        key = _storage_key(t) if isinstance(t, torch.Tensor) else None
        if name in trainable:
            if key is not None:
                seen.setdefault(key, name)
            continue
        if key is not None and key in seen:
            target = seen[key]
            dtype = torch.float32 if target in trainable else t.dtype
            entries.append(Entry(name, "alias", t.shape, dtype, target))
            continue
        if key is not None:
            seen[key] = name
        if not exclude_frozen_parameters:
            entries.append(Entry(name, "frozen", t.shape, t.dtype))
    return entries


def produce(source: TrainingStateSource, entry: Entry, module: Mapping[str, torch.Tensor],
            entries: dict[str, Entry]) -> torch.Tensor:
    """The consolidated tensor of one entry (read from the source now)."""
    if entry.kind == "alias":
        return produce(source, entries[entry.target], module, entries)
    if entry.kind == "param":
        return source.read(entry.name, MASTER_KEY)
    t = module[entry.name]
    # A copy: a saved tensor may be a view into a larger storage (DeepSpeed's flat buffers), which
    # torch.save would write whole, or a page of a memory-mapped file.
    return t.to(entry.dtype) if entry.dtype != t.dtype else t.clone(memory_format=torch.contiguous_format)


def parse_size(size: int | str) -> int:
    """A shard size in bytes: an int, or "5GB" (decimal units, as Hugging Face) / "4GiB" (binary)."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        m = _SIZE.match(str(size))
        if not m:
            raise ValueError(f"max_shard_size must be bytes or a size like '5GB' or '500MiB' (got {size!r})")
        value = int(float(m.group(1)) * _UNITS[(m.group(2) or "B").lower()])
    if value <= 0:
        raise ValueError(f"max_shard_size must be positive (got {size!r})")
    return value


def _nbytes(entry: Entry, dtype: torch.dtype) -> int:
    return entry.shape.numel() * torch.empty((), dtype=dtype).element_size()


def _out_dtype(entry: Entry, dtype: torch.dtype) -> torch.dtype:
    return dtype if entry.dtype.is_floating_point else entry.dtype


def split_shards(entries: list[Entry], max_shard_size: int | str | None, dtype: torch.dtype,
                 weights_name: str) -> tuple[dict[str, list[Entry]], int]:
    """Shards as Hugging Face's `split_torch_state_dict_into_shards` makes them: entries in order, a new
    shard when the next would pass `max_shard_size`, an entry bigger than that alone, an alias in its
    target's shard; names ``model-00001-of-00003.safetensors`` (one shard: `weights_name`). Returns
    (file name -> entries, total bytes)."""
    limit = None if max_shard_size is None else parse_size(max_shard_size)
    shards: list[list[Entry]] = []
    current: list[Entry] = []
    size = total = 0
    for e in entries:
        if e.kind == "alias":
            continue
        n = _nbytes(e, _out_dtype(e, dtype))
        total += n
        if limit is not None and n > limit:
            shards.append([e])
            continue
        if limit is not None and current and size + n > limit:
            shards.append(current)
            current, size = [], 0
        current.append(e)
        size += n
    if current or not shards:
        shards.append(current)
    where = {e.name: i for i, shard in enumerate(shards) for e in shard}
    for e in entries:
        if e.kind == "alias":
            shards[where[e.target]].append(e)
    if len(shards) == 1:
        return {weights_name: shards[0]}, total
    stem, ext = weights_name.rsplit(".", 1)
    return {f"{stem}-{i + 1:05d}-of-{len(shards):05d}.{ext}": s for i, s in enumerate(shards)}, total


def _progress(total: int, desc: str) -> Any:
    if not sys.stderr.isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, unit="tensor", leave=False)


def write_consolidated(source: TrainingStateSource, output_dir: str | os.PathLike, *, dtype: torch.dtype = torch.float32,
                       max_shard_size: int | str | None = "5GB", safe_serialization: bool = False,
                       exclude_frozen_parameters: bool = False) -> list[str]:
    """Write the consolidated state dict of `source` into `output_dir` as ``pytorch_model.bin`` or
    ``model.safetensors`` (sharded past `max_shard_size`, with ``*.index.json``), floating tensors in
    `dtype`, each file atomically, the index last. Returns the paths written."""
    output_dir = os.fspath(output_dir)
    module = source.module_state()
    entries = consolidation_plan(source, exclude_frozen_parameters, module)
    weights_name = "model.safetensors" if safe_serialization else "pytorch_model.bin"
    shards, total = split_shards(entries, max_shard_size, dtype, weights_name)
    os.makedirs(output_dir, exist_ok=True)
    by_name = {e.name: e for e in entries}
    bar = _progress(len(entries), "Writing consolidated shards")
    written = []

    def make(name: str) -> torch.Tensor:
        e = by_name[name]
        t = produce(source, e, module, by_name)
        out = _out_dtype(e, dtype)
        if bar is not None:
            bar.update(1)
        return t.to(out) if t.dtype != out else t

    for filename, shard in shards.items():
        path = os.path.join(output_dir, filename)
        if safe_serialization:
            layout = [(e.name, _out_dtype(e, dtype), e.shape) for e in shard]
            atomic_write_via(path, lambda tmp, layout=layout: write_safetensors_streaming(
                tmp, layout, make, metadata={"format": "pt"}))
        else:
            tensors: dict[str, torch.Tensor] = {}
            for e in shard:
                tensors[e.name] = tensors[e.target] if e.kind == "alias" and e.target in tensors else make(e.name)
            atomic_torch_save(tensors, path)
            del tensors
        written.append(path)
        log.info("wrote %s (%d tensors)", path, len(shard))
    if bar is not None:
        bar.close()
    if len(shards) > 1:
        index = {"metadata": {"total_size": total},
                 "weight_map": {e.name: f for f, shard in shards.items() for e in shard}}
        index_name = weights_name + ".index.json"
        path = os.path.join(output_dir, index_name)
        atomic_write_bytes(path, (json.dumps(index, indent=2, sort_keys=True) + "\n").encode("utf-8"))
        written.append(path)
    return written


def iter_consolidated(source: TrainingStateSource, exclude_frozen_parameters: bool = False
                      ) -> Iterator[tuple[Entry, Callable[[], torch.Tensor]]]:
    """(entry, read) pairs in the consolidated order; `read()` produces that tensor when called."""
    module = source.module_state()
    entries = consolidation_plan(source, exclude_frozen_parameters, module)
    by_name = {e.name: e for e in entries}
    for e in entries:
        yield e, (lambda e=e: produce(source, e, module, by_name))
