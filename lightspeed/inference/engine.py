"""`init_inference`: DeepSpeed's `deepspeed.init_inference(model, dtype=..., ...)` shape, limited to
casting, device placement, loading a checkpoint (checkpoint.py) and weight-only quantization
(nn.Linear and transformers' Conv1D swapped for `QuantizedLinear`), tensor parallelism
(tensor_parallel.py), projection fusion for `replace_with_kernel_inject` (fusion.py) and CUDA graphs
(cuda_graph.py). Owns the argument checks and the module swap; must not change what the model's own
forward or generate compute (tensor parallelism only splits linear layers and all-reduces; fusion joins
linear layers that read the same input; enable_cuda_graph replays the same forward).
"""

from __future__ import annotations

import fnmatch
import os
import time

import torch
from torch import nn

from lightspeed._utils.device import default_device
from lightspeed._utils.logging import current_rank, get_logger
from lightspeed._utils.progress import progress
from lightspeed.inference import cuda_graph
from lightspeed.inference.checkpoint import load_checkpoint, rank_dir, replace_submodule, save_inference_checkpoint, \
    write_split_config
from lightspeed.inference.checkpoint_files import SplitFiles, resolve_checkpoint_files
from lightspeed.inference.experts import quantize_experts
from lightspeed.inference.fusion import GROUPS, fuse_projections
from lightspeed.inference.quantized_linear import QuantizedLinear, is_conv1d, linear_dims
from lightspeed.inference.tensor_parallel import EXPERTS, ROW_STYLES, Slice, attach_all_reduce, build_plan, \
    is_colwise, per_rank_attributes, shard_experts, shard_linear, tp_settings
from lightspeed.ops.wquant.reference import FORMATS, check_quant_args

logger = get_logger(__name__)

_QUANT_KEYS = ("enabled", "weight", "group_size", "include", "exclude")
_DTYPES = {"fp16": torch.float16, "float16": torch.float16, "half": torch.float16, "bf16": torch.bfloat16,
           "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32, "float": torch.float32}


# DeepSpeedInferenceConfig fields that only configure DeepSpeed's injected kernels (or a checkpoint load):
# without kernel injection they do nothing there either, so any value is taken and logged
_KERNEL_ONLY = ("triangular_masking", "tm", "return_tuple", "max_out_tokens", "max_tokens", "min_out_tokens",
                "min_tokens", "replace_method", "transposed_mode", "tp_grain_size", "use_triton", "triton_autotune",
                "training_mp_size")
# fields this engine does not implement, with DeepSpeed's default: any other value raises NotImplementedError
_NOT_IMPLEMENTED = {"injection_policy_tuple": None, "zero": {}, "moe": {}, "ep_size": 1,
                    "mpu": None, "set_empty_params": False}
_ALIASES = {"kernel_inject": "replace_with_kernel_inject", "tp": "tensor_parallel", "ckpt_config": "checkpoint_config",
            "injection_dict": "injection_policy"}


def _is_default(value, default) -> bool:
    empty = value is None or value is False or value in ({}, "")
    return value == default or (empty and not default)


def _check_deepspeed_keys(extra: dict) -> None:
    for key, value in extra.items():
        if key in _KERNEL_ONLY:
            logger.info("init_inference: %s=%r configures DeepSpeed's injected kernels; no effect here", key, value)
        elif key in _NOT_IMPLEMENTED:
            if not _is_default(value, _NOT_IMPLEMENTED[key]):
                raise NotImplementedError(f"init_inference: {key}={value!r} is not implemented (DeepSpeed default "
                                          f"{_NOT_IMPLEMENTED[key]!r})")
        else:
            raise ValueError(f"init_inference: unknown argument {key!r}")


def _is_int8(dtype) -> bool:
    return dtype is torch.int8 or (isinstance(dtype, str) and dtype.lower() in ("int8", "torch.int8"))


def _resolve_dtype(dtype) -> torch.dtype:
    if _is_int8(dtype):  # DeepSpeed's int8 inference: int8 weights, fp16 activations (see init_inference)
        return torch.float16
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(f"init_inference: dtype must be float16, bfloat16, float32 or int8 (got {dtype})")
        return dtype
    if isinstance(dtype, str) and dtype.lower() in _DTYPES:
        return _DTYPES[dtype.lower()]
    raise ValueError(f"init_inference: dtype must be float16, bfloat16, float32 or int8 (got {dtype!r})")


# DeepSpeed's QuantizationConfig (deepspeed/inference/config.py): {"enabled", "weight": {"enabled",
# "num_bits", "q_type", "q_groups", "quantized_initialization", "post_init_quant"}, "activation": {...},
# "qkv": {...}}; its weights are symmetric INT8 (num_bits 8) or INT4 (4)
_DS_BITS = {8: "int8", 4: "int4"}
_DS_WEIGHT_KEYS = ("enabled", "num_bits", "q_type", "q_groups", "quantized_initialization", "post_init_quant")


def _deepspeed_weight(weight: dict) -> tuple[bool, str]:
    """(enabled, format) of DeepSpeed's `quant['weight']` dict."""
    for key in weight:
        if key not in _DS_WEIGHT_KEYS:
            raise ValueError(f"init_inference: unknown quant['weight'] key {key!r} (DeepSpeed's: "
                             f"{', '.join(_DS_WEIGHT_KEYS)})")
    bits = weight.get("num_bits", 8)
    if bits not in _DS_BITS:
        raise ValueError(f"init_inference: quant['weight']['num_bits'] must be 8 or 4 (got {bits!r}); for FP6 "
                         "weights pass quant={'weight': 'fp6'}")
    if str(weight.get("q_type", "symmetric")).lower() not in ("symmetric", "sym", "quanttypeenum.sym"):
        raise NotImplementedError(f"init_inference: quant['weight']['q_type']={weight['q_type']!r} is not "
                                  "implemented (weights are quantized symmetrically)")
    for key in ("quantized_initialization", "post_init_quant"):
        if weight.get(key):
            raise NotImplementedError(f"init_inference: quant['weight'][{key!r}] (DeepSpeed's ZeRO-Inference "
                                      "group-wise quantization) is not implemented; use quant={'weight': "
                                      "'int8'|'int4', 'group_size': ...}")
    if weight.get("q_groups", 1) != 1:
        logger.info("init_inference: quant['weight']['q_groups']=%r: scales are per output channel here (finer "
                    "than DeepSpeed's groups of rows)", weight["q_groups"])
    return bool(weight.get("enabled", True)), _DS_BITS[bits]


def _check_quant(quant: dict) -> dict:
    if not isinstance(quant, dict):
        raise ValueError(f"init_inference: quant must be a dict like {{'weight': 'fp6'}} (got {type(quant).__name__})")
    quant = dict(quant)
    for key in ("activation", "qkv"):  # DeepSpeed's injected kernels' settings: no effect without them
        if key in quant:
            logger.info("init_inference: quant[%r] configures DeepSpeed's injected kernels; no effect here", key)
            quant.pop(key)
    for key in quant:
        if key not in _QUANT_KEYS:
            raise ValueError(f"init_inference: unknown quant key {key!r} (known: {', '.join(_QUANT_KEYS)}, and "
                             "DeepSpeed's activation, qkv)")
    q = {"enabled": True, "weight": "fp6", "group_size": None, "include": (), "exclude": (), **quant}
    if isinstance(q["weight"], dict):
        enabled, q["weight"] = _deepspeed_weight(q["weight"])
        q["enabled"] = bool(q["enabled"]) and enabled
    if q["weight"] not in FORMATS:
        raise ValueError(f"init_inference: quant['weight'] must be one of {FORMATS} or DeepSpeed's "
                         f"{{'num_bits': 8|4, ...}} (got {q['weight']!r})")
    if q["group_size"] is not None:
        check_quant_args(q["weight"], (1, 16 * q["group_size"]) if isinstance(q["group_size"], int) else (1, 16),
                         q["group_size"])  # the group size alone; each layer's K is checked at the swap
    for key in ("include", "exclude"):
        if isinstance(q[key], str):
            q[key] = (q[key],)
    return q


def _int8_quant(quant: dict | None) -> dict:
    """`quant` for dtype=int8: INT8 weights unless `quant` names another format (an error: two answers)."""
    q = _check_quant(quant if quant is not None else {"weight": "int8"})
    explicit = quant is not None and "weight" in quant
    if explicit and q["weight"] != "int8":
        raise ValueError(f"init_inference: dtype=int8 asks for INT8 weights, quant['weight'] for {q['weight']}; "
                         "pass one of them")
    if not q["enabled"]:
        raise ValueError("init_inference: dtype=int8 needs quantization, but quant says enabled=False")
    return {**q, "weight": "int8"}


def _tied_output_ids(model: nn.Module) -> set[int]:
    """ids of weights shared with an nn.Embedding (tied lm_head / output embeddings)."""
    return {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}


def _matches(name: str, patterns) -> bool:
    return any(name == p or fnmatch.fnmatchcase(name, p) for p in patterns)


def _moe_router_ids(model: nn.Module) -> set[int]:
    """ids of the linear layers that route a MoE block's tokens: those of a module with an `experts`
    submodule, outside the experts, with one output per expert (the router: Mixtral's and Qwen-MoE's
    `gate` in transformers 4, DBRX's and Granite-MoE's router `layer`) or a single one (Qwen-MoE's
    `shared_expert_gate`). A shared expert's own layers have other widths and are quantized. vLLM, llama.cpp
    and the AutoGPTQ / AWQ integrations keep routers in float: a small weight error picks other experts."""
    ids = set()
    for block in model.modules():
        experts = getattr(block, "experts", None)
        if not isinstance(experts, nn.Module):
            continue
        count = len(experts) if isinstance(experts, nn.ModuleList) else getattr(experts, "num_experts", None)
        for name, module in block.named_modules():
            if name.split(".")[0] == "experts" or not isinstance(module, nn.Linear):
                continue
            if module.out_features == 1 or module.out_features == count:
                ids.add(id(module))
    return ids


def select_linears(model: nn.Module, weight: str = "fp6", group_size: int | None = None, include=(),
                   exclude=()) -> list[tuple[str, nn.Module]]:
    """The nn.Linear / Conv1D submodules `quantize_linears` swaps, by name (see there; shapes only, so a
    model on the meta device works too)."""
    tied = _tied_output_ids(model)
    routers = _moe_router_ids(model)
    chosen = []
    for name, module in model.named_modules():
        if not (isinstance(module, nn.Linear) or is_conv1d(module)) or isinstance(module, QuantizedLinear):
            continue
        if _matches(name, exclude):
            continue
        forced = _matches(name, include)
        if not forced and (name.split(".")[-1] == "lm_head" or id(module.weight) in tied):
            logger.info("init_inference: keeping %s unquantized (output head / tied embedding)", name)
            continue
        if not forced and id(module) in routers:
            logger.info("init_inference: keeping %s unquantized (MoE router; `include` it to quantize)", name)
            continue
        in_features = module.weight.shape[0] if is_conv1d(module) else module.weight.shape[1]
        out_features = module.weight.shape[1] if is_conv1d(module) else module.weight.shape[0]
        try:
            check_quant_args(weight, (out_features, in_features), group_size)
        except ValueError as err:
            logger.warning("init_inference: keeping %s unquantized: %s", name, err)
            continue
        chosen.append((name, module))
    return chosen


def quantize_linears(model: nn.Module, weight: str = "fp6", group_size: int | None = None, include=(),
                     exclude=(), device=None, dtype: torch.dtype | None = None) -> list[str]:
    """Swap nn.Linear / Conv1D submodules of `model` for QuantizedLinear in place; returns the swapped
    names. Each layer's weight is moved to `device` and cast to `dtype` (None: as it is) one layer at a
    time, then quantized there. Skipped: lm_head, layers whose weight is tied to an embedding and MoE
    routers (`_moe_router_ids`) unless named in `include`, names matching `exclude` (fnmatch patterns),
    layers whose in_features cannot be packed (logged)."""
    swaps = select_linears(model, weight, group_size, include, exclude)
    for name, module in progress(swaps, desc=f"quantizing to {weight}", unit="layer"):
        layer = QuantizedLinear.from_linear(module, weight=weight, group_size=group_size, device=device, dtype=dtype)
        replace_submodule(model, name, layer)
    return [name for name, _ in swaps]


_DEFAULTS = {"dtype": torch.float16, "quant": None, "tensor_parallel": None, "mp_size": 1,
             "replace_with_kernel_inject": False, "device": None, "checkpoint": None, "base_dir": "",
             "save_mp_checkpoint_path": None, "checkpoint_config": None, "injection_policy": None,
             "enable_cuda_graph": False}
_CHECKPOINT_CONFIG_KEYS = {"checkpoint_dir": "checkpoint", "base_dir": "base_dir",
                           "save_mp_checkpoint_path": "save_mp_checkpoint_path"}


def _merge_checkpoint_config(kwargs: dict) -> None:
    """DeepSpeed's `checkpoint_config` / `ckpt_config` dict: checkpoint_dir, base_dir,
    save_mp_checkpoint_path; the top-level arguments win."""
    cfg = kwargs.pop("checkpoint_config")
    if not cfg:
        return
    if not isinstance(cfg, dict):
        raise ValueError(f"init_inference: checkpoint_config must be a dict (got {type(cfg).__name__})")
    for key, value in cfg.items():
        if key not in _CHECKPOINT_CONFIG_KEYS:
            raise ValueError(f"init_inference: unknown checkpoint_config key {key!r} "
                             f"(known: {', '.join(_CHECKPOINT_CONFIG_KEYS)})")
        target = _CHECKPOINT_CONFIG_KEYS[key]
        if value is not None and _is_default(kwargs[target], _DEFAULTS[target]):
            kwargs[target] = value


class _TensorParallel:
    """The tensor-parallel setup of one init_inference call (tensor_parallel.py's plan and group)."""

    def __init__(self, model: nn.Module, kwargs: dict):
        tp_size, group = tp_settings(kwargs["tensor_parallel"])
        mp = int(kwargs["mp_size"] or 1)
        if mp > 1 and tp_size > 1 and mp != tp_size:
            raise ValueError(f"init_inference: mp_size={mp} and tensor_parallel tp_size={tp_size} disagree")
        self.size = max(tp_size, mp)  # mp_size: DeepSpeed's older name of tp_size
        self.plan: dict[str, str] = {}
        self.rank, self.comm = 0, None
        if self.size == 1:
            if kwargs["injection_policy"]:
                logger.info("init_inference: injection_policy has no effect without tensor parallelism")
            return
        from lightspeed.comm.collectives import Communicator  # lazy: only tensor parallelism communicates

        self.comm = Communicator(group)
        if self.comm.world_size != self.size:
            raise ValueError(f"init_inference: tensor_parallel tp_size={self.size} needs torch.distributed with "
                             f"{self.size} ranks in the group (found {self.comm.world_size}); start the script with "
                             f"`lightspeed --num_gpus {self.size}` or torchrun")
        self.rank = self.comm.rank
        self.plan = build_plan(model, self.size, kwargs["injection_policy"])
        logger.info("init_inference: tensor parallelism over %d ranks: %d column- and %d row-parallel layers, "
                    "%d experts modules", self.size, sum(map(is_colwise, self.plan.values())),
                    sum(s in ROW_STYLES for s in self.plan.values()), sum(s == EXPERTS for s in self.plan.values()))

    def slices(self) -> dict[str, Slice]:
        return {name: Slice(style, self.rank, self.size) for name, style in self.plan.items()}

    def shard_in_place(self, model: nn.Module) -> None:
        for name, style in self.plan.items():
            if style == EXPERTS:
                shard_experts(model.get_submodule(name), self.rank, self.size)
            else:
                replace_submodule(model, name, shard_linear(model.get_submodule(name), style, self.rank, self.size))


def _split_quantizable(chosen, q: dict, tp: _TensorParallel) -> dict:
    """{name: (format, group_size)} of the chosen layers, less row-parallel ones whose K / tp the format
    cannot pack (logged, as the swap does for whole layers)."""
    out = {}
    for name, module in chosen:
        if tp.plan.get(name) in ROW_STYLES:
            n, k = linear_dims(module)
            try:
                check_quant_args(q["weight"], (n, k // tp.size), q["group_size"])
            except ValueError as err:
                logger.warning("init_inference: keeping %s unquantized: its slice of K: %s", name, err)
                continue
        out[name] = (q["weight"], q["group_size"])
    return out


def init_inference(model: nn.Module, config: dict | None = None, *, dtype=torch.float16, quant: dict | None = None,
                   tensor_parallel=None, mp_size: int = 1, replace_with_kernel_inject: bool = False,
                   device=None, checkpoint=None, base_dir: str = "", save_mp_checkpoint_path=None,
                   checkpoint_config: dict | None = None, injection_policy=None, enable_cuda_graph: bool = False,
                   **deepspeed_kwargs) -> nn.Module:
    """Prepare `model` for generation: cast it to `dtype`, move it to `device` (default: this rank's
    GPU, else CPU) and, with `quant={"weight": "fp6"|"int8"|"int4", "group_size": None|int,
    "include": [...], "exclude": [...]}`, swap its linear layers for QuantizedLinear. `config` may hold
    the same keys (DeepSpeed's dict form); keyword arguments win. The 3-D expert weights of transformers'
    MoE models are quantized too, per expert (experts.py). Returns the model itself, so its own
    `generate` works; `.module` (DeepSpeed's engine attribute) is the model too.

    `checkpoint` loads the weights from files, one tensor at a time, into a model built on the meta
    device (`with lightspeed.OnDevice(dtype, device="meta"): model = ...`) or a real one: a Hugging Face
    model directory (safetensors or .bin, sharded or not), DeepSpeed's checkpoint JSON (a dict or a path:
    `{"type": "ds_model", "checkpoints": [files], "version": 1.0}`, relative names under `base_dir`), one
    file or a list of files. Layers to quantize are quantized as they arrive, so neither the host nor
    the device holds the model in float. `save_mp_checkpoint_path` writes the prepared model (cast,
    quantized) as sharded safetensors that `checkpoint=` loads back without quantizing again.
    `checkpoint_config` / `ckpt_config` (checkpoint_dir, base_dir, save_mp_checkpoint_path) is
    DeepSpeed's grouped form of the same.

    DeepSpeed's forms work too: `dtype=torch.int8` is INT8 weights with fp16 activations (DeepSpeed's
    int8 inference), and `quant={"weight": {"num_bits": 8|4, "q_type": "symmetric", "q_groups": n},
    "activation": ..., "qkv": ...}` maps num_bits to INT8 / INT4 (per-channel scales, finer than
    q_groups; activation and qkv configure DeepSpeed's kernels and are logged). Unlike DeepSpeed, which
    quantizes only with dtype=int8 and kernel injection, `quant` is honoured with any dtype.

    `tensor_parallel={"tp_size": n}` (or `mp_size=n`; torch.distributed initialized with n ranks, or
    `tp_group`) splits the model's linear layers over the ranks, DeepSpeed's AutoTP without kernel
    injection: the plan is `injection_policy` ({block class: (names of its row-parallel linears)}) or
    the Hugging Face config's `base_model_tp_plan` (tensor_parallel.py). With it,
    `save_mp_checkpoint_path` saves each rank's slices, which load back at the same tp_size.

    `enable_cuda_graph=True` (CUDA only) replays the model's forward from CUDA graphs, one per input
    signature, captured at its second call; the model's own `generate` then replays its decode steps
    (a static KV cache is made its default). What a graph cannot replay runs eagerly with a warning
    (cuda_graph.py).

    `replace_with_kernel_inject=True` (`kernel_inject`) fuses the projections of a block that read the
    same input, an attention's q/k/v and a gated MLP's gate/up (also BERT's query/key/value), into one
    layer each (quantized or not; fusion.py), so a decode step runs one product per group. DeepSpeed
    replaces whole blocks with its own kernels; here the model's own attention, norms and generate run
    as they are, and outputs equal the unfused model's. Groups that cannot be joined stay (logged); the
    fusion comes after `save_mp_checkpoint_path`, so saved files keep the model's own names.

    The returned model also has DeepSpeed's engine methods `profile_model_time()` and `model_times()`
    (ms per forward call, the device synchronized around each).

    Other DeepSpeedInferenceConfig fields are taken by name: those that only configure DeepSpeed's
    injected kernels (max_out_tokens, triangular_masking, return_tuple, ...) are logged and have no
    effect; the unimplemented ones (injection_policy_tuple, zero, moe, ...) raise NotImplementedError
    naming the key unless they hold DeepSpeed's default.

    With `quant`, the linear layers are quantized on their way to `device`, one at a time, before the
    rest of the model moves: the device never holds the whole model in `dtype` (a 70B model's 138 GB
    of fp16 weights need not fit on the GPU that holds its 52 GB of FP6 ones)."""
    kwargs = {"dtype": dtype, "quant": quant, "tensor_parallel": tensor_parallel, "mp_size": mp_size,
              "replace_with_kernel_inject": replace_with_kernel_inject, "device": device,
              "checkpoint": checkpoint, "base_dir": base_dir, "save_mp_checkpoint_path": save_mp_checkpoint_path,
              "checkpoint_config": checkpoint_config, "injection_policy": injection_policy,
              "enable_cuda_graph": enable_cuda_graph}
    extra = {_ALIASES.get(key, key): value for key, value in deepspeed_kwargs.items()}
    for key in [k for k in extra if k in kwargs]:  # an alias (tp=, kernel_inject=) of a named argument
        kwargs[key] = extra.pop(key)
    if config is not None:
        if not isinstance(config, dict):
            raise ValueError(f"init_inference: config must be a dict (got {type(config).__name__})")
        for key, value in config.items():
            key = _ALIASES.get(key, key)
            if key not in kwargs:
                extra.setdefault(key, value)
            elif kwargs[key] is _DEFAULTS[key] or kwargs[key] == _DEFAULTS[key]:
                kwargs[key] = value
    _check_deepspeed_keys(extra)
    _merge_checkpoint_config(kwargs)
    if not isinstance(kwargs["replace_with_kernel_inject"], bool):
        raise ValueError(f"init_inference: replace_with_kernel_inject must be true or false "
                         f"(got {kwargs['replace_with_kernel_inject']!r})")
    target_dtype = _resolve_dtype(kwargs["dtype"])
    if _is_int8(kwargs["dtype"]):
        q = _int8_quant(kwargs["quant"])
        logger.info("init_inference: dtype=int8: INT8 weights (per-channel symmetric), fp16 activations")
    else:
        q = _check_quant(kwargs["quant"]) if kwargs["quant"] is not None else None
    target_device = torch.device(kwargs["device"]) if kwargs["device"] is not None else default_device()
    if not isinstance(kwargs["enable_cuda_graph"], bool):
        raise ValueError(f"init_inference: enable_cuda_graph must be true or false (got {kwargs['enable_cuda_graph']!r})")
    if kwargs["enable_cuda_graph"] and target_device.type != "cuda":
        raise ValueError(f"init_inference: enable_cuda_graph=True needs a CUDA device (this call: {target_device})")
    files = resolve_checkpoint_files(kwargs["checkpoint"], kwargs["base_dir"] or "") \
        if kwargs["checkpoint"] is not None else None
    if files is None:
        on_meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
        if on_meta:
            raise ValueError(f"init_inference: the model has {len(on_meta)} tensor(s) on the meta device (e.g. "
                             f"{on_meta[0]}): pass checkpoint= to load them")

    tp = _TensorParallel(model, kwargs)
    presplit = isinstance(files, SplitFiles)
    if presplit:  # saved under tensor parallelism: this rank's files hold its slices, layers packed as saved
        if len(files.ranks) != tp.size:
            raise ValueError(f"init_inference: the checkpoint was saved split over {len(files.ranks)} ranks; load it "
                             f"with tensor_parallel tp_size={len(files.ranks)} (this call: {tp.size})")
        files = files.ranks[tp.rank]
        tp.shard_in_place(model)  # the model's linear layers take the slices' shapes (on meta: no memory)

    quantizing = q is not None and q["enabled"]
    if quantizing:
        size = torch.empty((), dtype=target_dtype).element_size()
        before = sum(p.numel() * (size if p.is_floating_point() else p.element_size()) for p in model.parameters())
    names = _place_linears(model, files, q if quantizing else None, tp, presplit, target_device, target_dtype)
    model = model.to(device=target_device, dtype=target_dtype)
    if tp.comm is not None:
        attach_all_reduce(model, tp.plan, tp.comm)
        changed = per_rank_attributes(model, tp.plan, tp.size, tp.rank)
        if changed:
            logger.info("init_inference: per-rank head counts: %s (/%d)", ", ".join(changed), tp.size)
    if quantizing:
        after = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
        logger.info("init_inference: %d linear layers -> %s (group_size=%s); weights %.1f MiB -> %.1f MiB",
                    len(names), q["weight"], q["group_size"], before / 2**20, after / 2**20)
    model.eval()
    if not hasattr(model, "module"):
        # DeepSpeed returns an engine whose `.module` is the model, and scripts call `engine.module(...)` /
        # `engine.module.generate(...)`; here that is the model itself, kept in the instance dict so it is
        # not registered as its own submodule (no cycle in modules(), state_dict or .to())
        model.__dict__["module"] = model
    _ModelTimes.attach(model)
    if kwargs["save_mp_checkpoint_path"]:
        _save(model, kwargs["save_mp_checkpoint_path"], tp)
    if kwargs["replace_with_kernel_inject"]:  # after the save: the checkpoint keeps the model's own names
        _fuse(model)
    if kwargs["enable_cuda_graph"]:
        cuda_graph.install(model, target_device)
    return model


def _fuse(model: nn.Module) -> None:
    fused = fuse_projections(model)
    if fused:
        logger.info("init_inference: replace_with_kernel_inject: %d projection groups fused (e.g. %s)", len(fused),
                    fused[0])
    else:
        logger.warning("init_inference: replace_with_kernel_inject: %s has no projection group to fuse (%s); "
                       "it runs as without it", type(model).__name__,
                       ", ".join("/".join(names) for names, _ in GROUPS))


class _ModelTimes:
    """DeepSpeed's InferenceEngine.profile_model_time() / model_times() on the returned model (benchmark
    scripts call `pipe.model.profile_model_time()` then `pipe.model.model_times()`): after the first,
    every call of the model (generate's steps too) is timed, with the device synchronized before and
    after, in ms; the second returns the times since the last call and starts a new list."""

    def __init__(self, model: nn.Module):
        self.model, self.times, self.enabled, self.start = model, [], False, 0.0

    @classmethod
    def attach(cls, model: nn.Module) -> None:
        if not hasattr(model, "profile_model_time") and not hasattr(model, "model_times"):
            timer = cls(model)
            model.__dict__["profile_model_time"] = timer.profile_model_time
            model.__dict__["model_times"] = timer.model_times

    def profile_model_time(self, use_cuda_events: bool = True) -> None:
        """Start timing each forward (`use_cuda_events` is DeepSpeed's timer choice; both time the same
        synchronized interval here)."""
        if not self.enabled:
            self.model.register_forward_pre_hook(self._pre)
            self.model.register_forward_hook(self._post)
            self.enabled = True

    def model_times(self) -> list[float]:
        if not self.enabled:
            raise RuntimeError("model_times: model profiling is not enabled; call profile_model_time() first")
        times, self.times = self.times, []
        return times

    def _sync(self) -> None:
        tensor = next(self.model.parameters(), None)
        if tensor is not None and tensor.is_cuda:
            torch.cuda.synchronize(tensor.device)

    def _pre(self, module, args) -> None:
        self._sync()
        self.start = time.perf_counter()

    def _post(self, module, args, output) -> None:
        self._sync()
        self.times.append((time.perf_counter() - self.start) * 1e3)


def _place_linears(model: nn.Module, files: list[str] | None, q: dict | None, tp: _TensorParallel, presplit: bool,
                   device: torch.device, dtype: torch.dtype) -> list[str]:
    """Split (tensor parallelism), load (`files`) and quantize (`q`) the linear layers, one at a time on
    their way to `device`; returns the names of the quantized ones."""
    if files is None:
        tp.shard_in_place(model)
        if q is None:
            return []
        names = quantize_linears(model, q["weight"], q["group_size"], q["include"], q["exclude"], device=device,
                                 dtype=dtype)
    else:
        chosen = select_linears(model, q["weight"], q["group_size"], q["include"], q["exclude"]) if q else []
        if presplit:  # the model's layers have the slices' shapes already
            wanted = {name: (q["weight"], q["group_size"]) for name, _ in chosen}
        else:
            wanted = _split_quantizable(chosen, q, tp) if q else {}
        names = load_checkpoint(model, files, quantize=wanted, device=device, dtype=dtype,
                                shards=None if presplit else tp.slices(),
                                quantize_experts=(q["weight"], q["group_size"]) if q else None,
                                experts_chosen=lambda name: bool(q) and not _matches(name, q["exclude"]))
        logger.info("init_inference: loaded %d file(s); %d quantized layers", len(files), len(names))
        if q is None:
            return names
    # MoE experts (3-D weights, not nn.Linear): each expert's matrices quantized on their way to the device
    experts = quantize_experts(model, q["weight"], q["group_size"], lambda name: not _matches(name, q["exclude"]),
                               device=device, dtype=dtype)
    if experts:
        logger.info("init_inference: %d MoE experts modules -> %s (e.g. %s)", len(experts), q["weight"], experts[0])
    return names + experts


def _save(model: nn.Module, path, tp: _TensorParallel) -> None:
    """`save_mp_checkpoint_path`: the prepared model; under tensor parallelism each rank's slices in
    `tp_<rank>/`, then rank 0 writes the JSON naming every rank's files (after all are in place)."""
    if tp.comm is None:
        if current_rank() == 0:
            save_inference_checkpoint(model, path)
        return
    names = save_inference_checkpoint(model, os.path.join(os.fspath(path), rank_dir(tp.rank)))
    every = tp.comm.all_gather_object(names)
    if tp.rank == 0:
        write_split_config(path, every, model)
    tp.comm.barrier()
