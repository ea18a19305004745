"""`zero.Init`: build a model so that no rank ever holds all of it, and the rule that gives each
parameter its initial value, one module at a time.

Owns: the construction context, the initialization rule, and the storage of an `Init`-built model's
shards until a stage-3 strategy takes them over (`take_init_groups`). Must not: schedule gathers
for training (the strategy's coordinator does).

Note (how a model is partitioned under Init):
    Inside `Init`, every parameter registered on a module is replaced, at registration, by a meta
    `ZeroParameter` of the same shape and dtype (torch's global parameter-registration hook; buffers
    stay real), so constructor code runs on meta tensors: nothing is allocated and it has no effect.
    On leaving the outermost `Init` block, the models built inside (their roots are found through
    torch's global module-registration hook) are partitioned one module at a time, in
    `named_modules()` order: the module's own meta parameters are allocated on the device
    (`cuda:<local_rank>`, or the CPU), given their initial values by the rule below, broadcast from
    rank 0, and stored as one `ParamGroup` per `requires_grad` value holding only this rank's
    `1/world` slice (`with_grads=False`: no gradient shard); each parameter is then an empty
    placeholder on the device. So the peak is one module's parameters, never the model.
    The rule, for the module at position `index` of its root's `named_modules()` (first owner of a
    tied parameter), run with the global RNG forked and seeded with `seed + index`:
        1. `module.reset_parameters()`, if the module defines it (what torch layers run when built);
        2. then `root._init_weights(module)`, if the root model defines it (the Hugging Face rule);
        3. when neither exists, the parameters are zero (with a warning naming them).
    Only the module's own parameters change: any other parameter the initializer could reach (a
    child's, or a tied one owned elsewhere) is swapped for a meta stand-in meanwhile. `seed` is
    `Init(seed=...)`, or else drawn from rank 0's global RNG state at `Init.__enter__` (without
    advancing it). So a model's whole-model init code (e.g. a GPT's `init_weights()` looping over all
    modules) does not run under Init; `initialize_module_weights(model, seed)` applies the same rule
    to a normally built model, which then starts from exactly the values it gets under
    `Init(seed=seed)` (on the same device type). Under transformers' `no_init_weights` (which it
    enters with Init) the rule's init calls do nothing, and transformers then writes the real values
    through `GatheredParameters(..., modifier_rank=0)`.
    Between the block and `initialize()`, the shards live in these per-module groups, scheduled by
    `StandaloneScheduler` (gathered only inside `GatheredParameters`, released on leaving it: a
    write on the modifier rank is broadcast and lands in every rank's shard). The stage-3 strategy
    then takes the groups over (`take_init_groups`): for each of its units it gathers the unit's
    values from them and builds its own groups, so the peak there is one unit. A model built with
    meta parameters by other means (`OnDevice("meta")`) is still materialized by the strategy with
    the same rule.
    This is how a Hugging Face `from_pretrained` under ZeRO-3 loads (transformers 5.x): it builds
    the model inside `deepspeed.zero.Init`, then `_load_state_dict_into_zero3_model` walks the
    modules and, per module, gathers its parameters with `GatheredParameters(params,
    modifier_rank=0)` while rank 0 alone copies the checkpoint's tensors in (`_load_from_state_dict`);
    missing weights are initialized the same way. So the loaded values reach every rank's shard, and
    the most any rank holds whole is one module's parameters.

Note (buffers under Init):
    Buffers stay real, whole on every rank, and in the dtype their constructor gave them: Init's dtype
    is the parameters'. (*Changed* from DeepSpeed, whose Init makes every floating tensor that
    `torch.empty/zeros/ones/full/tensor/arange/eye/randn` create inside the block in its dtype, buffers
    made by those included, while one computed from them, an HF rotary `inv_freq`, keeps its own.) The
    buffers a model lists for fp32 (`data_types.keep_in_fp32_modules` of the config given to Init,
    "auto" without one; precision/module_dtypes.py) are upcast as the block ends, under an fp16/bf16
    Init dtype: before transformers' loader copies the checkpoint into them, so their values are not
    rounded on the way. `initialize()` then applies the same rules to the whole model.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable

import torch
from torch.nn.modules.module import register_module_module_registration_hook

from lightspeed._utils.device import default_device
from lightspeed._utils.init_on_device import ParameterRegistrationContext
from lightspeed._utils.logging import get_logger, warn_once
from lightspeed.comm import api as comm_api
from lightspeed.comm.collectives import Communicator
from lightspeed.comm.groups import ParallelGroups
from lightspeed.comm.init import detect_launch_env, init_distributed
from lightspeed.config.parse import read_source
from lightspeed.offload.policy import OffloadPolicy
from lightspeed.parallel.pipeline.module import PipelineModule
from lightspeed.precision.module_dtypes import keep_buffers_in_fp32, keep_in_fp32_pattern, keep_in_fp32_setting
from lightspeed.zero.stage3.param_group import RELEASED, ParamGroup, param_state
from lightspeed.zero.stage3.zero_param import ZeroParameter

logger = get_logger(__name__)


@dataclass(frozen=True)
class InitRecord:
    seed: int


# Modules that got parameters inside an Init context -> that context's record (modules hash by identity).
_RECORDS: "weakref.WeakKeyDictionary[torch.nn.Module, InitRecord]" = weakref.WeakKeyDictionary()
# Module -> the groups holding the shards of the parameters it owned when its Init block ended.
_INIT_GROUPS: "weakref.WeakKeyDictionary[torch.nn.Module, list[ParamGroup]]" = weakref.WeakKeyDictionary()
_ACTIVE: list["Init"] = []  # the Init blocks being run; only the outermost one partitions


def init_record(module: torch.nn.Module) -> InitRecord | None:
    return _RECORDS.get(module)


def take_init_groups(module: torch.nn.Module) -> list[ParamGroup]:
    """Remove and return the Init groups of `module` (the strategy takes their values over)."""
    return _INIT_GROUPS.pop(module, [])


def seed_from_global_rng() -> int:
    g = torch.Generator()
    g.set_state(torch.get_rng_state())  # a copy: the global RNG does not advance
    return int(torch.randint(0, 2**62, (), generator=g))


class StandaloneScheduler:
    """Gathers and releases groups that no strategy schedules (Init's): a group is gathered while some
    `GatheredParameters` holds it and released when the last one leaves. (External parameters
    registered meanwhile wait in `gathered.py` for the strategy.)"""

    def fetch(self, g: ParamGroup) -> None:
        g.gather()

    def fetch_now(self, groups) -> None:
        for g in groups:
            g.gather()
        for g in groups:
            g.wait()

    def release(self, g: ParamGroup, force: bool = False, hand_over: bool = False) -> None:
        if g.state != RELEASED and (force or g.pins == 0):
            g.release(hand_over=hand_over)

    def holders(self, g: ParamGroup) -> list[torch.nn.Module]:
        """No module hooks run before a strategy takes the groups: no forward holds one."""
        return []


_STANDALONE = StandaloneScheduler()


def _config_dtype(config) -> torch.dtype | None:
    """The training dtype a DeepSpeed config asks for (fp16 / bf16 sections), or None."""
    for key, dtype in (("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16), ("fp16", torch.float16)):
        section = config.get(key)
        if isinstance(section, dict) and section.get("enabled") is True:
            return dtype
    return None


class Init(ParameterRegistrationContext):
    """Context manager: models constructed inside are partitioned over the data-parallel group as the
    block ends, one module at a time (see the Note of this module); `lightspeed.initialize` with
    ZeRO stage 3 then trains them without ever gathering the whole model.

    DeepSpeed's signature. The group is `data_parallel_group`, else `mpu`'s data-parallel group, else
    the world (torch.distributed is started from the launcher's environment when it is not yet).
    `dtype`, else the config's fp16/bf16 (`config_dict_or_path`, or its older name `config`), else
    the constructed dtype, is the dtype the shards are stored in. `module`, an already built model,
    is partitioned at once. `remote_device` "cpu" (or the config's `zero_optimization.offload_param`
    device "cpu") keeps the shards in host memory; "nvme" (NVMe at construction), hpZ
    (`zero_param_parallel_group`), quantized weights and `param_swapper` are not implemented and raise. `mem_efficient_linear` and `pin_memory` are
    accepted: the first replaces F.linear in DeepSpeed to free gathered weights early, which the
    release of each group's storage already does here; the second matters only with offload.
    `seed` (lightspeed's addition) fixes the initialization seed. Nested blocks partition once, at
    the outermost one's end.
    """

    def __init__(self, module: torch.nn.Module | None = None, data_parallel_group=None,
                 mem_efficient_linear: bool = True, remote_device=None, pin_memory: bool = False,
                 config_dict_or_path=None, config=None, enabled: bool = True, dtype=None, mpu=None,
                 zero_param_parallel_group=None, zero_quantized_weights: bool = False,
                 zero_quantized_nontrainable_weights: bool = False, sequence_data_parallel_group=None,
                 param_swapper=None, *, seed: int | None = None):
        source = config_dict_or_path if config_dict_or_path is not None else config
        ds_config = read_source(source)[0] if source is not None else {}
        offload = (ds_config.get("zero_optimization") or {}).get("offload_param") or {}
        if remote_device is None and isinstance(offload, dict) and str(offload.get("device", "none")) != "none":
            remote_device = offload.get("device")
        remote = str(getattr(remote_device, "value", remote_device)).lower() if remote_device is not None and enabled \
            else "none"
        if remote == "nvme":
            raise NotImplementedError(f"zero.Init(remote_device={remote_device!r}) / zero_optimization.offload_param: "
                                      "partitioning onto NVMe at construction is not implemented yet (the engine's "
                                      "offload_param device \"nvme\" is: build the model with remote_device \"cpu\")")
        if remote not in ("none", "cpu", "cuda", str(default_device().type)):
            raise ValueError(f"zero.Init(remote_device={remote_device!r}): expected \"cpu\", \"nvme\" or None")
        # remote_device "cpu": each rank's shards are kept in host memory (pinned with pin_memory) until the
        # engine takes them over with its own offload_param placement. As DeepSpeed: a config's offload_param
        # block decides pinning (its pin_memory, true by default), else the argument.
        if isinstance((ds_config.get("zero_optimization") or {}).get("offload_param"), dict):
            pin_memory = offload.get("pin_memory", True)
        self._offload = OffloadPolicy(param="cpu", param_pin_memory=bool(pin_memory)) if remote == "cpu" \
            else OffloadPolicy()
        if zero_param_parallel_group is not None:
            raise NotImplementedError("zero.Init(zero_param_parallel_group=...): hpZ (zero_hpz_partition_size) "
                                      "is not implemented yet")
        if zero_quantized_weights or zero_quantized_nontrainable_weights:
            raise NotImplementedError("zero.Init(zero_quantized_weights=...): quantized weights (ZeRO++ qwZ) are "
                                      "not implemented yet")
        if sequence_data_parallel_group is not None and data_parallel_group is not None:
            raise ValueError("zero.Init: pass data_parallel_group or sequence_data_parallel_group, not both")
        if param_swapper is not None:
            raise NotImplementedError("zero.Init(param_swapper=...): NVMe parameter swapping is not implemented yet")
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"zero.Init(dtype=...): expected a floating-point torch dtype (got {dtype!r})")
        self.enabled, self.seed = enabled, seed
        self.dtype = dtype if dtype is not None else _config_dtype(ds_config)
        self.keep_in_fp32 = keep_in_fp32_setting((ds_config.get("data_types") or {}).get("keep_in_fp32_modules"))
        # with sequence parallelism ZeRO partitions over dp x sp (DeepSpeed's sequence-data-parallel group)
        self._group_source = (data_parallel_group if data_parallel_group is not None else sequence_data_parallel_group,
                              mpu)
        self._record: InitRecord | None = None
        self._created: list[torch.nn.Parameter] = []  # the meta parameters this block made
        self._modules: dict[int, torch.nn.Module] = {}  # id -> module that got parameters or children here
        self._children: set[int] = set()  # ids of modules registered as a child of another
        self._module_hook = None
        self._outermost = False
        if enabled and data_parallel_group is None and sequence_data_parallel_group is None:
            self._start_distributed()  # at construction, as DeepSpeed's
        if module is not None and enabled:
            self._partition_built(module)

    # ---------------------------------------------------------------- where and how
    @staticmethod
    def _start_distributed() -> None:
        """DeepSpeed's Init starts torch.distributed when a launcher's environment is there (also a
        one-process one: RANK / WORLD_SIZE set); a no-op once it is started, or without one."""
        if detect_launch_env().source != "single-process":
            init_distributed()

    def _comm(self) -> Communicator:
        group, mpu = self._group_source
        self._start_distributed()
        if group is not None:
            return Communicator(group)
        groups = ParallelGroups.build(mpu)
        return Communicator(groups.seq_dp_group, groups.seq_dp_world_size)

    # ---------------------------------------------------------------- the block
    def __enter__(self):
        if not self.enabled:
            return self
        self._outermost = not _ACTIVE
        _ACTIVE.append(self)
        if self._outermost:
            super().__enter__()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self.enabled:
            return
        _ACTIVE.pop()
        if self._outermost:
            super().__exit__(exc_type, exc, tb)

    def _enter(self) -> None:
        self._record = InitRecord(self.seed if self.seed is not None else seed_from_global_rng())
        self._module_hook = register_module_module_registration_hook(self._on_register_module)

    def _exit(self, exc_type, exc, tb) -> None:
        self._module_hook.remove()
        self._module_hook = None
        if exc_type is None:
            self._partition_created()
        self._created.clear()
        self._modules.clear()
        self._children.clear()

    def _on_register_module(self, module: torch.nn.Module, name: str, submodule):
        self._modules.setdefault(id(module), module)
        if submodule is not None:
            self._modules.setdefault(id(submodule), submodule)
            self._children.add(id(submodule))
        return None

    def _on_register(self, module: torch.nn.Module, name: str, param):
        if param is None:
            return None
        _RECORDS[module] = self._record
        self._modules.setdefault(id(module), module)
        if param.is_meta:
            return None  # already deferred (a tied parameter)
        dtype = self.dtype if self.dtype is not None and param.is_floating_point() else param.dtype
        meta = ZeroParameter(torch.empty(param.shape, dtype=dtype, device="meta"), requires_grad=param.requires_grad)
        self._created.append(meta)
        return meta

    # ---------------------------------------------------------------- partitioning
    def _partition_created(self) -> None:
        created = {id(p) for p in self._created}
        roots = [m for key, m in self._modules.items() if key not in self._children]
        comm = self._comm()
        _check_pipeline_group(roots, comm)
        seed = torch.tensor([self._record.seed], dtype=torch.int64, device=default_device())
        comm.broadcast(seed, src=0)
        device = default_device()
        for root in roots:
            for index, mname, module, owned in owned_params(root):
                mine = [(n, p) for n, p in owned if id(p) in created and p.is_meta]
                if mine:
                    materialize_module(root, module, index, mine, int(seed.item()), device, _logical_shape)
                    self._store(module, mine, comm, device)
            self._keep_in_fp32(root)

    def _partition_built(self, model: torch.nn.Module) -> None:
        """`Init(module=model)`: partition an already built model's parameters as they are."""
        comm, device = self._comm(), default_device()
        _check_pipeline_group([model], comm)
        for _, _, module, owned in owned_params(model):
            plain = [(n, p) for n, p in owned if not p.is_meta and param_state(p) is None]
            if plain:
                self._store(module, plain, comm, device)
        self._keep_in_fp32(model)

    def _keep_in_fp32(self, root: torch.nn.Module) -> None:
        """The buffers `root` lists for fp32 (data_types.keep_in_fp32_modules) upcast now, before a loader
        copies a checkpoint into them (precision/module_dtypes.py)."""
        upcast = keep_buffers_in_fp32(root, keep_in_fp32_pattern(root, self.keep_in_fp32, self.dtype))
        if upcast:
            logger.info("zero.Init: %d buffers of %s kept in fp32 (data_types.keep_in_fp32_modules)", len(upcast),
                        type(root).__name__)

    def _store(self, module: torch.nn.Module, owned, comm: Communicator, device: torch.device) -> None:
        store_init_groups(module, owned, comm, device, self.dtype, self._offload)


def _check_pipeline_group(roots: list[torch.nn.Module], comm: Communicator) -> None:
    """Each stage of a PipelineModule builds other layers, so its parameters are partitioned over its own
    stage's data-parallel ranks; a group spanning stages would pair unlike collectives (before any is issued,
    so every rank of such a group raises)."""
    for root in roots:
        if not isinstance(root, PipelineModule) or root.num_stages == 1:
            continue
        topology = root.topology()
        ranks = [comm_api.get_global_rank(comm.group, r) for r in range(comm.world_size)] if comm.world_size > 1 \
            else [comm_api.get_rank() if comm_api.is_initialized() else 0]
        stages = sorted({topology.get_coord(r).pipe for r in ranks})
        if len(stages) > 1:
            raise ValueError(f"zero.Init over a PipelineModule of {root.num_stages} stages (zero_optimization.stage 3): "
                             f"its group spans the ranks of stages {stages}, which build other layers; pass the "
                             "stage's data-parallel group (data_parallel_group=PipelineParallelGrid(topology)"
                             ".get_data_parallel_group())")


def store_init_groups(module: torch.nn.Module, owned, comm: Communicator, device: torch.device,
                      dtype: torch.dtype | None, offload: OffloadPolicy) -> None:
    """Keep only this rank's slice of `owned` (params of `module` with full values now, the same on
    every rank of `comm`) in Init groups, one per (requires_grad, dtype); `dtype` None keeps each one's."""
    kinds: dict[tuple[bool, torch.dtype], list] = {}
    for n, p in owned:
        if not p.is_floating_point():
            raise TypeError(f"zero.Init partitions floating-point parameters only ({n} is {p.dtype})")
        kinds.setdefault((p.requires_grad, dtype or p.dtype), []).append((n, p))
    for (_, kind), items in kinds.items():
        g = ParamGroup(f"init:{type(module).__name__}", [p for _, p in items], [n for n, _ in items],
                       [p.detach() for _, p in items], comm, dtype=kind, device=device, grad_dtype=kind,
                       keep_master=False, with_grads=False, offload=offload)
        g.coordinator = _STANDALONE
        _INIT_GROUPS.setdefault(module, []).append(g)


def _logical_shape(p: torch.nn.Parameter) -> torch.Size:
    st = param_state(p)
    return torch.Size(st.shape) if st is not None else p.shape


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
        if p.is_meta:  # the class is kept (a ZeroParameter stays one)
            torch.utils.swap_tensors(p, type(p)(torch.empty(p.shape, dtype=p.dtype, device=device),
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
