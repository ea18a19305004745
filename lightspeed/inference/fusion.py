"""Projection fusion, what `init_inference(replace_with_kernel_inject=True)` does here: the sibling
linear layers of a block that read the same input (an attention's q/k/v projections, a gated MLP's
gate/up projections) become one layer whose output rows are theirs stacked, so a decode step runs one
product per group instead of two or three. Each product of a decode step reads its whole weight and
pays a fixed cost per call (launch, pipeline ramp, split-K fixup;
docs/benchmark-notes/quantized-gemm-fixed-cost.md, 2026-11-30), which a 4096-wide layer's few megabytes
do not amortize.

Owns the group table, the fused module (`FusedLinear`) and its per-projection stand-ins (`FusedPart`),
which keep the original names and call signature, so the model's own forward is unchanged. Quantized
groups are joined bit for bit (`concat_quantized`: the same codes and scales, so the fused layer
computes each projection's exact product); dense ones by stacking their weights.

Note: how one product serves three calls. The model calls q_proj(x), k_proj(x), v_proj(x) in turn.
The first part computes the fused product and keeps it with x; a later part called with the same
tensor object, unchanged since (its version counter), takes its slice of the kept output (a view: no
copy), and the kept tensors are dropped once every part has taken its slice. A part called with
another input computes the fused product again and takes its slice: still exact, only slower; the
group logs a warning once. dynamo traces the same logic (it cannot read version counters, so there the
input is matched by identity alone, as for inference-mode tensors), so a compiled block holds one
operator per group, and the kept state is back to empty when the traced forward ends.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from lightspeed._utils.logging import get_logger
from lightspeed.inference.quantized_linear import QuantizedLinear, linear_from_float
from lightspeed.ops.wquant.reference import row_planes, tile_major

logger = get_logger(__name__)

# (member names, fused name): the projections of one block that read the same input
GROUPS = ((("q_proj", "k_proj", "v_proj"), "qkv_proj"),  # Llama, Mistral, Qwen2, Gemma, OPT, GPT-J, GPT-Neo
          (("gate_proj", "up_proj"), "gate_up_proj"),  # gated MLPs (Llama, Mistral, Qwen2, Gemma)
          (("query", "key", "value"), "query_key_value"))  # BERT-style self-attention
# a block whose forward takes one of these can be a cross-attention: its k/v read other states than q
_CROSS_ARGS = ("key_value_states", "encoder_hidden_states", "cross_attention_states")


def concat_quantized(layers: list[QuantizedLinear]) -> QuantizedLinear:
    """One QuantizedLinear whose output rows are `layers`' rows in order: their codes, scales and biases
    stacked (packed storage rebuilt for the joint row count; nothing is re-quantized)."""
    first = layers[0]
    rows = [row_planes(layer.quantized_weight()) for layer in layers]
    n, k = sum(layer.out_features for layer in layers), first.in_features
    packed = tile_major(tuple(torch.cat(planes) for planes in zip(*rows)), first.weight_format, n, k)
    fused = QuantizedLinear(k, n, bias=first.bias is not None, weight=first.weight_format,
                            group_size=first.group_size, dtype=first.weight_dtype, device=first.qweight.device)
    fused.qweight.copy_(packed)
    fused.scales.copy_(torch.cat([layer.scales for layer in layers]))
    if first.bias is not None:
        fused.bias.copy_(torch.cat([layer.bias for layer in layers]))
    return fused


def concat_dense(layers: list[nn.Linear]) -> nn.Module:
    """One nn.Linear (no gradients) whose output rows are `layers`' rows in order."""
    bias = None if layers[0].bias is None else torch.cat([layer.bias.detach() for layer in layers])
    return linear_from_float(torch.cat([layer.weight.detach() for layer in layers]), bias)


class FusedLinear(nn.Module):
    """The fused layer of one group (`layer`: an nn.Linear or a QuantizedLinear) and the output widths of
    its parts, in order. The parts call `part(i, x)` (module Note)."""

    def __init__(self, layer: nn.Module, names: tuple[str, ...], sizes: tuple[int, ...]):
        super().__init__()
        self.layer = layer
        self.names, self.sizes = names, sizes
        self._kept = None  # (x, x's version, the output's parts, indices not yet taken)
        self._warned = False

    def part(self, i: int, x: torch.Tensor) -> torch.Tensor:
        kept = self._kept
        if kept is None or kept[0] is not x or kept[1] != _version(x):
            if kept is not None and kept[3] and not self._warned:
                logger.warning("fused %s: %s was called with another input while %s had not taken the kept "
                               "product; a part called so computes the whole fused product (correct, slower)",
                               "/".join(self.names), self.names[i], "/".join(self.names[j] for j in sorted(kept[3])))
                self._warned = True
            kept = (x, _version(x), self.layer(x).split(self.sizes, dim=-1), set(range(len(self.sizes))))
        out = kept[2][i]
        kept[3].discard(i)
        self._kept = kept if kept[3] else None  # every part served: drop the output and the input
        return out

    def extra_repr(self) -> str:
        return f"parts={', '.join(f'{n}: {s}' for n, s in zip(self.names, self.sizes))}"


def _version(x: torch.Tensor):
    """x's version counter; None for inference-mode tensors, which keep none, and under torch.compile, which
    cannot read it (there the input is matched by identity alone)."""
    if torch.compiler.is_compiling() or x.is_inference():
        return None
    return x._version


class FusedPart(nn.Module):
    """Stands in for one projection of a fused group under its original name: `forward(x)` returns what
    that projection returned (its rows of the fused product). Holds no weights (the group is not
    registered here, so state_dict, `.to()` and parameters() see it once, under the block)."""

    def __init__(self, group: FusedLinear, index: int):
        super().__init__()
        self.__dict__["group"] = group
        self.index = index
        self.in_features = group.layer.in_features
        self.out_features = group.sizes[index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.part(self.index, x)

    @property
    def rows(self) -> tuple[int, int]:
        start = sum(self.group.sizes[:self.index])
        return start, start + self.group.sizes[self.index]

    @property
    def weight(self) -> torch.Tensor:
        """The projection's own weight rows (a view), for code that reads `.weight` (its dtype, device or
        shape); a quantized group has none."""
        layer = self.group.layer
        if isinstance(layer, QuantizedLinear):
            raise AttributeError("weight")  # as QuantizedLinear, which has none (`dequantize_weight()`)
        return layer.weight[slice(*self.rows)]

    @property
    def bias(self) -> torch.Tensor | None:
        bias = self.group.layer.bias
        return None if bias is None else bias[slice(*self.rows)]

    def extra_repr(self) -> str:
        return f"{self.group.names[self.index]} of the fused group: rows {self.rows[0]}:{self.rows[1]}"


def _fusable(members: list[nn.Module]) -> str | None:
    """Why these layers cannot be joined into one, or None."""
    if all(isinstance(m, QuantizedLinear) for m in members):
        keys = {(m.weight_format, m.group_size, m.weight_dtype, m.in_features, m.bias is None, m.qweight.device)
                for m in members}
        return None if len(keys) == 1 else "quantized differently"
    if all(type(m) is nn.Linear for m in members):
        keys = {(m.weight.dtype, m.weight.device, m.in_features, m.bias is None) for m in members}
        return None if len(keys) == 1 else "different dtypes, devices, widths or biases"
    return "not all nn.Linear or all QuantizedLinear (e.g. some excluded from quantization)"


def _hooked(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks)


def _may_cross_attend(block: nn.Module) -> bool:
    try:
        params = inspect.signature(block.forward).parameters
    except (TypeError, ValueError):
        return False
    return any(arg in params for arg in _CROSS_ARGS)


def fuse_projections(model: nn.Module) -> list[str]:
    """Replace every group of `GROUPS` in `model` by a `FusedLinear` registered under the group's fused
    name in its block, with a `FusedPart` under each member's name; returns the fused layers' names.
    A group is left as it is (logged) when its members differ in kind, format, dtype, width or bias,
    carry hooks (tensor parallelism's), the fused name is taken, or the block may be a cross-attention."""
    fused = []
    for block_name, block in list(model.named_modules()):
        for names, fused_name in GROUPS:
            members = [getattr(block, name, None) for name in names]
            if not all(isinstance(m, nn.Module) for m in members) or any(isinstance(m, FusedPart) for m in members):
                continue
            where = f"{block_name}.{fused_name}" if block_name else fused_name
            reason = _fusable(members)
            if reason is None and any(map(_hooked, members)):
                reason = "hooks on a member"
            if reason is None and hasattr(block, fused_name):
                reason = f"{type(block).__name__} already has an attribute {fused_name!r}"
            if reason is None and names[0] in ("q_proj", "query") and _may_cross_attend(block):
                reason = f"{type(block).__name__}.forward may cross-attend (its k/v may read other states than q)"
            if reason is not None:
                logger.info("replace_with_kernel_inject: not fusing %s: %s", where, reason)
                continue
            join = concat_quantized if isinstance(members[0], QuantizedLinear) else concat_dense
            group = FusedLinear(join(members), names, tuple(m.out_features for m in members))
            block.add_module(fused_name, group)
            for i, name in enumerate(names):
                setattr(block, name, FusedPart(group, i))
            fused.append(where)
    return fused
