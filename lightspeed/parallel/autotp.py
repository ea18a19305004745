"""AutoTP for training: the plan a `tensor_parallel` config section asks for (`preset_model`,
`partition_config`, else the model's own), the `initialize()` transform that applies it, and DeepSpeed's
`tp_model_init(model, tp_size, dtype)`.

Owns: turning DeepSpeed's layer specs (regular expressions over parameter names, "column" / "row" /
"skip", an optional fused `shape`) into the shared plan's styles. Must not: split layers itself
(tensor_parallel.py does) or build groups other than through comm/'s `Topology`.

Note: [DeepSpeed's specs] A spec matches a layer when one of its patterns re.match-es the layer's weight
name ("model.layers.0.self_attn.o_proj.weight"); the first matching spec wins. `shape` describes a fused
column-parallel weight: [k, -1] is k equal parts, [[a, b, c], -1] parts of those row counts, each split
on its own (the plan's `colwise_parts`); other shapes, a `partition_dim` other than the type's default,
and `gather_output` are refused, naming the key. With `use_default_specs` (DeepSpeed's default) the
layers no spec matches keep the preset's or the model's plan; `strict_mode` refuses a linear layer
that no spec matches. Embeddings and the output head stay whole (see tensor_parallel.py's Note), so
`embedding_partition_dim` and `lm_head_patterns` change nothing.

Note: [mixture-of-experts layers] The experts and gates stay whole, as DeepSpeed's default
`enable_expert_tensor_parallelism=False` keeps them: every linear layer inside a DeepSpeed-style
MOELayer, and, with `expert_parallel.enabled` (AutoEP), inside each detected block's experts and
router, is left out of the plan even when a spec or the model's plan names it (logged);
parallel/experts/ runs them beside the split dense layers, and slices the experts over tp itself
when asked (`MoE(enable_expert_tensor_parallelism=True)`, `expert_parallel.expert_tensor_parallel_size`).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
from torch import nn

from lightspeed._utils.logging import get_logger
from lightspeed.comm.collectives import Communicator
from lightspeed.comm.topology import Topology
from lightspeed.config.errors import ConfigError
from lightspeed.config.tensor_parallel import PartitionConfig, TensorParallelConfig, TPLayerSpecConfig
from lightspeed.parallel.module_kinds import is_conv1d, is_linear, linear_dims
from lightspeed.parallel.tensor_parallel import PartitionedLayer, apply_tensor_parallel, split_tp_size
from lightspeed.parallel.tp_plan import BUILTIN_PLANS, COLWISE, ROWWISE, build_plan, colwise_parts, is_colwise, \
    match_patterns, part_rows

logger = get_logger(__name__)

_LLAMA = {"*.self_attn.q_proj": COLWISE, "*.self_attn.k_proj": COLWISE, "*.self_attn.v_proj": COLWISE,
          "*.self_attn.o_proj": ROWWISE, "*.mlp.gate_proj": COLWISE, "*.mlp.up_proj": COLWISE,
          "*.mlp.down_proj": ROWWISE}
PRESETS = {"llama": lambda config: _LLAMA, "qwen2": lambda config: _LLAMA,
           "bloom": lambda config: BUILTIN_PLANS["bloom"], "phi3": BUILTIN_PLANS["phi3"]}


def _preset_plan(model: nn.Module, preset: str) -> dict[str, str]:
    key = preset.lower()
    if key not in PRESETS:
        raise NotImplementedError(f"tensor_parallel.preset_model={preset!r} is not implemented (built: "
                                  f"{', '.join(sorted(PRESETS))})")
    plan = match_patterns(model, PRESETS[key](getattr(model, "config", None)))
    if not plan:
        raise ConfigError(f"tensor_parallel.preset_model={preset!r} matches no linear layer of {type(model).__name__}")
    return plan


def _spec_style(spec: TPLayerSpecConfig, name: str, rows: int) -> str | None:
    if spec.partition_type == "skip":
        return None
    if spec.gather_output:
        raise NotImplementedError("tensor_parallel.partition_config.layer_specs[].gather_output is not implemented")
    column = spec.partition_type == "column"
    if spec.partition_dim is not None and spec.partition_dim != (0 if column else 1):
        raise NotImplementedError(f"tensor_parallel.partition_config.layer_specs[].partition_dim={spec.partition_dim} "
                                  f"for a {spec.partition_type} layer is not implemented")
    if spec.shape is None:
        return COLWISE if column else ROWWISE
    shape = spec.shape
    if not column or len(shape) != 2 or shape[1] != -1:
        raise NotImplementedError(f"tensor_parallel.partition_config.layer_specs[].shape={shape} is not implemented "
                                  "(built: [k, -1] or [[a, b, ...], -1] on a column layer)")
    parts = shape[0]
    if isinstance(parts, int) and not isinstance(parts, bool) and parts > 0:
        if rows % parts:
            raise ConfigError(f"tensor_parallel.partition_config: {name} has {rows} rows, not {parts} equal parts")
        return colwise_parts(*([rows // parts] * parts))
    if isinstance(parts, list) and parts and all(isinstance(p, int) and p > 0 for p in parts):
        if sum(parts) != rows:
            raise ConfigError(f"tensor_parallel.partition_config: {name} has {rows} rows, not parts {parts}")
        return colwise_parts(*parts)
    raise ConfigError(f"tensor_parallel.partition_config.layer_specs[].shape={shape}: the first entry must be a "
                      "positive part count or a list of positive row counts")


def _spec_plan(model: nn.Module, partition: PartitionConfig, default: dict[str, str] | None) -> dict[str, str]:
    model_type = str(getattr(getattr(model, "config", None), "model_type", "") or "").lower()
    plan: dict[str, str] = {}
    for name, module in model.named_modules():
        if not (isinstance(module, nn.Linear) or is_conv1d(module)):
            continue
        weight = f"{name}.weight"
        spec = next((s for s in partition.layer_specs
                     if (not s.model_types or model_type in [t.lower() for t in s.model_types])
                     and any(re.match(pattern, weight) for pattern in s.patterns)), None)
        if spec is None:
            if default is not None and name in default:
                plan[name] = default[name]
            elif partition.strict_mode and not _is_output_head(model, module):
                raise ConfigError(f"tensor_parallel.partition_config.strict_mode: no layer spec matches {weight}")
            continue
        style = _spec_style(spec, name, linear_dims(module)[0])
        if style is not None:
            plan[name] = style
    if not plan:
        raise ConfigError("tensor_parallel.partition_config matches no linear layer of the model")
    return plan


def _is_output_head(model: nn.Module, module: nn.Module) -> bool:
    get = getattr(model, "get_output_embeddings", None)
    return callable(get) and get() is module


def kept_whole(model: nn.Module, expert_parallel=None) -> list[str]:
    """The modules whose layers AutoTP leaves whole (the Note on mixture-of-experts layers): every
    MOELayer, and with `expert_parallel.enabled` each AutoEP block's experts and router."""
    from lightspeed.parallel.experts.autoep import detect_moe_blocks
    from lightspeed.parallel.experts.transform import kept_whole_under_tp

    names = kept_whole_under_tp(model)
    if expert_parallel is not None and expert_parallel.enabled:
        for block in detect_moe_blocks(model, expert_parallel):
            names += [f"{block.name}.{block.preset.experts}", f"{block.name}.{block.preset.router}"]
    return names


def _without(plan: dict[str, str], whole: list[str]) -> dict[str, str]:
    inside = [name for name in plan if any(name == w or name.startswith(w + ".") or not w for w in whole)]
    if inside:
        logger.info("tensor parallel: %d layers of mixture-of-experts layers kept whole (%s)", len(inside),
                    ", ".join(inside[:4]) + (", ..." if len(inside) > 4 else ""))
    return {name: style for name, style in plan.items() if name not in inside}


def config_plan(model: nn.Module, section: TensorParallelConfig | None, whole: list[str] | None = None
                ) -> dict[str, str]:
    """{module name: style} for `section` (see the Note), checked for its tp size; the layers inside the
    modules `whole` names (default: `kept_whole(model)`) are left out."""
    whole = kept_whole(model) if whole is None else whole
    tp_size = section.tp_size if section is not None else 1
    default = None
    if section is not None and section.preset_model:
        default = _preset_plan(model, section.preset_model)
    partition = section.partition_config if section is not None else None
    if partition is None:
        plan = default if default is not None else build_plan(model, tp_size, split_head=False)
    else:
        if default is None and partition.use_default_specs:
            try:
                default = build_plan(model, tp_size, split_head=False)
            except NotImplementedError:  # the model has no plan of its own: the specs alone
                default = None
        plan = _spec_plan(model, partition, default if partition.use_default_specs else None)
    plan = _without(plan, whole)
    if not plan:
        raise ConfigError("tensor_parallel: the plan matches no linear layer outside the mixture-of-experts layers, "
                          "which stay whole")
    return _checked(model, plan, tp_size)


def _checked(model: nn.Module, plan: dict[str, str], tp_size: int) -> dict[str, str]:
    for name, style in plan.items():
        module = model.get_submodule(name)
        if not is_linear(module):
            raise ConfigError(f"tensor_parallel: {name} is not a linear layer")
        n, k = linear_dims(module)
        sizes = part_rows(style, n) if is_colwise(style) else [k]
        if any(size % tp_size for size in sizes):
            raise ConfigError(f"tensor_parallel: {name} ({style}) has {sizes} "
                              f"{'output rows' if is_colwise(style) else 'input features'}, which do not divide by "
                              f"autotp_size={tp_size}")
    return plan


def tensor_parallel_transform(model: nn.Module, cfg, topology: Topology, *,
                              partitioned: PartitionedLayer | None = None) -> nn.Module:
    """`initialize()`'s tensor-parallel step: split `model` over the topology's tp group as the config's
    `tensor_parallel` section says; a model `tp_model_init` split already is checked and kept.
    `partitioned` reads the slices of layers partitioned by zero.Init (tensor_parallel.py's Note on
    layers built under zero.Init)."""
    tp_size, want, done = topology.size("tp"), cfg.tensor_parallel.tp_size, split_tp_size(model)
    if want > 1 and done == 1 and any(p.is_meta for p in model.parameters()):
        raise NotImplementedError("tensor_parallel.autotp_size with a model on the meta device is not implemented: "
                                  "build the model whole, or split it first with tp_model_init()")
    if done > 1:
        if done != tp_size:
            raise ConfigError(f"tensor_parallel.autotp_size: the model is split for tp size {done}, the run's "
                              f"tensor-parallel size is {tp_size}")
        return model
    if want == 1:  # tp from an mpu: the model's own (Megatron) layers are split already
        return model
    if want != tp_size:
        raise ConfigError(f"tensor_parallel.autotp_size={want}, but the tensor-parallel group has {tp_size} ranks")
    plan = config_plan(model, cfg.tensor_parallel, kept_whole(model, cfg.expert_parallel))
    return apply_tensor_parallel(model, Communicator(topology.group("tp"), tp_size), plan, partitioned)


def tp_model_init(model: nn.Module, tp_size: int, dtype: torch.dtype | None = None, config=None, *,
                  splitter: Callable[[Topology], PartitionedLayer] | None = None, **kwargs) -> nn.Module:
    """DeepSpeed's `deepspeed.tp_model_init`: split `model` for tensor parallelism over `tp_size` ranks
    (contiguous ranks form a tp group; torch.distributed must be initialized), cast it to `dtype`, and
    return it. `config` is the ds_config (a dict, as transformers passes it, or a loaded config) whose
    `tensor_parallel` section may name a `preset_model` or a `partition_config`; `initialize()` later
    finds the model split and keeps it. `splitter(topology)` gives the reader of layers partitioned by
    zero.Init (runtime/model_transforms.py's `zero_init_splitter`, which `lightspeed.tp_model_init`
    passes: transformers' Trainer calls it on a model built under zero.Init)."""
    if kwargs:
        raise TypeError(f"tp_model_init() got unexpected keyword arguments {sorted(kwargs)}")
    section = getattr(config, "tensor_parallel", None) if config is not None and not isinstance(config, dict) \
        else (config or {}).get("tensor_parallel")
    if isinstance(section, TensorParallelConfig):
        section = section.model_dump()
    section = dict(section or {})
    if section.get("autotp_size") not in (None, 0, 1, tp_size):
        raise ConfigError(f"tensor_parallel.autotp_size={section['autotp_size']} disagrees with tp_model_init's "
                          f"tp_size={tp_size}")
    section["autotp_size"] = tp_size
    try:
        tp_config = TensorParallelConfig.model_validate(section)
    except ValueError as error:
        raise ConfigError(f"tensor_parallel: {error}") from None
    topology = Topology.build(tp=tp_size)
    if split_tp_size(model) > 1:
        raise ValueError("tp_model_init: the model is split for tensor parallelism already")
    plan = config_plan(model, tp_config)
    apply_tensor_parallel(model, Communicator(topology.group("tp"), tp_size), plan,
                          splitter(topology) if splitter is not None else None)
    if dtype is not None:
        model.to(dtype=dtype)
    return model
