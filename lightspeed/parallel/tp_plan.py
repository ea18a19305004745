"""The tensor-parallel plan, shared by training (parallel/tensor_parallel.py) and `init_inference`
(inference/tensor_parallel.py), as DeepSpeed's AutoTP: which linear layers of a model are split across
the ranks of the tensor-parallel group, how (column- or row-parallel, fused layers cut part by part), the
slice of one weight a rank keeps, and the per-rank head counts of attention modules that keep them as
attributes.

Owns: the plan and the slicing arithmetic. Must not: build layers, issue collectives, or know about
quantized layers (inference checks those through `build_plan`'s `check`).

Note: [the plan] "colwise" layers keep rows r*N/tp .. (r+1)*N/tp of the weight [N, K] (and of the bias):
their output is this rank's slice of the features (its attention heads, its MLP columns). "rowwise"
layers keep columns r*K/tp .. of the weight, read that slice of their input (which the colwise layers
before them produced), and their outputs are summed over the group; for inference (`Slice.bias`) the bias
is kept on rank 0 only (zeros elsewhere), so the sum adds it once (training keeps it whole on every rank and
adds it after the sum: parallel/tensor_parallel.py). The plan comes from `injection_policy` (DeepSpeed's form:
{block class or its name: (names of the row-parallel linears in the block)}, every other nn.Linear in
the block column-parallel), else from the Hugging Face config's `base_model_tp_plan` ({"layers.*.
self_attn.q_proj": "colwise", ...}: "colwise" / "rowwise" entries; others raise). Attention modules
need no change when they infer their head count from the tensors (transformers' Llama-family models
reshape with -1 heads); the head counts in the config must divide by tp (checked), so no head is split.
Quantization happens after slicing: a row-parallel slice gets its own per-channel scales (over K/tp).
transformers' Conv1D layers (GPT-2, weight [in, out]) are planned like nn.Linear and become nn.Linear
slices. A fused [q | k | v] layer of known layout ("colwise_qkv": GPT-2's c_attn) keeps this rank's rows
of each third, so the rank holds whole heads of q, k and v; a fused layer of other part sizes
(`colwise_parts`: Phi-3's qkv_proj with grouped-query parts, its gate_up_proj) likewise keeps its rows of
each part, and a module that cuts such an output by the config's head counts (Phi-3's attention) gets a
view of the config with this rank's (`_RankConfig`). Models whose config has no base_model_tp_plan, or
one that gathers outputs (Phi-3), use `BUILTIN_PLANS` (GPT-2, GPT-Neo, OPT, Phi-3, BLOOM, Falcon,
GPT-BigCode) or `injection_policy` (whose column-parallel layers take the built-in plan's style where it
has one: a fused layer's layout is the model's). A multi-query attention's fused [q heads | k | v] layer
(Falcon-7B, StarCoder) keeps its q rows and the one k/v head whole on every rank (`colwise_parts(...,
whole=...)`), its k/v head count staying 1. ALiBi biases built by the model for all heads (BLOOM, Falcon-RW) are cut to this rank's
heads (`_RankAlibi`). An attention module that keeps its head counts as attributes (GPT-2's split_size, GPT-J's
num_attention_heads, older transformers' num_heads / hidden_size) has them divided by tp after the split
(`per_rank_attributes`), as DeepSpeed's AutoTP does: the module then reshapes its slice of the heads.

Note: [MoE experts] A transformers MoE block's experts module (3-D gate_up_proj [E, 2I, H] and down_proj
[E, H, I]; its plan style "moe_tp_experts") is split like an MLP inside every expert: each rank keeps
its I/tp rows of the gate half and of the up half, and the same columns of down (`expert_indices`), so
its experts' output is a partial sum, summed over the group by a hook on the experts module (the
router and any shared expert stay whole on every rank). Quantization happens after the cut; a checkpoint
with one matrix per expert is read in those slices.

Note: [the output head] An untied output head (`lm_head`, as `get_output_embeddings()` names it) is
split by columns too, as DeepSpeed's AutoTP does (LmHeadLinearAllreduce): its input, the final norm's
output, is whole on every rank, so a pre-hook takes this rank's slice of it and the logits are summed
over the group. Each GPU then holds and reads 1/tp of the head (32000 x 8192 fp16 is 0.5 GB a token
for Llama-2-70B). A head tied to the input embedding stays whole (splitting it would untie it).
"""

from __future__ import annotations

import fnmatch
import inspect
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from lightspeed.parallel.module_kinds import experts_layout, is_linear, linear_dims

COLWISE, ROWWISE = "colwise", "rowwise"
COLWISE_QKV = "colwise_qkv"  # a fused [q | k | v] layer: colwise within each third (see the Note)
_PARTS = "colwise_parts:"  # + the row counts of a fused layer's parts (`colwise_parts`), each split colwise
HEAD = "rowwise_head"  # the output head: rowwise on a full input, which it slices itself (see the Note)
EXPERTS = "experts"  # a MoE block's experts module: each expert's intermediate features split (see the Note)
_EXPERTS_STYLES = ("moe_tp_experts",)  # the base_model_tp_plan styles of a whole experts module
_EP_EXPERTS_STYLES = ("ep_dispatch_experts",)  # the base_model_ep_plan style of one (transformers 5.2x)
ROW_STYLES = (ROWWISE, HEAD)
# plan styles that keep a module whole: norms, and embeddings (a whole embedding gives what a vocab-split
# one all-reduced would; DeepSpeed's AutoTP keeps them whole too)
_WHOLE_STYLES = ("replicate", "replicated_with_grad_allreduce", "embedding_rowwise", "embedding_colwise")
_HEAD_KEYS = ("num_attention_heads", "num_key_value_heads", "num_kv_heads")
_KV_HEADS = ("num_key_value_heads", "num_kv_heads")


def colwise_parts(*rows: int, whole: tuple[int, ...] = ()) -> str:
    """The style of a fused layer whose output rows are parts of these sizes (Phi-3's qkv_proj: q, k, v rows;
    its gate_up_proj: two halves), each split colwise, so a rank keeps its rows of every part; the parts
    whose indices are in `whole` are kept whole on every rank (a multi-query attention's one k and one v
    head, which all of a rank's query heads read)."""
    return _PARTS + ",".join(f"{int(r)}{'r' if i in whole else ''}" for i, r in enumerate(rows))


def is_colwise(style: str) -> bool:
    return style in (COLWISE, COLWISE_QKV) or style.startswith(_PARTS)


def part_rows(style: str, n: int) -> list[int]:
    """The row counts of a column-parallel layer's parts (one part unless fused), for n output rows."""
    if style == COLWISE_QKV:
        return [n // 3] * 3
    if style.startswith(_PARTS):
        rows = [int(r.rstrip("r")) for r in style[len(_PARTS):].split(",")]
        if sum(rows) != n:
            raise ValueError(f"tensor parallelism: a fused layer planned as parts {rows} has {n} output rows")
        return rows
    return [n]


def whole_parts(style: str) -> list[bool]:
    """Which parts of a column-parallel layer every rank keeps whole (`colwise_parts(..., whole=...)`)."""
    if style.startswith(_PARTS):
        return [r.endswith("r") for r in style[len(_PARTS):].split(",")]
    return [False] * (3 if style == COLWISE_QKV else 1)


def _phi3_plan(config) -> dict[str, str]:
    """Phi-3 (and Phi-3.5 / Phi-4-mini): fused qkv_proj [q | k | v] (grouped-query sizes) and gate_up_proj
    [gate | up], split within each part as DeepSpeed's AutoTP does; not the config's plan, whose layers
    gather their outputs on every rank."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    return {"layers.*.self_attn.qkv_proj": colwise_parts(q, kv, kv), "layers.*.self_attn.o_proj": ROWWISE,
            "layers.*.mlp.gate_up_proj": colwise_parts(config.intermediate_size, config.intermediate_size),
            "layers.*.mlp.down_proj": ROWWISE}


def _multi_query_qkv(config) -> str:
    """The style of a multi-query [q heads | one k | one v] layer: q split, the k and v head kept whole."""
    head_dim = config.hidden_size // config.num_attention_heads
    return colwise_parts(config.hidden_size, head_dim, head_dim, whole=(1, 2))


def _falcon_plan(config) -> dict[str, str]:
    """Falcon: query_key_value's rows are whole k/v groups ([group, (q heads, k, v), head_dim], Falcon-40B /
    180B's new_decoder_architecture) or whole heads ([head, (q, k, v), head_dim], multi_query=False), so a
    block of rows is whole heads; the multi-query layout ([q heads | one k | one v], Falcon-7B) keeps its q
    heads' rows and the k and v head whole on every rank."""
    qkv = _multi_query_qkv(config) if config.multi_query and not config.new_decoder_architecture else COLWISE
    return {"h.*.self_attention.query_key_value": qkv, "h.*.self_attention.dense": ROWWISE,
            "h.*.mlp.dense_h_to_4h": COLWISE, "h.*.mlp.dense_4h_to_h": ROWWISE}


def _bigcode_plan(config) -> dict[str, str]:
    """GPT-BigCode (SantaCoder, StarCoder): c_attn is [head, (q, k, v), head_dim] (a block of rows is whole
    heads), or with multi_query [q heads | one k | one v]: each rank keeps its q heads and the k and v head
    whole, which all its q heads read (`_bigcode_attributes`)."""
    attn = _multi_query_qkv(config) if config.multi_query else COLWISE
    return {"h.*.attn.c_attn": attn, "h.*.attn.c_proj": ROWWISE, "h.*.mlp.c_fc": COLWISE, "h.*.mlp.c_proj": ROWWISE}


# plans for transformers models whose config has no base_model_tp_plan, or one that gathers outputs (names
# under the base model; a callable takes the config)
BUILTIN_PLANS = {"gpt2": {"h.*.attn.c_attn": COLWISE_QKV, "h.*.attn.c_proj": ROWWISE, "h.*.mlp.c_fc": COLWISE,
                          "h.*.mlp.c_proj": ROWWISE},
                 "gpt_neo": {"h.*.attn.attention.q_proj": COLWISE, "h.*.attn.attention.k_proj": COLWISE,
                             "h.*.attn.attention.v_proj": COLWISE, "h.*.attn.attention.out_proj": ROWWISE,
                             "h.*.mlp.c_fc": COLWISE, "h.*.mlp.c_proj": ROWWISE},
                 "opt": {"decoder.layers.*.self_attn.q_proj": COLWISE, "decoder.layers.*.self_attn.k_proj": COLWISE,
                         "decoder.layers.*.self_attn.v_proj": COLWISE, "decoder.layers.*.self_attn.out_proj": ROWWISE,
                         "decoder.layers.*.fc1": COLWISE, "decoder.layers.*.fc2": ROWWISE},
                 "phi3": _phi3_plan,
                 # query_key_value is [head, (q, k, v), head_dim]: a block of rows is whole heads
                 "bloom": {"h.*.self_attention.query_key_value": COLWISE, "h.*.self_attention.dense": ROWWISE,
                           "h.*.mlp.dense_h_to_4h": COLWISE, "h.*.mlp.dense_4h_to_h": ROWWISE},
                 "falcon": _falcon_plan, "gpt_bigcode": _bigcode_plan}
_FUSED_QKV = frozenset({"c_attn"})  # names of fused q|k|v layers of three equal thirds (GPT-2), `colwise_qkv`
# per-rank attribute of an attention module whose column-parallel layers are split (see the Note)
_ATTENTION_ATTRS = ("split_size", "num_heads", "num_attention_heads", "num_key_value_heads", "num_kv_heads",
                    "n_heads", "all_head_size", "embed_dim", "hidden_size")
_HEAD_COUNTS = ("split_size", "num_heads", "num_attention_heads", "num_key_value_heads", "num_kv_heads", "n_heads")


def _policy_plan(model: nn.Module, policy: Mapping) -> dict[str, str]:
    plan = {}
    for block_type, rowwise in policy.items():
        if isinstance(rowwise, str):
            rowwise = (rowwise,)
        matched = False
        for name, module in model.named_modules():
            if not (module.__class__ is block_type or type(module).__name__ == block_type):
                continue
            matched = True
            for child_name, child in module.named_modules():
                if is_linear(child) and child_name:
                    full = f"{name}.{child_name}" if name else child_name
                    plan[full] = ROWWISE if child_name in rowwise else _column_style(full)
            children = dict(module.named_modules())
            for row in rowwise:
                if not is_linear(children.get(row)):
                    raise ValueError(f"tensor parallelism: injection_policy names {row!r}, which is no linear layer in "
                                     f"{type(module).__name__} {name!r}")
        if not matched:
            raise ValueError(f"tensor parallelism: injection_policy's {getattr(block_type, '__name__', block_type)!r} "
                             "is not in the model")
    return plan


def _column_style(name: str) -> str:
    return COLWISE_QKV if name.rpartition(".")[2] in _FUSED_QKV else COLWISE


def _builtin_patterns(model: nn.Module) -> dict[str, str] | None:
    config = getattr(model, "config", None)
    patterns = BUILTIN_PLANS.get(getattr(config, "model_type", None))
    return patterns(config) if callable(patterns) else patterns


def _config_plan(model: nn.Module, check=None) -> dict[str, str]:
    config = getattr(model, "config", None)
    patterns = _builtin_patterns(model) or getattr(config, "base_model_tp_plan", None)
    if not patterns:
        raise NotImplementedError(f"tensor parallelism: tensor parallelism for {type(model).__name__} needs a plan: its "
                                  "config has no base_model_tp_plan; pass injection_policy={BlockClass: "
                                  "('row_parallel_linear', ...)}")
    patterns = dict(patterns)
    # newer transformers name a whole experts module in base_model_ep_plan instead of the tp plan
    for pattern, style in (getattr(config, "base_model_ep_plan", None) or {}).items():
        if style in _EP_EXPERTS_STYLES:
            patterns.setdefault(pattern, _EXPERTS_STYLES[0])
    return _match(model, patterns, check)


def _match(model: nn.Module, patterns: Mapping[str, str], check=None) -> dict[str, str]:
    """{linear layer name: style} of `patterns` ({name pattern under the base model or whole: style})."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    plan = {}
    for name, module in model.named_modules():
        local = name[len(prefix) + 1:] if prefix and name.startswith(prefix + ".") else name
        style = next((st for pattern, st in patterns.items()
                      if fnmatch.fnmatchcase(local, pattern) or fnmatch.fnmatchcase(name, pattern)), None)
        if style is None or style in _WHOLE_STYLES:
            continue
        if style in _EXPERTS_STYLES:
            layout = experts_layout(module)
            if isinstance(layout, str):
                raise NotImplementedError(f"tensor parallelism: the experts {name}: {layout}")
            if check is not None:
                check(name, module, style)
            if layout is not None:
                plan[name] = EXPERTS
            continue
        if not (is_colwise(style) or style == ROWWISE):  # fused experts, gathered outputs, ...
            raise NotImplementedError(f"tensor parallelism: tensor parallelism style {style!r} (the model's "
                                      f"base_model_tp_plan, for {name}) is not implemented")
        if is_linear(module):
            plan[name] = style
    return plan


def match_patterns(model: nn.Module, patterns: Mapping[str, str]) -> dict[str, str]:
    """{linear layer name: style} of `patterns` ({fnmatch pattern of a module name, under the base model
    or whole: style})."""
    return _match(model, patterns)


def build_plan(model: nn.Module, tp_size: int, injection_policy=None, *, check=None,
               split_head: bool = True) -> dict[str, str]:
    """{linear layer name: "colwise" | "rowwise" | ...} (see the Note), checked for tp_size. `check(name,
    module, style)` is called on each planned layer and matched experts module and may raise (inference
    refuses packed layers); `split_head` adds an untied output head (`HEAD`)."""
    plan = _policy_plan(model, injection_policy) if injection_policy else _config_plan(model, check)
    builtin = _builtin_patterns(model) if injection_policy else None
    if builtin:
        # a fused layer's row layout is the model's (GPT-BigCode's c_attn is not GPT-2's thirds): a policy's
        # column-parallel layer takes the built-in plan's column style
        known = _match(model, builtin)
        plan.update({name: known[name] for name, style in plan.items() if is_colwise(style)
                     and is_colwise(known.get(name, ""))})
    if not plan:
        raise ValueError("tensor parallelism: the tensor-parallel plan matches no nn.Linear of the model")
    if check is not None:
        for name, style in plan.items():
            check(name, model.get_submodule(name), style)
    head = _output_head(model) if split_head else None
    if head is not None and head not in plan and model.get_submodule(head).weight.shape[1] % tp_size == 0:
        plan[head] = HEAD
    config = getattr(model, "config", None)
    kept_whole = any(any(whole_parts(style)) for style in plan.values() if is_colwise(style))
    for key in _HEAD_KEYS:
        heads = getattr(config, key, None)
        if isinstance(heads, int) and heads % tp_size and not (heads == 1 and kept_whole):  # multi-query: k/v whole
            raise ValueError(f"tensor parallelism: config.{key}={heads} does not divide by tp_size={tp_size}")
    for name, style in plan.items():
        if style == EXPERTS:
            inter = experts_layout(model.get_submodule(name))[2]
            if inter % tp_size:
                raise ValueError(f"tensor parallelism: the experts {name} have {inter} intermediate features, which do "
                                 f"not divide by tp_size={tp_size}")
            continue
        n, k = linear_dims(model.get_submodule(name))
        sizes = part_rows(style, n) if is_colwise(style) else [k]
        split = [size for size, whole in zip(sizes, whole_parts(style) if is_colwise(style) else [False])
                 if not whole]
        if any(size % tp_size for size in split) or (style == COLWISE_QKV and n % 3):
            what = f"parts of {sizes} rows" if len(sizes) > 1 else \
                f"{sizes[0]} {'output' if is_colwise(style) else 'input'} features"
            raise ValueError(f"tensor parallelism: {name} ({style}) has {what}, which do not divide by tp_size={tp_size}")
        if style == COLWISE_QKV and hasattr(model.get_submodule(name.rpartition(".")[0]), "q_attn"):
            raise NotImplementedError(f"tensor parallelism: tensor parallelism of the cross-attention {name} (q_attn "
                                      "beside a fused k|v layer) is not implemented")
    return plan


def _output_head(model: nn.Module) -> str | None:
    """The name of the model's untied nn.Linear output head, if it has one."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else getattr(model, "lm_head", None)
    if not isinstance(head, nn.Linear):
        return None
    if any(isinstance(m, nn.Embedding) and m.weight is head.weight for m in model.modules()):
        return None
    return next((name for name, m in model.named_modules() if m is head), None)


@dataclass(frozen=True)
class Slice:
    """This rank's part of one linear layer (see the Note): `indices` into its weight [N, K] (one per
    third of a fused q|k|v layer), `weight`, `bias`."""

    style: str
    rank: int
    size: int

    def indices(self, shape) -> list[tuple[slice, slice]]:
        if is_colwise(self.style):
            out, start = [], 0
            for rows, whole in zip(part_rows(self.style, shape[0]), whole_parts(self.style)):
                n = rows // self.size
                out.append((slice(start, start + rows) if whole else
                            slice(start + self.rank * n, start + (self.rank + 1) * n), slice(None)))
                start += rows
            return out
        k = shape[1] // self.size
        return [(slice(None), slice(self.rank * k, (self.rank + 1) * k))]

    def weight(self, weight: torch.Tensor) -> torch.Tensor:
        pieces = [weight[index] for index in self.indices(weight.shape)]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def bias(self, bias: torch.Tensor | None) -> torch.Tensor | None:
        if bias is None:
            return None
        if is_colwise(self.style):
            pieces = [bias[rows] for rows, _ in self.indices((bias.shape[0], 1))]
            return pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        return bias if self.rank == 0 else torch.zeros_like(bias)


def expert_indices(kind: str, rows: int, cols: int, rank: int, size: int) -> list[tuple[slice, slice]]:
    """This rank's part of one expert's matrix (see the Note): "gate_up" [2I, H] keeps its rows of the gate
    half and of the up half, "down" [H, I] its columns."""
    if kind == "down":
        k = cols // size
        return [(slice(0, rows), slice(rank * k, (rank + 1) * k))]
    half = rows // 2
    n = half // size
    return [(slice(start + rank * n, start + (rank + 1) * n), slice(None)) for start in (0, half)]


def per_rank_attributes(model: nn.Module, plan: Mapping[str, str], tp_size: int, rank: int = 0) -> list[str]:
    """Divide by tp_size the head-count attributes (`_ATTENTION_ATTRS`) of each module whose column-parallel
    layers were split and which keeps a head count (an attention module); returns "module.attribute" of
    each one changed. Raises when one does not divide. Such a module whose forward takes ALiBi biases for
    all heads (BLOOM's attention) gets this rank's heads' (`_RankAlibi`)."""
    changed = []
    parents = {name.rpartition(".")[0] for name, style in plan.items() if is_colwise(style)}
    fused = {name.rpartition(".")[0] for name, style in plan.items() if style.startswith(_PARTS)}
    # multi-query attentions: their one k/v head is kept whole on every rank, so its count stays 1
    shared_kv = {name.rpartition(".")[0] for name, style in plan.items() if is_colwise(style) and any(whole_parts(style))}
    config = getattr(model, "config", None)
    for parent in sorted(parents):
        module = model.get_submodule(parent)
        if parent in fused and config is not None and getattr(module, "config", None) is config:
            # the module cuts its fused output by the config's head counts (Phi-3's attention): its view of
            # the config gets this rank's
            counts = {key: getattr(config, key) for key in _HEAD_KEYS if isinstance(getattr(config, key, None), int)
                      and getattr(config, key) % tp_size == 0}  # (a multi-query model's one k/v head stays one)
            module.config = _RankConfig(config, {key: value // tp_size for key, value in counts.items()})
            changed.extend(f"{parent}.config.{key}" for key in counts)
        if not any(isinstance(getattr(module, a, None), int) for a in _HEAD_COUNTS):
            continue
        for attr in _ATTENTION_ATTRS:
            value = getattr(module, attr, None)
            if not isinstance(value, int) or isinstance(value, bool) or (parent in shared_kv and value == 1
                                                                         and attr in _KV_HEADS):
                continue
            if value % tp_size:
                raise ValueError(f"tensor parallelism: {parent}.{attr}={value} does not divide by tp_size={tp_size}")
            setattr(module, attr, value // tp_size)
            changed.append(f"{parent}.{attr}")
        if type(module).__name__ == "GPTBigCodeAttention":
            changed.extend(f"{parent}.{attr}" for attr in _bigcode_attributes(module, tp_size))
        heads, groups = getattr(module, "num_heads", None), getattr(module, "num_key_value_groups", None)
        kv = next((getattr(module, a) for a in _KV_HEADS if isinstance(getattr(module, a, None), int)), None)
        if isinstance(heads, int) and isinstance(groups, int) and kv and groups != heads // kv:
            # q heads per k/v head: changed where the k/v heads stay whole (multi-query)
            module.num_key_value_groups = heads // kv
            changed.append(f"{parent}.num_key_value_groups")
        params = list(inspect.signature(module.forward).parameters)
        # ALiBi biases for all heads: as an argument (BLOOM), or folded into a per-head attention mask
        # (Falcon-RW with transformers 5.2x)
        alibi = "alibi" in params or ("attention_mask" in params and
                                      getattr(getattr(module, "config", None), "alibi", False) is True)
        if tp_size > 1 and alibi and isinstance(getattr(module, "num_heads", None), int):
            module.register_forward_pre_hook(_RankAlibi(rank, tp_size, params), with_kwargs=True)
            changed.append(f"{parent}.alibi")
    return changed


def _bigcode_attributes(module: nn.Module, tp_size: int) -> list[str]:
    """GPT-BigCode's attention after the generic division (num_heads, embed_dim, split_size): with multi_query
    its one k/v head stays, so each rank's num_heads q heads share it (num_key_value_groups); else its k/v
    heads are its q heads."""
    changed = []
    if not module.multi_query:
        module.kv_heads //= tp_size
        module.kv_dim = module.kv_heads * module.head_dim
        changed = ["kv_heads", "kv_dim"]
    module.num_key_value_groups = module.num_heads // module.kv_heads
    return changed + ["num_key_value_groups"]


class _RankAlibi:
    """Forward pre-hook of an attention module that takes ALiBi biases for all heads (BLOOM's model builds
    them as [batch x heads, 1, length], Falcon's as [batch, heads, 1, length]; a head's slope depends on its
    index): this rank's heads' rows, heads rank*h .. (rank+1)*h - 1 of each batch row (h: the module's
    per-rank num_heads). An attention mask with a row per head (Falcon folds the biases into it) is cut
    the same way."""

    def __init__(self, rank: int, size: int, params: list[str]):
        self.rank, self.size, self.params = rank, size, params

    def __call__(self, module, args, kwargs):
        h = module.num_heads
        full, rows = h * self.size, slice(self.rank * h, (self.rank + 1) * h)
        args = list(args)
        for name in ("alibi", "attention_mask"):
            i = self.params.index(name) if name in self.params else len(args)
            value = args[i] if i < len(args) else kwargs.get(name)
            if not isinstance(value, torch.Tensor):  # none (Falcon-40B: rotary embeddings instead)
                continue
            if value.dim() == 4 and value.shape[1] == full:  # [batch, heads, q or 1, length]
                value = value[:, rows]
            elif name == "alibi":  # [batch x heads, 1, length] (BLOOM)
                value = value.view(-1, full, *value.shape[1:])[:, rows].reshape(-1, *value.shape[1:])
            else:
                continue
            if i < len(args):
                args[i] = value
            else:
                kwargs = {**kwargs, name: value}
        return tuple(args), kwargs


class _RankConfig:
    """A module's view of the model's config with this rank's head counts; every other attribute is the
    config's own (read and written through), so later changes to the config still reach the module."""

    def __init__(self, config, counts: dict):
        self.__dict__.update(_config=config, _counts=counts)

    def __getattr__(self, name):
        counts, config = self.__dict__.get("_counts"), self.__dict__.get("_config")
        if counts is None or config is None:  # copy / unpickle: not set up yet
            raise AttributeError(name)
        return counts[name] if name in counts else getattr(config, name)

    def __setattr__(self, name, value):
        setattr(self._config, name, value)


