"""Weight-only quantized mixture-of-experts layers: transformers 5 keeps a MoE block's experts as one
module with two 3-D parameters, `gate_up_proj` [experts, 2 x intermediate, hidden] and `down_proj`
[experts, hidden, intermediate] (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3, Phi-MoE, GraniteMoE, Jamba,
MiniMax, GLM-4-MoE, ...), not nn.Linear layers, so the linear-layer swap alone leaves most of a MoE
model's weights in float. `QuantizedExperts` holds each expert's two matrices as QuantizedLinear
layers (each kind's buffers views of one stack) and computes what the experts module's eager forward
computes (transformers' `use_experts_implementation` default: a loop over the experts that got tokens):
for a decode step's routes as two grouped launches that read the routes on the device (no host sync, so
CUDA graphs capture it), above MAX_GROUPED_ROWS routes with that loop.

Owns the recognition of such modules (`experts_layout`) and the swap (`quantize_experts`); checkpoint.py
loads saved packed experts back into QuantizedExperts.
"""

from __future__ import annotations


import torch
from torch import nn

from lightspeed._utils.logging import get_logger
from lightspeed._utils.progress import progress
from lightspeed.inference.quantized_linear import QuantizedLinear
from lightspeed.parallel.module_kinds import experts_layout  # noqa: F401 (re-exported)
from lightspeed.ops.wquant import MAX_GROUPED_ROWS, QuantizedWeight, grouped_quantized_matmul, reserve_grouped_scratch
from lightspeed.ops.wquant.reference import check_quant_args

logger = get_logger(__name__)

class QuantizedExperts(nn.Module):
    """A MoE block's experts, each expert's gate|up [2I, H] and down [H, I] matrices a QuantizedLinear
    (`gate_up[e]`, `down[e]`). forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) ->
    [T, H]: for every expert routed to, its tokens through act(gate) * up, then down, weighted, summed
    into their rows in expert order, as the experts module's eager loop does (`_grouped` for up to
    MAX_GROUPED_ROWS routes, fp16/bf16 on CUDA; the loop above that)."""

    def __init__(self, gate_up: list[QuantizedLinear], down: list[QuantizedLinear], act_fn: nn.Module):
        super().__init__()
        self.num_experts = len(gate_up)
        self.gate_up = nn.ModuleList(gate_up)
        self.down = nn.ModuleList(down)
        self.act_fn = act_fn
        self._stacks = None
        self._stack()

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self._stack()  # `.to("cuda")` and the like give every expert's buffers anew
        return self

    def _stack(self) -> None:
        """Make each matrix kind's per-expert buffers views of one stacked tensor, `_stacks` = (gate|up,
        down) QuantizedWeights over them, as the grouped kernel reads them (`grouped_quantized_matmul`).
        The state dict keeps its per-expert names; a stack already in place is kept."""
        if self._stacks is not None and all(
                layer.qweight.data_ptr() == stack.planes[0][e].data_ptr()
                and layer.scales.data_ptr() == stack.scales[e].data_ptr()
                for stack, layers in zip(self._stacks, (self.gate_up, self.down)) for e, layer in enumerate(layers)):
            return
        stacks = []
        for layers in (self.gate_up, self.down):
            planes, scales = torch.stack([m.qweight for m in layers]), torch.stack([m.scales for m in layers])
            for e, layer in enumerate(layers):
                layer.qweight, layer.scales = planes[e], scales[e]
            first = layers[0].quantized_weight()
            stacks.append(QuantizedWeight(first.format, first.shape, first.group_size, (planes,),
                                          scales.view(torch.float16), first.dtype, first.tile))
        self._stacks = tuple(stacks)
        if planes.is_cuda:  # split-K scratch for the grouped launches, before any CUDA-graph capture
            for stack in self._stacks:
                reserve_grouped_scratch(planes.device, stack.format, stack.shape[0], self.num_experts)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        cuda = hidden_states.is_cuda
        if (self._stacks is not None and top_k_index.shape[1] <= MAX_GROUPED_ROWS
                and (not cuda or hidden_states.dtype in (torch.float16, torch.bfloat16))
                and not (torch.is_grad_enabled() and hidden_states.requires_grad)  # the loop has a backward
                and (top_k_index.numel() <= MAX_GROUPED_ROWS or (cuda and torch.cuda.is_current_stream_capturing()))):
            # more routes than one launch takes only while a CUDA graph captures: the loop's host sync would fail
            return self._grouped(hidden_states, top_k_index, top_k_weights)
        out = torch.zeros_like(hidden_states)
        with torch.no_grad():
            routed = nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
            hit = torch.greater(routed.sum(dim=(-1, -2)), 0).nonzero()
        for e in hit[:, 0].tolist():
            if e == self.num_experts:  # the slot transformers gives dropped (masked) routes
                continue
            slot, tokens = torch.where(routed[e])
            gate, up = self.gate_up[e](hidden_states[tokens]).chunk(2, dim=-1)
            y = self.down[e](self.act_fn(gate) * up) * top_k_weights[tokens, slot, None]
            out.index_add_(0, tokens, y.to(out.dtype))
        return out

    def _grouped(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor) -> torch.Tensor:
        """The eager loop's result without its host sync (a decode step's routes; more only under CUDA-graph
        capture, in chunks of MAX_GROUPED_ROWS routes): both products as one grouped launch each, in route
        order (routes to the dropped slot E give zero rows), then each token's routes summed in expert
        order, as the loop adds them (top-1 / top-2: one add, whose order does not matter)."""
        tokens, k = top_k_index.shape
        step = MAX_GROUPED_ROWS // k
        if tokens > step:  # launches of at most MAX_GROUPED_ROWS routes (each reads its chosen experts again)
            return torch.cat([self._grouped(hidden_states[i:i + step], top_k_index[i:i + step],
                                            top_k_weights[i:i + step]) for i in range(0, tokens, step)])
        gate, up = grouped_quantized_matmul(hidden_states, self._stacks[0], top_k_index).chunk(2, dim=-1)
        y = grouped_quantized_matmul(self.act_fn(gate) * up, self._stacks[1], top_k_index.reshape(-1, 1))
        y = (y * top_k_weights.reshape(-1, 1)).to(hidden_states.dtype).view(tokens, k, -1)
        if k <= 2:  # one rounded add, whose order does not matter (an eager step's host time is these ops')
            return y[:, 0] + y[:, 1] if k == 2 else y[:, 0]
        # each token's experts in ascending order, as the eager loop adds them
        y = y.gather(1, top_k_index.argsort(dim=1, stable=True)[:, :, None].expand(-1, -1, y.shape[-1]))
        out = torch.zeros_like(hidden_states)
        for slot in range(k):
            out = out + y[:, slot]
        return out

    def extra_repr(self) -> str:
        first = self.gate_up[0]
        return (f"num_experts={self.num_experts}, hidden={first.in_features}, intermediate={first.out_features // 2}, "
                f"weight={first.weight_format}, group_size={first.group_size}")


def quantize_experts(model: nn.Module, weight: str, group_size: int | None, chosen, device=None,
                     dtype: torch.dtype | None = None) -> list[str]:
    """Swap every experts module of `model` that `chosen(name)` accepts for QuantizedExperts, one expert
    matrix at a time moved to `device`, cast to `dtype` and quantized there; returns the swapped names.
    Experts modules of other layouts, or whose widths the format cannot pack, stay (logged)."""
    from lightspeed.inference.checkpoint import replace_submodule  # lazy: checkpoint.py imports this module

    swapped = []
    candidates = [(name, module) for name, module in model.named_modules()
                  if experts_layout(module) is not None and chosen(name)]
    for name, module in progress(candidates, desc=f"quantizing experts to {weight}", unit="layer"):
        layout = experts_layout(module)
        if isinstance(layout, str):
            logger.warning("init_inference: keeping the experts %s unquantized: %s", name, layout)
            continue
        experts, hidden, inter = layout
        try:
            check_quant_args(weight, (2 * inter, hidden), group_size)
            check_quant_args(weight, (hidden, inter), group_size)
        except ValueError as err:
            logger.warning("init_inference: keeping the experts %s unquantized: %s", name, err)
            continue
        layers = ([], [])
        for e in range(experts):
            for parts, w in zip(layers, (module.gate_up_proj[e], module.down_proj[e])):
                w = w.detach().to(device=device, dtype=dtype)
                parts.append(QuantizedLinear.from_float(w, None, weight=weight, group_size=group_size))
        replace_submodule(model, name, QuantizedExperts(*layers, module.act_fn))
        swapped.append(name)
    return swapped
