"""A CPU stand-in for CUDA graph capture and replay, so `enable_cuda_graph`'s logic is tested in CI.

It keeps what matters of a graph's semantics:
- capture runs the Python once and records the aten ops it issues, on the tensors they touch; like a
  real capture it leaves no effect on tensors that existed before it (their writes are undone);
- replay runs the recorded ops again on the same tensors, without running any Python: Python state
  the forward changed is not changed again, tensors the forward replaced are not replaced again;
- reading a value back to the host (`.item()`) during capture raises, as CUDA does, and
  `torch.cuda.is_current_stream_capturing()` is true meanwhile (transformers skips such reads then).
"""

from __future__ import annotations

import contextlib
import types

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class FakeGraph:
    def __init__(self):
        self.ops: list = []
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        for func, args, kwargs, out in self.ops:
            result = func(*args, **kwargs)
            if _aliases_input(func):
                continue  # in-place and view ops wrote (or alias) the recorded tensors themselves
            for dst, src in zip(_tensors(out), _tensors(result)):
                dst.copy_(src)


def _tensors(value) -> list:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _aliases_input(func) -> bool:
    return any(r.alias_info is not None for r in func._schema.returns)


def _written(func, args, kwargs) -> list:
    out = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            out.extend(_tensors(value))
    return out


class _Recorder(TorchDispatchMode):
    def __init__(self, graph: FakeGraph):
        super().__init__()
        self.graph = graph
        self.created: set = set()  # storages allocated during the capture
        self.saved: list = []  # (tensor that existed before, its contents then)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            raise RuntimeError("operation not permitted when stream is capturing (fake graph)")
        for t in _written(func, args, kwargs):
            if t.untyped_storage().data_ptr() not in self.created:
                self.saved.append((t, t.clone()))
        out = func(*args, **kwargs)
        for t in _tensors(out):
            if not _aliases_input(func):
                self.created.add(t.untyped_storage().data_ptr())
        self.graph.ops.append((func, args, kwargs, out))
        return out


_capturing = [False]


@contextlib.contextmanager
def fake_graph(graph: FakeGraph, pool=None, stream=None, capture_error_mode="global"):
    recorder = _Recorder(graph)
    _capturing[0] = True
    try:
        with recorder:
            yield
    finally:
        _capturing[0] = False
        for tensor, before in reversed(recorder.saved):  # a capture computes nothing
            tensor.copy_(before)


def use_fake_graphs(monkeypatch) -> None:
    """Route torch.cuda's graph API to the fakes for the test, and let runners on the CPU capture."""
    from lightspeed.inference import cuda_graph

    monkeypatch.setattr(cuda_graph, "GRAPH_DEVICE_TYPES", frozenset({"cuda", "cpu"}))
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", fake_graph)
    monkeypatch.setattr(torch.cuda, "MemPool", lambda: types.SimpleNamespace(id=(0, 1)))
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: _capturing[0])
