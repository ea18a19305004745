"""A safetensors file written one tensor at a time, so the writer never holds more than one tensor.

Owns the byte layout of the safetensors format (an 8-byte little-endian header length, a JSON header
giving each tensor's dtype, shape and byte range, then the tensors' bytes back to back) for a file
whose tensors' names, dtypes and shapes are known before any of their values. Must not: decide what
goes into a file or where (convert.py does), or make the file appear before it is complete (the caller
writes it through atomic_write_via).

Note: the `safetensors` package's `save_file` takes a dict of tensors, all in memory at once; writing
the header first from the shapes and then each tensor as it is produced keeps a shard's peak memory at
its largest tensor. The header is padded with spaces to a multiple of 8 bytes, as `safetensors` does,
so the data (and each tensor, all of whose sizes are multiples of their element size) stays aligned.
"""

from __future__ import annotations

import json
import struct
from typing import Callable, Iterable

import torch

__all__ = ["SAFETENSORS_DTYPES", "write_safetensors_streaming"]

SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}


def _header(entries: list[tuple[str, torch.dtype, torch.Size]], metadata: dict[str, str] | None) -> bytes:
    header: dict = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for name, dtype, shape in entries:
        if dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"safetensors cannot store {name} of dtype {dtype}")
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def write_safetensors_streaming(path: str, entries: Iterable[tuple[str, torch.dtype, torch.Size]],
                                produce: Callable[[str], torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """Write `entries` (name, dtype, shape; in file order) to `path`, asking `produce(name)` for each
    tensor in turn and dropping it once written. A produced tensor must have the declared dtype and shape."""
    entries = list(entries)
    with open(path, "wb") as f:
        f.write(_header(entries, metadata))
        for name, dtype, shape in entries:
            tensor = produce(name)
            if tensor.dtype != dtype or tensor.shape != torch.Size(shape):
                raise ValueError(f"{name}: produced {tensor.dtype} {tuple(tensor.shape)}, declared {dtype} {tuple(shape)}")
            tensor = tensor.detach().to("cpu").contiguous()
            if tensor.numel():
                # A byte view of the tensor's own memory: no second copy on the way to the file.
                f.write(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))
            del tensor
