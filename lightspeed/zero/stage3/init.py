"""`zero.Init`: build a model so that no rank ever holds all of it, and the rule that gives each
parameter its initial value when the stage-3 strategy materializes the model one module at a time.

Owns: the construction context and the initialization rule. Must not: shard or communicate (the
strategy materializes and shards; it calls `materialize_module` one module at a time).

Note (how initial values are produced under Init):
    Inside `Init`, every parameter registered on a module is replaced, at registration, by a meta
    tensor of the same shape and dtype (through torch's global parameter-registration hook; buffers
    stay real). Constructor code that initializes parameters therefore runs on meta tensors and
    has no effect. When `initialize()` builds the stage-3 strategy, the strategy walks
    `model.named_modules()`; for the module at position `index` that owns parameters (first owner of
    a tied parameter), it allocates those parameters, in their constructed dtype, on the training
    device, and with the global RNG forked and seeded with `seed + index` runs:
        1. `module.reset_parameters()`, if the module defines it (what torch layers run when built);
        2. then `root._init_weights(module)`, if the root model defines it (the Hugging Face rule);
        3. when neither exists, the parameters are zero (with a warning naming them).
    Only the module's own parameters change: any other parameter the initializer could reach (a
    child's, or a tied one owned elsewhere) is swapped for a meta stand-in meanwhile. The values are
    then cast to the training dtype, broadcast from rank 0, and only this rank's slice is kept.
    `seed` is `Init(seed=...)`, or else drawn from rank 0's global RNG state at `Init.__enter__`
    (without advancing it). So a model's whole-model init code (e.g. a GPT's `init_weights()`
    looping over all modules) does not run under Init; `initialize_module_weights(model, seed)`
    applies the same rule to a normally built model, which then starts from exactly the values it
    would get under `Init(seed=seed)` (on the same device type).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable

import torch

from lightspeed._utils.init_on_device import ParameterRegistrationContext
from lightspeed._utils.logging import get_logger, warn_once

logger = get_logger(__name__)


@dataclass(frozen=True)
class InitRecord:
    seed: int


# Modules that got parameters inside an Init context -> that context's record (modules hash by identity).
_RECORDS: "weakref.WeakKeyDictionary[torch.nn.Module, InitRecord]" = weakref.WeakKeyDictionary()


def init_record(module: torch.nn.Module) -> InitRecord | None:
    return _RECORDS.get(module)


def seed_from_global_rng() -> int:
    g = torch.Generator()
    g.set_state(torch.get_rng_state())  # a copy: the global RNG does not advance
    return int(torch.randint(0, 2**62, (), generator=g))


class Init(ParameterRegistrationContext):
    """Context manager: models constructed inside hold meta parameters; the stage-3 strategy built by
    `lightspeed.initialize` materializes them shard by shard (see the Note of this module).

    DeepSpeed's signature. `remote_device` "cpu"/"nvme" (parameter offload) is not implemented;
    `data_parallel_group`, `mpu`, `config(_dict_or_path)` and `pin_memory` are accepted (the engine's
    data-parallel group and config decide the sharding); `dtype` is accepted and ignored (parameters
    are initialized in their constructed dtype and cast to the config's training dtype); `module`, an
    already built model, is left as it is (the strategy shards real parameters directly). `seed`
    (lightspeed's addition) fixes the initialization seed.
    """

    def __init__(self, module: torch.nn.Module | None = None, data_parallel_group=None, config_dict_or_path=None,
                 remote_device=None, pin_memory: bool = False, config=None, enabled: bool = True, dtype=None,
                 mpu=None, *, seed: int | None = None):
        if remote_device is not None and str(remote_device).lower() in ("cpu", "nvme"):
            raise NotImplementedError(f"zero.Init(remote_device={remote_device!r}): parameter offload is not "
                                      "implemented yet")
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"zero.Init(dtype=...): expected a floating-point torch dtype (got {dtype!r})")
        self.module, self.enabled, self.seed = module, enabled, seed
        self._record: InitRecord | None = None

    def _enter(self) -> None:
        self._record = InitRecord(self.seed if self.seed is not None else seed_from_global_rng())

    def _on_register(self, module: torch.nn.Module, name: str, param):
        if param is None:
            return None
        _RECORDS[module] = self._record
        if param.is_meta:
            return None  # already deferred (a tied parameter, or a nested Init)
        return torch.nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device="meta"),
                                  requires_grad=param.requires_grad)


def owned_params(root: torch.nn.Module) -> list[tuple[int, str, torch.nn.Module, list[tuple[str, torch.nn.Parameter]]]]:
    """`(index in named_modules, module name, module, [(full name, param)])` for each module owning
    parameters; a parameter registered on several modules (tied) belongs to the first one."""
    seen: set[int] = set()
    out = []
    for index, (mname, module) in enumerate(root.named_modules()):
        own = []
        for pname, p in module.named_parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                own.append((f"{mname}.{pname}" if mname else pname, p))
        if own:
            out.append((index, mname, module, own))
    return out


def _meta_like(p: torch.nn.Parameter, shape) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.empty(shape, dtype=p.dtype, device="meta"), requires_grad=p.requires_grad)


def materialize_module(root: torch.nn.Module, module: torch.nn.Module, index: int, owned, seed: int,
                       device: torch.device, shape_of: Callable[[torch.nn.Parameter], torch.Size]) -> None:
    """Give `owned` (params of `module`, meta or real) real storage on `device` (when meta) and their
    initial values by the rule of this module's Note. `shape_of(p)` is p's logical shape (a stage-3
    parameter that is already sharded has an empty `.data`)."""
    for _, p in owned:
        if p.is_meta:
            torch.utils.swap_tensors(p, torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device),
                                                           requires_grad=p.requires_grad))
    owned_ids = {id(p) for _, p in owned}
    stand_ins = []
    for p in module.parameters():
        if id(p) not in owned_ids and not p.is_meta:
            stand_in = _meta_like(p, shape_of(p))
            torch.utils.swap_tensors(p, stand_in)
            stand_ins.append((p, stand_in))
    try:
        devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            torch.manual_seed(seed + index)
            reset = getattr(module, "reset_parameters", None)
            init_weights = getattr(root, "_init_weights", None)
            if callable(reset):
                reset()
            if callable(init_weights):
                init_weights(module)
            if not callable(reset) and not callable(init_weights):
                warn_once(f"ZeRO-3 Init: {type(module).__name__} has no reset_parameters() and the model no "
                          f"_init_weights(); its parameters {', '.join(n for n, _ in owned)} start at zero", logger)
                for _, p in owned:
                    p.zero_()
    finally:
        for p, stand_in in stand_ins:
            torch.utils.swap_tensors(p, stand_in)


def initialize_module_weights(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Re-initialize a normally built `model` in place by the rule that `Init(seed=seed)` + stage 3 use,
    so both start from the same values. Returns `model`."""
    for index, _, module, owned in owned_params(model):
        device = owned[0][1].device
        materialize_module(model, module, index, owned, seed, device, lambda p: p.shape)
    return model
