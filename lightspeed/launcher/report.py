"""`lightspeed report`: what this machine offers lightspeed (DeepSpeed's `ds_report`).

Versions (lightspeed, torch, triton, CUDA, NCCL), the GPUs torch sees, the process launchers on PATH,
and for each kernel family whether it can run here and, if not, why. Works without a GPU and without
triton. Gathering (`gather`) is separate from printing (`format_report`), so tests can check either.

Triton is never imported here (only ops/**/triton.py may): its version comes from package metadata.

Kernel families are `KERNEL_FAMILIES` below, keyed by the module under `lightspeed.ops` that holds
them. A family whose module does not exist yet reports "not present in this version". A present
module may define ``availability() -> (bool, str)`` to answer for itself (the ops registry, once it
exists); otherwise the family's declared needs are checked against this machine.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import platform
import shutil
import sys
from dataclasses import dataclass, field
from typing import Optional

NOT_PRESENT = "not present in this version"


@dataclass(frozen=True)
class KernelFamily:
    """`module` under lightspeed.ops; `names` the classes/functions users reach for; `needs`: "cpu"
    (runs anywhere), "gpu" (a CUDA GPU and triton), optionally with a minimum compute capability.
    `without_kernel`: what the names run where the GPU needs are not met (the multi-tensor optimizers
    step with their plain-PyTorch reference there), or None when they do not run at all."""

    title: str
    module: str
    names: tuple[str, ...]
    needs: str = "gpu"
    min_capability: Optional[tuple[int, int]] = None
    without_kernel: Optional[str] = None


# where a CUDA GPU with triton is missing, FusedOptimizer's "auto" backend steps CPU tensors this way
_REFERENCE_STEP = "the optimizer steps with its plain-PyTorch reference (no Triton kernel)"
REFERENCE = "yes (reference)"


KERNEL_FAMILIES: list[KernelFamily] = [
    KernelFamily("fused Adam/AdamW", "lightspeed.ops.adam", ("FusedAdam",), without_kernel=_REFERENCE_STEP),
    KernelFamily("CPU Adam (offload)", "lightspeed.ops.adam", ("CPUAdam",), needs="cpu"),
    KernelFamily("fused Lamb", "lightspeed.ops.lamb", ("FusedLamb",), without_kernel=_REFERENCE_STEP),
    KernelFamily("fused Lion", "lightspeed.ops.lion", ("FusedLion",), without_kernel=_REFERENCE_STEP),
    KernelFamily("fused Adagrad", "lightspeed.ops.adagrad", ("FusedAdagrad",), without_kernel=_REFERENCE_STEP),
    KernelFamily("quantization (ZeRO++, int8/int4)", "lightspeed.ops.quantize", ("quantize", "dequantize"), needs="cpu"),
    KernelFamily("one-bit compression", "lightspeed.ops.onebit", ("pack_signs", "unpack_signs"), needs="cpu"),
    KernelFamily("weight-only FP6/INT8/INT4 linear", "lightspeed.ops.wquant", ("quantized_matmul",),
                 min_capability=(8, 0)),
    KernelFamily("MoE grouped GEMM (training)", "lightspeed.ops.grouped_gemm",
                 ("grouped_mm", "grouped_mlp", "permute", "unpermute"),
                 without_kernel="the plain-PyTorch reference (a loop over the experts) runs instead"),
]

LAUNCHER_PROGRAMS = ("pdsh", "ssh", "mpirun", "srun", "numactl")


@dataclass
class Machine:
    lightspeed: str
    lightspeed_path: str
    python: str
    torch: str
    torch_path: str
    cuda_build: Optional[str]
    cuda_available: bool
    nccl: Optional[str]
    triton: Optional[str]
    gpus: list[tuple[str, tuple[int, int], int]]  # (name, compute capability, memory bytes)
    accelerator_env: Optional[str]
    programs: dict[str, Optional[str]]
    deepspeed_api: str = ""  # the DeepSpeed release register_as_deepspeed() presents
    deepspeed_installed: Optional[str] = None  # a real DeepSpeed distribution's version, if one is installed
    offload: list[tuple[str, str]] = field(default_factory=list)  # (what, what this machine offers)


def _direct_io(directory: str) -> str:
    """Whether files in `directory` take O_DIRECT (what NVMe offload probes before using it)."""
    import mmap

    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return "no O_DIRECT on this platform: buffered IO"
    path = os.path.join(directory, f".lightspeed-report-{os.getpid()}")
    buf = mmap.mmap(-1, 4096)  # page-aligned, as O_DIRECT needs
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | flag, 0o600)
    except OSError as err:
        return f"buffered IO (O_DIRECT refused: {err.strerror})"
    try:
        os.pwrite(fd, buf, 0)
        return "O_DIRECT"
    except OSError as err:
        return f"buffered IO (O_DIRECT refused: {err.strerror})"
    finally:
        os.close(fd)
        os.unlink(path)


def offload_facts(cuda_available: bool) -> list[tuple[str, str]]:
    """What ZeRO-Offload / ZeRO-Infinity can do here: host memory, pinned buffers, swap IO."""
    import tempfile

    try:
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        host_text = f"{host / 2**30:.1f} GiB (Adam offloaded: 16 bytes per parameter: fp32 master, gradient, two moments)"
    except (ValueError, OSError, AttributeError):
        host_text = "unknown"
    pinned = ("yes: host buffers are page-locked, copies to and from the GPU run asynchronously" if cuda_available
              else "no GPU: offloaded runs use ordinary host buffers and the same code path")
    tmp = tempfile.gettempdir()
    return [("host memory", host_text), ("pinned memory", pinned),
            ("NVMe swap IO", f"{_direct_io(tmp)} in {tmp} (each nvme_path is probed when training starts)"),
            ("CPU optimizer", f"torch's fused CPU kernels on {os.cpu_count()} cores (CPUAdam, CPUAdagrad, CPULion)")]


def _package_version(name: str) -> Optional[str]:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def gather() -> Machine:
    import torch

    import lightspeed

    cuda = torch.cuda.is_available()
    gpus = []
    if cuda:
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            gpus.append((props.name, (props.major, props.minor), props.total_memory))
    nccl = None
    if cuda and hasattr(torch.cuda, "nccl"):
        try:
            version = torch.cuda.nccl.version()
            nccl = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
        except Exception as e:  # a CUDA build without NCCL
            nccl = f"unavailable ({type(e).__name__})"
    triton = _package_version("triton") or _package_version("pytorch-triton")
    from lightspeed.compat.registration import DEEPSPEED_VERSION, is_registered

    return Machine(
        lightspeed=lightspeed.__version__, lightspeed_path=os.path.dirname(lightspeed.__file__),
        python=f"{platform.python_version()} ({sys.executable})", torch=torch.__version__,
        torch_path=os.path.dirname(torch.__file__), cuda_build=torch.version.cuda, cuda_available=cuda,
        nccl=nccl, triton=triton, gpus=gpus, accelerator_env=os.environ.get("LIGHTSPEED_ACCELERATOR"),
        programs={name: shutil.which(name) for name in LAUNCHER_PROGRAMS}, offload=offload_facts(cuda),
        deepspeed_api=DEEPSPEED_VERSION,
        deepspeed_installed=None if is_registered() else _package_version("deepspeed"),
    )


def family_status(family: KernelFamily, machine: Machine) -> tuple[str, str]:
    """(status, reason): status is "yes", REFERENCE (the names run without the kernel), "no" or NOT_PRESENT."""
    status, why = _kernel_status(family, machine)
    # a "no" that is not the module failing to import is the machine lacking what the kernel needs
    if status == "no" and family.without_kernel is not None and not why.startswith(family.module):
        return REFERENCE, f"{why}: {family.without_kernel}"
    return status, why


def _kernel_status(family: KernelFamily, machine: Machine) -> tuple[str, str]:
    """(status, reason) for the family's kernel itself."""
    if importlib.util.find_spec("lightspeed.ops") is None or importlib.util.find_spec(family.module) is None:
        return NOT_PRESENT, f"{family.module} does not exist yet"
    try:
        module = importlib.import_module(family.module)
    except Exception as e:
        return "no", f"{family.module} fails to import: {type(e).__name__}: {e}"
    missing = [name for name in family.names if not hasattr(module, name)]
    if missing:
        return NOT_PRESENT, f"{family.module} has no {', '.join(missing)} yet"
    if callable(getattr(module, "availability", None)):
        ok, why = module.availability()
        return ("yes" if ok else "no"), why
    if family.needs == "cpu":
        return "yes", "runs on the CPU"
    if not machine.gpus:
        return "no", "no CUDA GPU seen" if machine.cuda_build else "torch is a CPU-only build (no CUDA)"
    if machine.triton is None:
        return "no", "triton is not installed"
    if family.min_capability:
        low = [name for name, cap, _ in machine.gpus if cap < family.min_capability]
        if low:
            need = ".".join(map(str, family.min_capability))
            return "no", f"needs compute capability {need} or newer ({low[0]} is older)"
    return "yes", f"triton {machine.triton} on {len(machine.gpus)} GPU(s)"


def format_report(machine: Machine) -> str:
    def line(key: str, value: object) -> str:
        return f"  {key:<22} {value}"

    out = ["lightspeed report", "", "versions",
           line("lightspeed", f"{machine.lightspeed} ({machine.lightspeed_path})"),
           line("python", machine.python),
           line("torch", f"{machine.torch} ({machine.torch_path})"),
           line("triton", machine.triton or "not installed"),
           line("CUDA (torch build)", machine.cuda_build or "none (CPU-only build)"),
           line("CUDA available", "yes" if machine.cuda_available else "no"),
           line("NCCL", machine.nccl or ("none" if not machine.cuda_available else "unknown")),
           line("LIGHTSPEED_ACCELERATOR", machine.accelerator_env or "(unset)"),
           line("DeepSpeed API", f"{machine.deepspeed_api} (what `import deepspeed` gives after "
                "lightspeed.register_as_deepspeed() or `lightspeed --as_deepspeed`)"),
           line("DeepSpeed installed", machine.deepspeed_installed or "no"),
           "", "GPUs"]
    if machine.gpus:
        for i, (name, cap, mem) in enumerate(machine.gpus):
            out.append(line(f"cuda:{i}", f"{name}, compute capability {cap[0]}.{cap[1]}, {mem / 2**30:.1f} GiB"))
    else:
        out.append("  none seen: training runs on CPU processes (gloo); use `lightspeed --num_procs N`")
    out += ["", "launchers (for multi-node jobs)"]
    out += [line(name, path or "not found") for name, path in machine.programs.items()]
    if machine.offload:
        out += ["", "offload (ZeRO-Offload / ZeRO-Infinity)"]
        out += [line(key, value) for key, value in machine.offload]
    out += ["", "kernel families", f"  {'family':<36} {'can run':<28} why"]
    for family in KERNEL_FAMILIES:
        status, why = family_status(family, machine)
        out.append(f"  {family.title:<36} {status:<28} {why}")
    return "\n".join(out)


def print_report() -> int:
    print(format_report(gather()))
    return 0
