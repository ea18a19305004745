"""`deepspeed.runtime.sequence_parallel`: Ulysses / ALST sequence parallelism (`ulysses_sp`) and the
`parallel_state_sp` group accessors, over `lightspeed.sequence` and `lightspeed.comm.sequence_groups`."""

import importlib

_SUBMODULES = ("parallel_state_sp", "ulysses_sp")


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'deepspeed.runtime.sequence_parallel' (lightspeed) has no attribute {name!r}")
