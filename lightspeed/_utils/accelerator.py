"""The accelerator object of DeepSpeed's `get_accelerator()`: one device-agnostic interface to the
device this process trains on, `cuda` or `cpu` (the same choice as `device.default_device`).

Owns: the two implementations and the process-wide instance. Must not: communicate, or choose a
device other than `default_device`'s rule (CUDA when available and LIGHTSPEED_ACCELERATOR is not
"cpu"). DeepSpeed's op builders do not exist here (lightspeed has no C++/CUDA build step).

Note: the CPU side
    Streams and events are real objects that do nothing asynchronous (work on CPU is already ordered);
    an event records the host time, so `elapsed_time` is meaningful. Memory figures are the process's
    resident set (Linux /proc): `memory_allocated` the current RSS, `max_memory_allocated` its peak
    (VmHWM), which `reset_peak_memory_stats` resets through /proc/self/clear_refs; `total_memory` and
    `available_memory` are the machine's. fp16 and bf16 both count as supported: torch computes both
    on CPU, as lightspeed's CPU tests do.
"""

from __future__ import annotations

import contextlib
import functools
import os
import resource
import time

import torch

from lightspeed._utils.device import default_device


class _CpuEvent:
    """A CUDA-event look-alike on the host clock."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self._time: float | None = None

    def record(self, stream=None) -> None:
        self._time = time.perf_counter()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def elapsed_time(self, end_event: "_CpuEvent") -> float:
        if self._time is None or end_event._time is None:
            raise RuntimeError("Event.elapsed_time: both events must be recorded first")
        return (end_event._time - self._time) * 1e3


class _CpuStream:
    """A CUDA-stream look-alike: CPU work is already in program order, so every method is immediate."""

    def __init__(self, device=None, priority: int = 0, **kwargs):
        self.device = torch.device("cpu")

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event: _CpuEvent | None = None) -> _CpuEvent:
        event = event or _CpuEvent()
        event.record()
        return event


_DEFAULT_CPU_STREAM = _CpuStream()


def _proc_status_bytes(key: str) -> int:
    """A `kB` field of /proc/self/status (VmRSS, VmHWM) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {key}")


def _no_nvtx_domain(domain) -> None:
    if domain is not None:
        raise NotImplementedError(f"get_accelerator().range_push/range_pop: NVTX domains (domain={domain!r}) are not "
                                  "implemented in lightspeed yet")


def _require_host(device) -> None:
    if torch.device(device).type != "cpu":
        raise ValueError(f"pin_empty allocates host memory; device must be cpu, got {device!r}")


class Accelerator:
    """Methods shared by both devices; `CudaAccelerator` and `CpuAccelerator` fill in the rest."""

    _name = ""
    _communication_backend_name = ""

    # ---- identity
    def device_name(self, device_index: int | str | None = None) -> str:
        return self._name if device_index is None else f"{self._name}:{int(device_index)}"

    def current_device_name(self) -> str:
        return f"{self._name}:{self.current_device()}" if self._name == "cuda" else self._name

    def communication_backend_name(self) -> str:
        return self._communication_backend_name

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    def supported_dtypes(self) -> list[torch.dtype]:
        dtypes = [torch.float32]
        if self.is_fp16_supported():
            dtypes.append(torch.float16)
        if self.is_bf16_supported():
            dtypes.append(torch.bfloat16)
        return dtypes

    def is_synchronized_device(self) -> bool:
        return self._name == "cpu"

    def use_host_timers(self) -> bool:
        return self.is_synchronized_device()

    def resolves_data_dependency(self) -> bool:
        return self.is_synchronized_device()

    def handles_memory_backpressure(self) -> bool:
        return self.is_synchronized_device()

    def get_compile_backend(self) -> str:
        return "inductor"

    # ---- random numbers
    def random(self):
        return torch.random

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)  # seeds the CPU generator and every CUDA device's

    def initial_seed(self) -> int:
        return torch.initial_seed()

    # ---- host memory (DeepSpeed 0.19's API; `_pin` / `_empty_pinned` are the device's)
    def pin_memory(self, tensor: torch.Tensor, make_copy: bool = True, match_shape: bool = True, *,
                   align_bytes: int = 1) -> torch.Tensor:
        """`tensor` in page-locked host memory (CPU device: the tensor itself). With `make_copy` False the
        tensor is only a template: a fresh, uninitialised pinned buffer of its dtype and shape (flat with
        `match_shape` False). `align_bytes` is DeepSpeed 0.18's argument, accepted."""
        if make_copy:
            return self._pin(tensor)
        return self._empty_pinned(tensor, tuple(tensor.shape) if match_shape else (tensor.numel(),))

    def pin_empty(self, *size, dtype: torch.dtype, device="cpu") -> torch.Tensor:
        """An uninitialised pinned host buffer of `size` (ints, or one tuple) and `dtype`."""
        _require_host(device)
        shape = tuple(size[0]) if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else tuple(size)
        return self._empty_pinned(torch.empty(0, dtype=dtype), shape)

    def pin_empty_like(self, tensor: torch.Tensor, device="cpu", dtype: torch.dtype | None = None) -> torch.Tensor:
        _require_host(device)
        return self._empty_pinned(torch.empty(0, dtype=tensor.dtype if dtype is None else dtype), tuple(tensor.shape))

    def pin_memory_alignment(self) -> int:
        return 1

    def supports_nvtx_domain(self) -> bool:
        return False

    def is_fp64_supported(self) -> bool:
        return True

    def set_visible_devices_envs(self, current_env: dict, local_accelerator_ids) -> None:
        """Writes the ids, comma-separated, into each of `visible_devices_envs()` in `current_env`."""
        for env in self.visible_devices_envs():
            current_env[env] = ",".join(map(str, local_accelerator_ids))

    # ---- DeepSpeed's typed tensor constructors: on CPU torch's legacy classes, on CUDA `torch.tensor`
    # of the dtype on the device (DeepSpeed's two accelerators)
    def _typed_tensor(self, dtype: torch.dtype, legacy: str):
        if self._name == "cpu":
            return getattr(torch, legacy)
        return functools.partial(torch.tensor, dtype=dtype, device=self._name)

    BFloat16Tensor = property(lambda self: self._typed_tensor(torch.bfloat16, "BFloat16Tensor"))
    ByteTensor = property(lambda self: self._typed_tensor(torch.uint8, "ByteTensor"))
    DoubleTensor = property(lambda self: self._typed_tensor(torch.double, "DoubleTensor"))
    FloatTensor = property(lambda self: self._typed_tensor(torch.float, "FloatTensor"))
    HalfTensor = property(lambda self: self._typed_tensor(torch.half, "HalfTensor"))
    IntTensor = property(lambda self: self._typed_tensor(torch.int, "IntTensor"))
    LongTensor = property(lambda self: self._typed_tensor(torch.long, "LongTensor"))

    # ---- op builders: none, by design
    def create_op_builder(self, class_name: str):
        raise NotImplementedError(f"get_accelerator().create_op_builder({class_name!r}): lightspeed builds no C++/CUDA "
                                  "ops; its kernels are Triton and PyTorch (see lightspeed.ops)")

    get_op_builder = create_op_builder

    def build_extension(self):
        raise NotImplementedError("get_accelerator().build_extension(): lightspeed builds no C++/CUDA extensions")

    def __repr__(self) -> str:
        return f"<lightspeed {type(self).__name__} {self._name}, backend {self._communication_backend_name}>"


class CudaAccelerator(Accelerator):
    _name = "cuda"
    _communication_backend_name = "nccl"

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def device(self, device_index: int | None = None):
        return torch.cuda.device(device_index)

    def set_device(self, device_index: int) -> None:
        torch.cuda.set_device(device_index)

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def synchronize(self, device_index: int | None = None) -> None:
        torch.cuda.synchronize(device_index)

    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported()

    def is_fp16_supported(self) -> bool:
        return True

    def is_triton_supported(self) -> bool:
        return torch.cuda.get_device_capability() >= (8, 0)

    # random numbers
    def manual_seed_all(self, seed: int) -> None:
        torch.cuda.manual_seed_all(seed)

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        return torch.cuda.get_rng_state("cuda" if device_index is None else device_index)

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        torch.cuda.set_rng_state(new_state, "cuda" if device_index is None else device_index)

    def default_generator(self, device_index: int):
        return torch.cuda.default_generators[device_index]

    # streams and events
    @property
    def Stream(self):
        return torch.cuda.Stream

    @property
    def Event(self):
        return torch.cuda.Event

    def stream(self, stream):
        return torch.cuda.stream(stream)

    def current_stream(self, device_index: int | None = None):
        return torch.cuda.current_stream(device_index)

    def default_stream(self, device_index: int | None = None):
        return torch.cuda.default_stream(device_index)

    # memory
    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_allocated(device_index)

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_allocated(device_index)

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        torch.cuda.reset_peak_memory_stats(device_index)

    def memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_reserved(device_index)

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_reserved(device_index)

    memory_cached = memory_reserved
    max_memory_cached = max_memory_reserved
    reset_max_memory_cached = reset_max_memory_allocated

    def memory_stats(self, device_index: int | None = None) -> dict:
        return torch.cuda.memory_stats(device_index)

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        torch.cuda.reset_peak_memory_stats(device_index)

    def total_memory(self, device_index: int | None = None) -> int:
        return torch.cuda.get_device_properties(device_index or 0).total_memory

    def available_memory(self, device_index: int | None = None) -> int:
        return torch.cuda.mem_get_info(device_index)[0]

    # host memory
    def _pin(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.pin_memory()

    def _empty_pinned(self, template: torch.Tensor, shape) -> torch.Tensor:
        return torch.empty(shape, dtype=template.dtype, device="cpu", pin_memory=True)

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned()

    def lazy_call(self, callback) -> None:
        torch.cuda._lazy_call(callback)

    def range_push(self, msg: str, domain=None, category=None) -> None:
        _no_nvtx_domain(domain)
        torch.cuda.nvtx.range_push(msg)

    def range_pop(self, domain=None) -> None:
        _no_nvtx_domain(domain)
        torch.cuda.nvtx.range_pop()

    def visible_devices_envs(self) -> list[str]:
        return ["CUDA_VISIBLE_DEVICES"]

    def export_envs(self) -> list[str]:
        return ["NCCL"]

    # ---- CUDA graphs
    def is_current_stream_capturing(self) -> bool:
        return torch.cuda.is_current_stream_capturing()

    def create_graph(self):
        return torch.cuda.CUDAGraph()

    def capture_to_graph(self, graph, pool=None, stream=None):
        return torch.cuda.graph(graph, pool, stream)

    def replay_graph(self, graph) -> None:
        graph.replay()


class CpuAccelerator(Accelerator):
    _name = "cpu"
    _communication_backend_name = "gloo"

    def is_available(self) -> bool:
        return True

    def device(self, device_index: int | None = None):
        return contextlib.nullcontext()

    def set_device(self, device_index: int) -> None:
        pass  # one CPU device

    def current_device(self) -> int:
        return int(os.environ.get("LOCAL_RANK", 0))  # DeepSpeed's CPU accelerator: the rank on this node

    def current_device_name(self) -> str:
        return "cpu"

    def device_name(self, device_index: int | str | None = None) -> str:
        return "cpu"  # torch has one CPU device whatever the index

    def device_count(self) -> int:
        return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", 1)))

    def synchronize(self, device_index: int | None = None) -> None:
        pass

    def is_bf16_supported(self) -> bool:
        return True

    def is_fp16_supported(self) -> bool:
        return True

    def is_triton_supported(self) -> bool:
        return False

    # random numbers
    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        torch.set_rng_state(new_state)

    def default_generator(self, device_index: int = 0):
        return torch.default_generator

    # streams and events
    @property
    def Stream(self):
        return _CpuStream

    @property
    def Event(self):
        return _CpuEvent

    def stream(self, stream):
        return contextlib.nullcontext()

    def current_stream(self, device_index: int | None = None) -> _CpuStream:
        return _DEFAULT_CPU_STREAM

    default_stream = current_stream

    # memory: this process's resident set (module Note)
    def empty_cache(self) -> None:
        pass

    def memory_allocated(self, device_index: int | None = None) -> int:
        return _proc_status_bytes("VmRSS")

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        try:
            return _proc_status_bytes("VmHWM")
        except (OSError, RuntimeError):  # not Linux: getrusage's peak (kB on Linux/BSD, bytes on macOS)
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            return peak if os.uname().sysname == "Darwin" else peak * 1024

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        with open("/proc/self/clear_refs", "w") as f:  # "5" resets the peak RSS (VmHWM) to the current RSS
            f.write("5")

    reset_max_memory_allocated = reset_peak_memory_stats
    memory_reserved = memory_allocated
    max_memory_reserved = max_memory_allocated
    memory_cached = memory_allocated
    max_memory_cached = max_memory_allocated
    reset_max_memory_cached = reset_peak_memory_stats

    def memory_stats(self, device_index: int | None = None) -> dict:
        return {"allocated_bytes.all.current": self.memory_allocated(),
                "allocated_bytes.all.peak": self.max_memory_allocated()}

    def total_memory(self, device_index: int | None = None) -> int:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def available_memory(self, device_index: int | None = None) -> int:
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")

    # host memory: page-locking only speeds up copies to a GPU, so the CPU device leaves tensors as they are
    def _pin(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def _empty_pinned(self, template: torch.Tensor, shape) -> torch.Tensor:
        return template.new_empty(shape, device="cpu")

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return torch.cuda.is_available() and tensor.is_pinned()

    def lazy_call(self, callback) -> None:
        callback()

    def range_push(self, msg: str, domain=None, category=None) -> None:
        _no_nvtx_domain(domain)  # no NVTX on CPU: the ranges mark nothing

    def range_pop(self, domain=None) -> None:
        _no_nvtx_domain(domain)

    def visible_devices_envs(self) -> list[str]:
        return []

    def export_envs(self) -> list[str]:
        return []

    # ---- CUDA graphs: none on CPU (DeepSpeed's CPU accelerator runs the captured code once and replays
    # nothing; here a capture is refused, so a graph never silently stands still)
    def is_current_stream_capturing(self) -> bool:
        return False

    def create_graph(self, *args, **kwargs):
        raise NotImplementedError("get_accelerator(): CUDA graphs (create_graph, capture_to_graph, replay_graph) need "
                                  "a CUDA device (this process runs on CPU)")

    capture_to_graph = replay_graph = create_graph


_ACCELERATOR: Accelerator | None = None


def get_accelerator() -> Accelerator:
    """The process-wide accelerator: CUDA when `default_device()` picks it, else CPU."""
    global _ACCELERATOR
    if _ACCELERATOR is None:
        _ACCELERATOR = CudaAccelerator() if default_device().type == "cuda" else CpuAccelerator()
    return _ACCELERATOR
