"""Random-number state for activation checkpointing: DeepSpeed's (Megatron's) `CudaRNGStatesTracker`,
`model_parallel_cuda_manual_seed`, and the snapshot a checkpoint takes so its recomputation draws the
same random numbers (dropout masks) as the forward did.

Owns: the process's one tracker of named generator states and the snapshot/restore of the host and
device generators. Must not: know about partitioning or autograd (`function.py` does).

"Device" means the accelerator `lightspeed._utils.accelerator.get_accelerator()` picks: the current
CUDA device where CUDA is used, the CPU generator otherwise. The tracker's names keep DeepSpeed's
"cuda" spelling; on a CPU run they hold CPU generator states, so the same model code forks the same
streams on either device.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass

import torch

from lightspeed._utils.accelerator import get_accelerator

MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"  # DeepSpeed's `_MODEL_PARALLEL_RNG_TRACKER_NAME`
MODEL_PARALLEL_SEED_OFFSET = 2718  # DeepSpeed's offset between the data- and model-parallel seeds


def _device_is_cuda() -> bool:
    return get_accelerator().device_name() == "cuda"


def get_device_rng_state() -> torch.Tensor:
    """The state of the device's default generator (the CPU generator's on a CPU run)."""
    return get_accelerator().get_rng_state()


def set_device_rng_state(state: torch.Tensor) -> None:
    get_accelerator().set_rng_state(state)


def seed_device(seed: int) -> None:
    """Seed the device's default generator only (DeepSpeed: `get_accelerator().manual_seed`, which is
    `torch.cuda.manual_seed` on CUDA): on CUDA the host generator is left alone."""
    if _device_is_cuda():
        torch.cuda.manual_seed(seed)
    else:
        torch.default_generator.manual_seed(seed)


class CudaRNGStatesTracker:
    """Named generator states of the device. `add(name, seed)` creates one; `fork(name)` runs a block
    with the device generator set to it and keeps what the block drew, so code in a model-parallel
    region draws from its own stream while the default stream continues undisturbed outside."""

    def __init__(self):
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def reset(self) -> None:
        """Forget every state and seed."""
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        """A copy of the name -> state map. Forking replaces a state tensor rather than writing into
        it, so the copy is a snapshot."""
        return copy.copy(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Replace the map (the tensors are not checked or copied, as DeepSpeed)."""
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        """Track a new state `name`, seeded with `seed`; the device generator is left as it was."""
        if seed in self.seeds_:
            raise ValueError(f"CudaRNGStatesTracker.add: seed {seed} is already used")
        if name in self.states_:
            raise ValueError(f"CudaRNGStatesTracker.add: a state named {name!r} already exists")
        self.seeds_.add(seed)
        original = get_device_rng_state()
        seed_device(seed)
        self.states_[name] = get_device_rng_state()
        set_device_rng_state(original)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG_TRACKER_NAME):
        """Run the block with the device generator in state `name`; afterwards `name` holds where the
        block left it and the device generator is back where it was."""
        if name not in self.states_:
            raise KeyError(f"CudaRNGStatesTracker.fork: no state named {name!r} (add it first, e.g. with "
                           "model_parallel_cuda_manual_seed)")
        original = get_device_rng_state()
        set_device_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = get_device_rng_state()
            set_device_rng_state(original)


_TRACKER = CudaRNGStatesTracker()


def get_cuda_rng_tracker() -> CudaRNGStatesTracker:
    """The process's tracker (DeepSpeed's `get_cuda_rng_tracker`)."""
    return _TRACKER


def model_parallel_seeds(seed: int, tp_rank: int) -> tuple[int, int]:
    """(data-parallel seed, model-parallel seed) for `seed` on tensor-parallel rank `tp_rank`: the
    default stream is the same on every rank of a model-parallel group, the tracked one differs."""
    return seed, seed + MODEL_PARALLEL_SEED_OFFSET + tp_rank


def seed_model_parallel(seed: int, tp_rank: int) -> tuple[int, int]:
    """Seed the device generator with the data-parallel seed and (re)create the tracker's
    model-parallel state; returns both seeds."""
    dp_seed, mp_seed = model_parallel_seeds(seed, tp_rank)
    _TRACKER.reset()
    seed_device(dp_seed)
    _TRACKER.add(MODEL_PARALLEL_RNG_TRACKER_NAME, mp_seed)
    return dp_seed, mp_seed


@dataclass(frozen=True)
class RngSnapshot:
    """The host generator, the device generator (None on a CPU run: it is the host one) and the
    tracker's states at one moment."""

    host: torch.Tensor
    device: torch.Tensor | None
    tracked: dict[str, torch.Tensor]

    @classmethod
    def take(cls) -> "RngSnapshot":
        return cls(torch.get_rng_state(), get_device_rng_state() if _device_is_cuda() else None,
                   _TRACKER.get_states())

    def restore(self) -> None:
        torch.set_rng_state(self.host)
        if self.device is not None:
            set_device_rng_state(self.device)
        _TRACKER.set_states(self.tracked)

    @contextlib.contextmanager
    def replayed(self):
        """Run the block from this snapshot's states, then put back the states found on entry."""
        now = RngSnapshot.take()
        self.restore()
        try:
            yield
        finally:
            now.restore()
