"""AutoEP, as DeepSpeed 0.19's ``expert_parallel`` section: find the mixture-of-experts blocks of a
Hugging Face transformers 5 model and split their experts over the run's "ep" group.

Owns: the presets (DeepSpeed's names: mixtral, qwen3_moe (also Qwen2-MoE), qwen3_5_moe, deepseek_v2,
deepseek_v3; and gpt_oss, which DeepSpeed 0.19 lacks, named by its Hugging Face model_type), the
experts' gated activations a preset can name (`EXPERT_ACTIVATIONS`), the detection
(`detect_moe_blocks`), the ep size the section asks for (`autoep_mesh_size`, read before the topology
exists), the refusal of the section's keys that are not built (`check_autoep_config`), and the model
transform (`autoep_transform`: swap each block's fused experts module for an `EPExperts`, place its
weights and biases). Must not: route tokens (the model's router runs unchanged), build groups, or touch
ZeRO.

Note: [detection] A preset names the block (a regular expression matched against the whole module
name: DeepSpeed's `model\\.layers\\.\\d+\\.mlp`, relaxed here to any prefix so a bare base model
matches too), its router child, its experts child and the experts' fused weights (`gate_up_proj`
[E, 2I, H], `down_proj` [E, H, I], or `transposed` [E, H, 2I] / [E, I, H]) with their biases when the
model has them ([E, 2I], [E, H]), the experts' gated activation (`activation`, a key of
`EXPERT_ACTIVATIONS`), the model config's expert-count attribute, and, for models with one, the shared
expert's children. The preset is `preset_model` when given, else the one whose
Hugging Face `model_type`s include the model's, else every preset is tried (the first that finds
blocks wins). The section's pattern and name keys override the preset's. A block is a module matching
the pattern whose experts child holds the two weights as 3-D parameters, and whose router child has
an [E, H] `weight`; experts holding parameters the preset does not name (a bias of a preset without
biases) are refused, naming them. Enabled AutoEP that finds no block is an error naming
`expert_parallel.enabled`.

Note: [what is swapped] Only the experts child: the block's own forward still runs the router (with
its dtype, softmax or sigmoid, top-k, group limit, normalisation and scaling), the shared expert and
its gate, so the routes and everything but the experts' arithmetic are the model's own code. The
experts child becomes an `EPExperts` (autoep_layer.py) holding global experts [r x E/ep, (r+1) x E/ep)
of ep rank r, under the same parameter names; the placements give each weight (and bias) its global
[E, ...] shape, this rank's rows along dim 0, `sharded_over=("ep",)` and `reduced_over` the expert-data-parallel
dims, and tp when the dense layers are tensor-parallel (transform.py's `expert_reduced_over`). A Hugging Face
checkpoint loads either whole (from_pretrained, then `initialize()` slices it) or under ZeRO-3 (the Note
on zero.Init).

Note: [beside tensor parallelism] With `tensor_parallel.autotp_size` > 1, AutoTP splits the dense layers
(attention, a shared expert) and leaves each block's experts and router whole (autotp.py's Note on
mixture-of-experts layers); the experts' tp ranks each compute 1/tp of the tokens (autoep_layer.py's
Note on tensor parallelism). DeepSpeed 0.19.8 builds this too ("AutoEP + AutoTP folding"), with the
same outcome per token but another layout: its ep groups are consecutive ranks across the tp lanes
(so ep may reach tp x dp, and each expert lives once per expert-data-parallel group), its tp peers
split the routed assignments rather than the tokens, and it refuses ep = 1, Ulysses sp and offload
there. Here ep is carved from data parallelism (comm/topology.py), so it must divide dp, the tp peers
hold the same experts (reduced over tp), and ep = 1, sp and offload are not refused.
`expert_parallel.expert_tensor_parallel_size` equal to `autotp_size` (> 1) slices every expert's
intermediate units over tp instead (autoep_layer.py's Note on experts sliced over tp): the slices are
sharded over ("ep", "tp") and reduced over the expert-data-parallel dims only, for a model built whole
or under zero.Init alike; any other value > 1 is refused naming the key. This goes beyond DeepSpeed
0.19.8, whose AutoEP reserves the key for expert-internal tensor parallelism and refuses any value but 1.

Note: [zero.Init] A model built under zero.Init (from_pretrained at ZeRO-3) holds empty placeholders
whose logical shapes are DeepSpeed's `ds_shape` (detection reads those) and whose values are spread
over Init's ranks. Each block's experts then become their `EPExperts` through `partitioned_experts`
(zero/stage3/init_rows.py's `replace_init_module`, given by `initialize()`): one all-to-all per block
hands every rank exactly its ep rank's rows from the ranks holding them (no rank gathers a block's
whole experts; at autoep_size 1 a rank's rows are all of them) and, with the experts sliced over tp,
only its tp rank's units of those rows (`_wanted`: the boxes `tp_unit_ranges` names, so a tp rank
never holds its rows' other units either); the experts' Init storage is freed, and the `EPExperts`'
parameters are partitioned by zero.Init again over the ranks holding the same slices (the
expert-data-parallel ranks; with tp too when the experts are whole over it), so only one block's
slices are whole on a rank at a time; ZeRO-3 takes them over as every Init group, into the same groups
and placements as for a model built whole. Meta experts with no values anywhere (`OnDevice("meta")`)
are refused.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from lightspeed._utils.logging import get_logger
from lightspeed.comm.collectives import Communicator
from lightspeed.comm.sequence_groups import as_group
from lightspeed.comm.topology import Topology
from lightspeed.config.errors import ConfigError
from lightspeed.config.expert_parallel import ExpertParallelConfig
from lightspeed.parallel.experts.autoep_layer import EPExperts, tp_unit_dim, tp_unit_ranges
from lightspeed.parallel.experts.grouped_mlp import ClampedSwiGLU, GatedActivation, HalvesGLU
from lightspeed.parallel.experts.transform import expert_reduced_over, moe_layers
from lightspeed.parallel.placement import Placement, PlacementTable

logger = get_logger(__name__)

_LAYERS = r"(.*\.)?layers\.\d+\.mlp"


@dataclass(frozen=True)
class Preset:
    """How one model family's MoE blocks look (the Note on detection)."""

    moe_layer_pattern: str
    router: str
    experts: str
    w1: str
    w2: str
    num_experts_attr: str
    model_types: tuple[str, ...]
    shared_experts: str = ""
    shared_experts_gate: str = ""
    b1: str = ""  # the gate|up bias [E, 2I] ("": none)
    b2: str = ""  # the down bias [E, H]
    transposed: bool = False  # weights stored [E, H, 2I] / [E, I, H] (x @ W)
    activation: str = "act_fn"  # a key of EXPERT_ACTIVATIONS


def _act_fn(name: str, experts: nn.Module) -> GatedActivation:
    act = getattr(experts, "act_fn", None)
    if not callable(act):
        raise NotImplementedError(f"AutoEP: the experts module of {name} has no `act_fn`; the preset's "
                                  "activation 'act_fn' needs transformers' fused gated experts (gate_up_proj / "
                                  "down_proj / act_fn)")
    return HalvesGLU(act)


def _gpt_oss_swiglu(name: str, experts: nn.Module) -> GatedActivation:
    alpha, limit = getattr(experts, "alpha", None), getattr(experts, "limit", None)
    if not isinstance(alpha, (int, float)) or not isinstance(limit, (int, float)):
        raise NotImplementedError(f"AutoEP: the experts module of {name} has no numeric `alpha` and `limit`; the "
                                  "preset's activation 'gpt_oss_swiglu' reads them (GptOssExperts)")
    return ClampedSwiGLU(float(alpha), float(limit))


# a preset's `activation` -> the experts' gated activation, built from the model's experts module (its
# block's name for errors): the model's own function, reproduced exactly (grouped_mlp.py's Note)
EXPERT_ACTIVATIONS: dict[str, Callable[[str, nn.Module], GatedActivation]] = {
    "act_fn": _act_fn,  # act_fn(gate half) * up half: Mixtral, Qwen, DeepSeek
    "gpt_oss_swiglu": _gpt_oss_swiglu,  # interleaved gate/up, clamped, (up + 1) * gate * sigmoid(alpha gate)
}


PRESETS = {
    "mixtral": Preset(_LAYERS, "gate", "experts", "gate_up_proj", "down_proj", "num_local_experts", ("mixtral",)),
    "qwen3_moe": Preset(_LAYERS, "gate", "experts", "gate_up_proj", "down_proj", "num_experts",
                        ("qwen3_moe", "qwen2_moe"), "shared_expert", "shared_expert_gate"),
    "qwen3_5_moe": Preset(_LAYERS, "gate", "experts", "gate_up_proj", "down_proj", "num_experts",
                          ("qwen3_5_moe_text",), "shared_expert", "shared_expert_gate"),
    "deepseek_v2": Preset(_LAYERS, "gate", "experts", "gate_up_proj", "down_proj", "n_routed_experts",
                          ("deepseek_v2",), "shared_experts"),
    "deepseek_v3": Preset(_LAYERS, "gate", "experts", "gate_up_proj", "down_proj", "n_routed_experts",
                          ("deepseek_v3",), "shared_experts"),
    "gpt_oss": Preset(_LAYERS, "router", "experts", "gate_up_proj", "down_proj", "num_local_experts", ("gpt_oss",),
                      b1="gate_up_proj_bias", b2="down_proj_bias", transposed=True, activation="gpt_oss_swiglu"),
}

# keys whose non-default value would change the routing: the model's own router decides it here
_ROUTING_KEYS = {"route_norm": None, "route_scale": 1.0, "score_apply": "auto", "score_func": "auto",
                 "top_k": "auto", "routed_scaling_factor": "auto", "num_expert_groups": None,
                 "num_limited_groups": None, "top_k_attr": None}


# (experts module, {parameter name: this rank's boxes, each a [start, stop) per dim, joined along the dim
# where they differ}, build, keep) -> build(this rank's boxes of each), its parameters partitioned by
# zero.Init again over `keep`: experts partitioned by zero.Init
# (lightspeed.zero.stage3.init_rows.replace_init_module, given by initialize()); collective
Box = tuple[tuple[int, int], ...]
PartitionedExperts = Callable[[nn.Module, dict[str, tuple[Box, ...]], Callable[[dict[str, torch.Tensor]], nn.Module],
                               Communicator], nn.Module]


@dataclass(frozen=True)
class MoEBlock:
    """One detected block: its module name, module, preset name, expert count and the preset used."""

    name: str
    module: nn.Module
    preset_name: str
    num_experts: int
    preset: Preset


def check_autoep_config(section: ExpertParallelConfig, tp_size: int = 1) -> None:
    """Refuse the section's settings that are not built, each by its key (`tp_size`: the run's
    tensor-parallel size, the one `expert_tensor_parallel_size` > 1 may take)."""
    if not section.enabled:
        return
    prefix = "expert_parallel."
    for key, default in _ROUTING_KEYS.items():
        value = getattr(section, key)
        if value != default:
            raise NotImplementedError(f"{prefix}{key}={value!r}: AutoEP in lightspeed keeps the model's own router "
                                      "(its score function, top-k, groups, normalisation and scaling come from the "
                                      f"model's config); remove the key or leave it at {default!r}")
    refused = {"validate_folding_routing": section.validate_folding_routing,
               "load_balance_coeff": section.load_balance_coeff is not None,
               "combine_impl": section.combine_impl in ("legacy_bmm", "fused_weighted_sum"),
               "async_split_plan": section.async_split_plan,
               "row_weighting_impl": section.row_weighting_impl != "auto",
               "gate_up_impl": section.gate_up_impl != "separate",
               "comm_backend": section.comm_backend != "comm",
               "expert_activation": section.expert_activation is not None,
               "expert_w3": section.expert_w3_given and section.expert_w3 is not None}
    if section.expert_tensor_parallel_size not in (1, tp_size):
        raise NotImplementedError(f"{prefix}expert_tensor_parallel_size={section.expert_tensor_parallel_size}: "
                                  "lightspeed's AutoEP slices the experts over the dense layers' whole tensor-parallel "
                                  f"group or not at all: set it to 1 or to tensor_parallel.autotp_size ({tp_size})")
    for key, active in refused.items():
        if active:
            raise NotImplementedError(f"{prefix}{key}={getattr(section, key)!r} is not implemented in lightspeed's "
                                      "AutoEP (it runs the preset's experts and activation, exchanges tokens with "
                                      "torch.distributed, combines by a weighted sum and adds no load-balancing "
                                      "router bias); remove the key")
    if section.preset_model is not None and section.preset_model not in PRESETS:
        raise ConfigError(f"expert_parallel.preset_model={section.preset_model!r}: unknown preset (available: "
                          f"{', '.join(PRESETS)})")


def autoep_mesh_size(raw: dict) -> int | None:
    """The ep size the raw config's `expert_parallel` section asks for (None while AutoEP is off)."""
    section = raw.get("expert_parallel") or {}
    if not isinstance(section, dict) or section.get("enabled") is not True:
        return None
    size = section.get("autoep_size", 1)
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ConfigError(f"expert_parallel.autoep_size must be a positive integer (got {size!r})")
    return size


def _candidates(section: ExpertParallelConfig, model: nn.Module) -> list[tuple[str, Preset]]:
    if section.preset_model is not None:
        return [(section.preset_model, PRESETS[section.preset_model])]
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    named = [(name, p) for name, p in PRESETS.items() if model_type in p.model_types]
    return named or list(PRESETS.items())


def _override(preset: Preset, section: ExpertParallelConfig) -> Preset:
    fields = {"moe_layer_pattern": section.moe_layer_pattern, "router": section.router_pattern,
              "experts": section.expert_pattern, "w1": section.expert_w1, "w2": section.expert_w2,
              "num_experts_attr": section.num_experts_attr, "shared_experts": section.shared_experts_pattern,
              "shared_experts_gate": section.shared_experts_gate_pattern}
    values = {k: v for k, v in fields.items() if v is not None}
    return Preset(**{**preset.__dict__, **values}) if values else preset


def _shape(p: torch.Tensor) -> torch.Size:
    """A parameter's logical shape: DeepSpeed's `ds_shape` for one partitioned by ZeRO-3 (its tensor is
    an empty placeholder), else its own."""
    shape = getattr(p, "ds_shape", None)
    return torch.Size(shape) if shape is not None else p.shape


def _block(name: str, module: nn.Module, preset: Preset) -> int | None:
    """The block's expert count when `module` is a block of `preset` (the Note on detection), else None."""
    experts, router = getattr(module, preset.experts, None), getattr(module, preset.router, None)
    if not isinstance(experts, nn.Module) or not isinstance(router, nn.Module):
        return None
    params = dict(experts.named_parameters())
    w1, w2 = params.get(preset.w1), params.get(preset.w2)
    if w1 is None or w2 is None or len(_shape(w1)) != 3 or len(_shape(w2)) != 3:
        return None
    weight = getattr(router, "weight", None)
    if weight is None or len(_shape(weight)) != 2 or _shape(weight)[0] != _shape(w1)[0]:
        return None
    named = {preset.w1, preset.w2} | {b for b in (preset.b1, preset.b2) if b}
    if set(params) - named:
        raise NotImplementedError(f"AutoEP: the experts of {name} hold parameters the preset does not name "
                                  f"({', '.join(sorted(set(params) - named))}; it names {', '.join(sorted(named))}): "
                                  "set expert_parallel.preset_model to the model's preset; other experts' "
                                  "parameters are not supported")
    missing = named - set(params)
    if missing:
        raise NotImplementedError(f"AutoEP: the experts of {name} lack the preset's {', '.join(sorted(missing))}")
    EXPERT_ACTIVATIONS[preset.activation](name, experts)  # refuses experts without the activation's attributes
    return int(_shape(w1)[0])


def detect_moe_blocks(model: nn.Module, section: ExpertParallelConfig) -> list[MoEBlock]:
    """Every MoE block of `model` (the Note on detection); raises when there is none."""
    config = getattr(model, "config", None)
    for preset_name, preset in _candidates(section, model):
        preset = _override(preset, section)
        pattern = re.compile(preset.moe_layer_pattern)
        blocks = []
        for name, module in model.named_modules():
            if not pattern.fullmatch(name):
                continue
            count = _block(name, module, preset)
            if count is None:
                continue
            declared = getattr(config, preset.num_experts_attr, None) if config is not None else None
            if declared is not None and declared != count:
                raise ConfigError(f"expert_parallel: the model config's {preset.num_experts_attr}={declared} "
                                  f"but {name}.{preset.experts}.{preset.w1} holds {count} experts")
            if section.has_shared_experts:
                for child in (preset.shared_experts, preset.shared_experts_gate):
                    if child and getattr(module, child, None) is None:
                        raise ConfigError(f"expert_parallel.has_shared_experts: {name} has no child {child!r}")
            blocks.append(MoEBlock(name, module, preset_name, count, preset))
        if blocks:
            return blocks
    model_type = getattr(config, "model_type", None)
    raise ConfigError(f"expert_parallel.enabled: no MoE block found in {type(model).__name__} "
                      f"(model_type={model_type!r}, presets tried: "
                      f"{', '.join(n for n, _ in _candidates(section, model))}); AutoEP supports transformers 5 "
                      "models with fused experts (gate_up_proj / down_proj) beside a router (`gate`; gpt_oss: "
                      "`router`): set "
                      "expert_parallel.preset_model or the pattern keys (moe_layer_pattern, router_pattern, "
                      "expert_pattern, expert_w1, expert_w2), or turn AutoEP off")


def _partitioned(block: MoEBlock, source: nn.Module, partitioned_experts: PartitionedExperts | None) -> bool:
    """Whether the block's experts are partitioned by zero.Init (else whole: EPExperts slices them)."""
    params = [getattr(source, n) for n in _param_names(block.preset)]
    if any(getattr(p, "ds_shape", None) is not None for p in params):
        if partitioned_experts is None:
            raise NotImplementedError(f"expert_parallel.enabled: the experts of {block.name} are partitioned by "
                                      "zero.Init and no reader of their rows was given; go through initialize()")
        return True
    if any(p.is_meta for p in params):
        raise NotImplementedError(f"expert_parallel.enabled: the experts of {block.name} are on the meta device "
                                  "with no values (built outside zero.Init, e.g. OnDevice('meta')); build the model "
                                  "under zero.Init (or from_pretrained at ZeRO-3) or whole")
    return False


def _param_names(preset: Preset) -> tuple[str, ...]:
    return tuple(n for n in (preset.w1, preset.w2, preset.b1, preset.b2) if n)


def _wanted(block: MoEBlock, source: nn.Module, ep_rank: int, ep: int, tp: tuple[int, int] | None,
            activation: GatedActivation) -> dict[str, tuple[Box, ...]]:
    """This rank's boxes of each experts parameter partitioned by zero.Init: its ep rank's rows, and,
    sliced over tp (`tp` = (tp rank, tp size)), only its tp rank's units of them (the Note on zero.Init)."""
    preset, local = block.preset, block.num_experts // ep
    rows = (ep_rank * local, (ep_rank + 1) * local)
    units = _shape(getattr(source, preset.w2))[1 if preset.transposed else 2]
    if tp is not None and units % tp[1]:
        raise ValueError(f"AutoEP: expert_parallel.expert_tensor_parallel_size={tp[1]} does not divide the "
                         f"{units} intermediate units of the experts of {block.name}")
    out = {}
    for name in _param_names(preset):
        shape = _shape(getattr(source, name))
        where = tp_unit_dim(name, (preset.w1, preset.w2), (preset.b1, preset.b2), preset.transposed)
        if tp is None or where is None:
            out[name] = ((rows,) + tuple((0, n) for n in shape[1:]),)
            continue
        dim, fused = where
        out[name] = tuple(tuple(rows if d == 0 else cut if d == dim else (0, n) for d, n in enumerate(shape))
                          for cut in tp_unit_ranges(fused, activation.interleaved, tp[1], tp[0], units))
    return out


def _expert_data_parallel(topology: Topology, sliced: bool) -> Communicator:
    """The ranks holding the same experts (as the strategy's reduce group of the experts)."""
    dims = tuple(d for d in expert_reduced_over(topology, sliced) if topology.size_over((d,)) > 1)
    return Communicator(topology.group_over(dims), topology.size_over(dims)) if dims else Communicator(None, 1)


def autoep_transform(model: nn.Module, placements: PlacementTable, cfg, topology: Topology, *,
                     partitioned_experts: PartitionedExperts | None = None) -> tuple[nn.Module, PlacementTable]:
    """With `expert_parallel.enabled`: swap each MoE block's experts for this ep rank's `EPExperts` and
    place them (the Note on what is swapped); otherwise the model passes unchanged.
    `partitioned_experts` builds them from experts partitioned by zero.Init (the Note on zero.Init)."""
    section: ExpertParallelConfig = cfg.expert_parallel
    if not section.enabled:
        return model, placements
    tp = topology.size("tp")
    check_autoep_config(section, tp)
    sliced = tp > 1 and section.expert_tensor_parallel_size == tp  # autoep_layer.py's Note on experts sliced
    if moe_layers(model):
        raise ConfigError("expert_parallel.enabled: the model already holds DeepSpeed MoE layers "
                          "(lightspeed.parallel.experts.MoE); AutoEP is for Hugging Face MoE models, turn one off")
    if topology.size("pp") > 1:
        raise NotImplementedError("expert_parallel.enabled in a pipeline-parallel model is not implemented")
    ep, ep_rank = topology.size("ep"), topology.rank("ep")
    if ep != section.autoep_size:
        raise ConfigError(f"expert_parallel.autoep_size={section.autoep_size} but the run's expert-parallel size is "
                          f"{ep}")
    blocks = detect_moe_blocks(model, section)
    group = as_group(topology.group("ep")) if ep > 1 else None
    tp_group = as_group(topology.group("tp")) if tp > 1 else None
    tp_comm = Communicator(topology.group("tp"), tp) if sliced else None
    reduced_over = expert_reduced_over(topology, sliced)
    placed, keep = [], None
    for block in blocks:
        if block.num_experts % ep:
            raise ConfigError(f"expert_parallel.autoep_size={ep} does not divide the {block.num_experts} experts of "
                              f"{block.name}")
        preset = block.preset
        source = getattr(block.module, preset.experts)
        activation = EXPERT_ACTIVATIONS[preset.activation](block.name, source)
        build = functools.partial(EPExperts, source, (preset.w1, preset.w2), block.num_experts, ep_rank, ep,
                                  activation, use_grouped_mm=section.use_grouped_mm,
                                  bias_names=(preset.b1, preset.b2), transposed=preset.transposed, tp_comm=tp_comm)
        if _partitioned(block, source, partitioned_experts):
            keep = keep or _expert_data_parallel(topology, sliced)
            wanted = _wanted(block, source, ep_rank, ep, (topology.rank("tp"), tp) if sliced else None, activation)
            experts = partitioned_experts(source, wanted, lambda rows: build(local=rows), keep)
        else:
            experts = build()
        if ep > 1:
            experts.bind(group)
        if tp > 1 and not sliced:
            experts.bind_tp(tp_group, tp)
        setattr(block.module, preset.experts, experts)
        # the block's other children, by name (DeepSpeed's AutoEP checkpoint layout renames them)
        experts.block_children = (block.preset_name, preset.router, preset.shared_experts, preset.shared_experts_gate)
        local = block.num_experts // ep
        for w in experts.param_names:
            name, first = f"{block.name}.{preset.experts}.{w}", ep_rank * local
            within = experts.tp_placement(w, topology.rank("tp")) if sliced else None
            if within is not None:  # its boxes in this ep rank's experts whole over tp, shifted to its rows
                shape = (block.num_experts,) + within.global_shape[1:]
                boxes = tuple(((first, first + local),) + box[1:] for box in within.boxes)
                placed.append(Placement(name, shape, boxes, ("ep", "tp"), reduced_over, cat_dim=within.cat_dim))
                continue
            rest = tuple(_shape(getattr(experts, w))[1:])  # partitioned by zero.Init: ds_shape
            shape = (block.num_experts,) + rest
            box = ((first, first + local),) + tuple((0, n) for n in rest)
            placed.append(Placement(name, shape, (box,), ("ep",), reduced_over))
    logger.info("AutoEP: %d MoE blocks (preset %s), %d experts each, %d per rank over ep %d", len(blocks),
                blocks[0].preset_name, blocks[0].num_experts, blocks[0].num_experts // ep, ep)
    return model, placements.placed(placed)


__all__ = ["EXPERT_ACTIVATIONS", "MoEBlock", "PRESETS", "Preset", "autoep_mesh_size", "autoep_transform",
           "check_autoep_config", "detect_moe_blocks"]
