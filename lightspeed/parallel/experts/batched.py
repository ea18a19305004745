"""All of a rank's local experts at once, when each is a recognised MLP: `batched_experts` (the plan for
`Experts.forward`, or None: run the loop), `BatchedLinear` (one linear layer per expert, as one batched
matmul over the equal-capacity buffer) and `GatedMLP` (a gated expert MLP whose forward is known).

Owns: the rule that decides which experts are recognised, and their batched forward and backward.
Must not: dispatch, communicate or weight by the gate (layer.py does), nor touch the experts'
parameters (names, marks, placement stay those of the deep copies).

Note: [recognised experts] The batched path runs when every local expert is, by exact type (a subclass
may change forward): `nn.Sequential(nn.Linear, act, nn.Linear)`, or `GatedMLP`
(`down(act(gate) * up)` with `gate | up = gate_up(x)`), where `act` is one of `ACTIVATIONS` (elementwise,
no state, no randomness) and is the same in every expert (type and `extra_repr`); the biases are on or
off, the same in every expert; every expert's linear layers have the same shapes. It also needs: no
forward, backward or pre-hook on any expert module or on all modules (torch's global hooks), and no
`forward` set on an instance; every weight and bias a plain `nn.Parameter` (or a subclass that
overrides no tensor behaviour, as ZeRO-3's `ZeroParameter`) of its layer's declared shape, the input's
dtype and device; no autocast on the input's device; a 4-D input [ep, local experts, capacity, m]
(as MOELayer hands it). Anything else runs the loop, which
is the general path (the same result, expert by expert).
This keeps ZeRO-3 correct by construction: its unit rule makes every child of the experts' ModuleList
a unit with forward hooks that gather its parameters, so with parameters to gather the loop runs; the
batched path runs only where nothing hooks the experts (one rank, whose parameters never leave, or an
ancestor module marked a leaf, whose hook has gathered them before `Experts.forward` runs; its
pre-backward hook gathers them again before this backward, as for the loop's F.linear). Experts
sliced by `enable_expert_tensor_parallelism` hold tensor_parallel.py's layers, not nn.Linear: loop.

Note: [the batched linear] `BatchedLinear.apply(x [E, R, in], n, *weights, *biases)`: stacks the n
experts' weights (a temporary) and runs `torch.bmm` (`torch.baddbmm` with the stacked biases) over the
[experts, capacity, hidden] buffer. It saves the parameters themselves for backward, not the stack (a
stack saved by autograd would hold a copy of every expert's weights from forward to backward: up to a
GB per layer for fine-grained experts), and stacks them again there for the input's gradient; the
weights' gradients come from one `bmm` and are handed to each parameter as its slice, so every
expert's own parameter receives its gradient (names, state dicts, optimizer and ZeRO partitioning
unchanged). bmm, not the grouped GEMM of ops/grouped_gemm: every expert has the same capacity here
(DeepSpeed's buffer), so the groups are equal and a strided batched GEMM is exactly the problem; the
grouped kernels' gain is skipping the padding of uneven groups, which this buffer already holds.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

ACTIVATIONS = (nn.ReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Mish, nn.LeakyReLU, nn.ELU, nn.CELU, nn.SELU,
               nn.Softplus, nn.Hardswish, nn.Hardsigmoid, nn.Hardtanh, nn.ReLU6)


class GatedMLP(nn.Module):
    """A gated expert MLP the batched path recognises: x -> down(act(gate) * up), where gate | up are
    the two halves of `gate_up(x)` (Mixtral's and DeepSeek's experts with `act=nn.SiLU()`)."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: nn.Module | None = None,
                 bias: bool = False) -> None:
        super().__init__()
        self.gate_up = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.act = nn.SiLU() if act is None else act
        self.down = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(self.act(gate) * up)


class BatchedLinear(torch.autograd.Function):
    """One nn.Linear per expert over an [E, R, in] buffer (the Note on the batched linear)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, n: int, *params: torch.Tensor) -> torch.Tensor:
        weights, biases = params[:n], params[n:]
        w = torch.stack(weights).transpose(1, 2)
        ctx.n, ctx.bias = n, bool(biases)
        ctx.save_for_backward(x, *weights)
        if biases:
            return torch.baddbmm(torch.stack(biases).unsqueeze(1), x, w)
        return torch.bmm(x, w)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, *weights = ctx.saved_tensors
        n = ctx.n
        need = ctx.needs_input_grad
        grad_x = torch.bmm(grad, torch.stack(weights)) if need[0] else None
        grad_w = [None] * n
        if any(need[2:2 + n]):
            grad_w = list(torch.bmm(grad.transpose(1, 2), x).unbind(0))
        grad_b = []
        if ctx.bias:
            grad_b = list(grad.sum(1).unbind(0)) if any(need[2 + n:]) else [None] * n
        return (grad_x, None, *grad_w, *grad_b)


def _no_hooks(module: nn.Module) -> bool:
    return not (module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks or "forward" in module.__dict__)


def _global_hooks() -> bool:
    from torch.nn.modules import module as torch_module

    return any(getattr(torch_module, name, None) for name in (
        "_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
        "_global_backward_pre_hooks"))


def _plain_param(p, shape: tuple, like: torch.Tensor) -> bool:
    cls = type(p)
    return (isinstance(p, nn.Parameter) and issubclass(cls, nn.Parameter)
            and cls.__torch_function__ is nn.Parameter.__torch_function__
            and cls.__torch_dispatch__ is torch.Tensor.__torch_dispatch__
            and tuple(p.shape) == shape and p.dtype == like.dtype and p.device == like.device)


def _linear_params(linears: list, x: torch.Tensor) -> list | None:
    """[weights..., biases...] of the experts' i-th nn.Linear layers, or None when they cannot batch."""
    first = linears[0]
    has_bias = first.bias is not None
    weight_shape, bias_shape = (first.out_features, first.in_features), (first.out_features,)
    weights, biases = [], []
    for lin in linears:
        if type(lin) is not nn.Linear or not _no_hooks(lin) or (lin.bias is not None) != has_bias:
            return None
        if (lin.out_features, lin.in_features) != weight_shape or not _plain_param(lin.weight, weight_shape, x):
            return None
        if has_bias and not _plain_param(lin.bias, bias_shape, x):
            return None
        weights.append(lin.weight)
        if has_bias:
            biases.append(lin.bias)
    return weights + biases


def _activation(acts: list) -> nn.Module | None:
    first = acts[0]
    if type(first) not in ACTIVATIONS:
        return None
    key = first.extra_repr()
    if any(type(a) is not type(first) or not _no_hooks(a) or a.extra_repr() != key for a in acts):
        return None
    return first


def batched_experts(experts: nn.ModuleList, x: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The batched forward of `experts` ([E, R, in] -> [E, R, out]) for the input `x`, or None when the
    experts or the call are not the Note's recognised case (then the loop runs)."""
    modules = list(experts)
    if x.dim() != 4 or not modules or x.size(1) != len(modules) or any(not _no_hooks(m) for m in modules) or _global_hooks():
        return None
    if torch.is_autocast_enabled(x.device.type):
        return None
    kind = type(modules[0])
    if any(type(m) is not kind for m in modules):
        return None
    if kind is nn.Sequential:
        if any(len(m) != 3 for m in modules):
            return None
        first, act, second = zip(*(tuple(m) for m in modules))
        gated = False
    elif kind is GatedMLP:
        first, act, second = zip(*((m.gate_up, m.act, m.down) for m in modules))
        gated = True
        if first[0].out_features != 2 * second[0].in_features:
            return None
    else:
        return None
    act = _activation(list(act))
    if act is None or type(first[0]) is not nn.Linear or type(second[0]) is not nn.Linear:
        return None
    p1 = _linear_params(list(first), x)
    p2 = None if p1 is None else _linear_params(list(second), x)
    if p2 is None or first[0].in_features != x.size(-1):
        return None
    if first[0].out_features != (2 if gated else 1) * second[0].in_features:
        return None
    n = len(modules)

    def forward(buffer: torch.Tensor) -> torch.Tensor:
        h = BatchedLinear.apply(buffer, n, *p1)
        if gated:
            gate, up = h.chunk(2, dim=-1)
            h = act(gate) * up
        else:
            h = act(h)
        return BatchedLinear.apply(h, n, *p2)
    return forward
