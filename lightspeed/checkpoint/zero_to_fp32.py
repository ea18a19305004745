"""DeepSpeed's ``deepspeed.utils.zero_to_fp32`` functions, same names and arguments, over any checkpoint.

Owns the public, DeepSpeed-named entry points: `get_fp32_state_dict_from_zero_checkpoint`,
`convert_zero_checkpoint_to_fp32_state_dict`, `convert_zero_checkpoint_to_state_dict` and
`load_state_dict_from_zero_checkpoint`. A checkpoint directory holding DeepSpeed's files is read with
`DeepSpeedCheckpointSource`, a lightspeed one with lightspeed's reader (convert.open_checkpoint picks).
Must not: hold its own consolidation logic (convert.py has it, with the Note on what goes in).

Differences from DeepSpeed, all in memory use and none in output: nothing is unpickled beyond plain
data; conversion to files reads one parameter at a time and writes one shard at a time (DeepSpeed's
script holds the whole model); stage-0 checkpoints are consolidated too (DeepSpeed's script refuses them);
tied parameters written as safetensors are copies (safetensors cannot store shared storage); every file is
verified before it is used (`verify=False`, ``--no_verify``: read unchecked, with a warning).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from lightspeed._utils.logging import get_logger
from lightspeed.checkpoint.convert import OUTPUT_DTYPES, iter_consolidated, open_checkpoint, write_consolidated

__all__ = [
    "main",
    "get_fp32_state_dict_from_zero_checkpoint",
    "convert_zero_checkpoint_to_fp32_state_dict",
    "convert_zero_checkpoint_to_state_dict",
    "load_state_dict_from_zero_checkpoint",
]

log = get_logger(__name__)

# load_state_dict_from_zero_checkpoint hands the model this many bytes of parameters at a time.
_LOAD_CHUNK_BYTES = 1 << 30


class LazyTensor:
    """A consolidated tensor not read yet (DeepSpeed's ``lazy_mode``): ``.contiguous()`` reads it."""

    def __init__(self, read, shape: torch.Size, dtype: torch.dtype):
        self._read, self.shape, self.dtype = read, shape, dtype

    def contiguous(self) -> torch.Tensor:
        return self._read()

    def __repr__(self) -> str:
        return f"LazyTensor(shape={tuple(self.shape)}, dtype={self.dtype})"


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: Any, tag: str | None = None,
                                             exclude_frozen_parameters: bool = False,
                                             lazy_mode: bool = False, *, verify: bool = True) -> dict[str, Any]:
    """The consolidated state dict (fp32 masters of the trainable parameters, buffers, frozen parameters
    as saved unless `exclude_frozen_parameters`, tied names sharing their tensor), on the CPU, ready for
    ``model.load_state_dict``. `tag`: the checkpoint's directory name (default: read from ``latest``).
    `lazy_mode`: values are `LazyTensor`s read by ``.contiguous()``. Holds the whole model in memory;
    `convert_zero_checkpoint_to_fp32_state_dict` writes files without doing so. `verify`: check every file
    read (lightspeed's against its checksum manifests, DeepSpeed's against the CRC-32s in the file);
    False reads them unchecked, with a warning."""
    source = open_checkpoint(checkpoint_dir, tag, verify=verify)
    out: dict[str, Any] = {}
    for entry, read in iter_consolidated(source, exclude_frozen_parameters):
        if entry.kind == "alias":
            out[entry.name] = out[entry.target]
        elif lazy_mode:
            out[entry.name] = LazyTensor(read, entry.shape, entry.dtype)
        else:
            out[entry.name] = read()
    log.info("consolidated %d tensors from %s", len(out), getattr(source, "path", checkpoint_dir))
    return out


def _resolve_dtype(dtype: Any) -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype in OUTPUT_DTYPES.values():
        return dtype
    name = str(dtype).removeprefix("torch.").lower()
    if name not in OUTPUT_DTYPES:
        raise ValueError(f"unsupported output dtype {dtype!r}; choose one of {sorted(OUTPUT_DTYPES)}")
    return OUTPUT_DTYPES[name]


def convert_zero_checkpoint_to_state_dict(checkpoint_dir: Any, output_dir: str | os.PathLike,
                                          dtype: Any = torch.float32, max_shard_size: int | str | None = "5GB",
                                          safe_serialization: bool = False, tag: str | None = None,
                                          exclude_frozen_parameters: bool = False, *, verify: bool = True) -> list[str]:
    """Write the consolidated state dict to `output_dir` as ``pytorch_model.bin`` or (with
    `safe_serialization`) ``model.safetensors``, sharded past `max_shard_size` ("5GB"; None: one file)
    with Hugging Face's ``*.index.json``; floating tensors in `dtype` (fp32, fp16 or bf16, names or
    torch dtypes). Streams: one parameter read, one shard (safetensors: one tensor) held at a time.
    `verify`: as `get_fp32_state_dict_from_zero_checkpoint`. Returns the paths written."""
    source = open_checkpoint(checkpoint_dir, tag, verify=verify)
    return write_consolidated(source, output_dir, dtype=_resolve_dtype(dtype), max_shard_size=max_shard_size,
                              safe_serialization=safe_serialization,
                              exclude_frozen_parameters=exclude_frozen_parameters)


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: Any, output_dir: str | os.PathLike,
                                               max_shard_size: int | str | None = "5GB",
                                               safe_serialization: bool = False, tag: str | None = None,
                                               exclude_frozen_parameters: bool = False, *,
                                               verify: bool = True) -> list[str]:
    """`convert_zero_checkpoint_to_state_dict` in fp32 (DeepSpeed's original entry point)."""
    return convert_zero_checkpoint_to_state_dict(checkpoint_dir, output_dir, torch.float32, max_shard_size,
                                                 safe_serialization, tag, exclude_frozen_parameters, verify=verify)


def load_state_dict_from_zero_checkpoint(model: torch.nn.Module, checkpoint_dir: Any,
                                         tag: str | None = None, *, verify: bool = True) -> torch.nn.Module:
    """Move `model` to the CPU and load the consolidated fp32 weights into it (``strict=False``, as
    DeepSpeed does); returns the model. The weights are handed over in chunks of about 1 GiB, so the
    whole consolidated state dict never exists at once. `verify`: as
    `get_fp32_state_dict_from_zero_checkpoint`."""
    source = open_checkpoint(checkpoint_dir, tag, verify=verify)
    model = model.cpu()
    chunk: dict[str, torch.Tensor] = {}
    chunk_bytes = 0
    for entry, read in iter_consolidated(source):
        chunk[entry.name] = chunk[entry.target] if entry.kind == "alias" and entry.target in chunk else read()
        chunk_bytes += chunk[entry.name].numel() * chunk[entry.name].element_size()
        if chunk_bytes >= _LOAD_CHUNK_BYTES:
            model.load_state_dict(chunk, strict=False)
            chunk, chunk_bytes = {}, 0
    if chunk:
        model.load_state_dict(chunk, strict=False)
    return model


def main(argv: list[str] | None = None) -> int:
    """DeepSpeed's ``python zero_to_fp32.py CHECKPOINT_DIR OUTPUT_DIR`` command line, same arguments:
    ``python -m lightspeed.checkpoint.zero_to_fp32``. (``lightspeed convert to-fp32`` is the same.)"""
    import argparse
    import logging

    from lightspeed.checkpoint.errors import CheckpointError

    parser = argparse.ArgumentParser(prog="zero_to_fp32", description="Consolidate a ZeRO checkpoint into fp32 weights.")
    parser.add_argument("checkpoint_dir", help="the checkpoint folder, e.g. path/checkpoint-12")
    parser.add_argument("output_dir", help="directory for the fp32 state dict files")
    parser.add_argument("--max_shard_size", default="5GB", help="largest shard, e.g. 5GB (default)")
    parser.add_argument("--safe_serialization", action="store_true", help="write safetensors")
    parser.add_argument("-t", "--tag", default=None, help="checkpoint tag, e.g. global_step1")
    parser.add_argument("--exclude_frozen_parameters", action="store_true", help="leave out frozen parameters")
    parser.add_argument("--no_verify", "--no-verify", dest="no_verify", action="store_true",
                        help="read the checkpoint without checking its checksums (the output is unverified)")
    parser.add_argument("-d", "--debug", action="store_true", help="log at debug level")
    args = parser.parse_args(argv)
    if args.debug:
        get_logger().setLevel(logging.DEBUG)
    try:
        convert_zero_checkpoint_to_fp32_state_dict(args.checkpoint_dir, args.output_dir, args.max_shard_size,
                                                   args.safe_serialization, args.tag, args.exclude_frozen_parameters,
                                                   verify=not args.no_verify)
    except (CheckpointError, ValueError, OSError) as err:
        parser.exit(2, f"zero_to_fp32: error: {err}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
