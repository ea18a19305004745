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
dtype and device; no autocast on the input's device (nor a device type torch's autocast does not
know); a 4-D input [ep, local experts, capacity, m], as MOELayer hands it. Anything else runs the
loop, which is the general path (the same result, expert by expert).
ZeRO-3 stays correct by construction: its unit rule makes every child of the experts' ModuleList a
unit with forward hooks that gather its parameters, so with parameters to gather the loop runs; the
batched path runs only where nothing hooks the experts: one rank (parameters that never leave, no
hooks), or an ancestor marked a leaf module (`zero_optimization.leaf_module`), whose hook has gathered
them before `Experts.forward` runs and whose pre-backward hook gathers them again before this backward,
as for the loop's F.linear (tests/distributed/test_moe_training.py runs both ZeRO-3 cases). Experts
sliced by `enable_expert_tensor_parallelism` hold tensor_parallel.py's layers, not nn.Linear: loop.

Note: [the batched linear] `BatchedLinear.apply(x [E, R, in], n, fused, *weights, *biases)`: stacks
the n experts' weights (a temporary) and runs `torch.bmm` over the [experts, capacity, hidden] buffer.
The biases are added as the loop's nn.Linear adds them, so low-precision results round alike: inside
the product (`torch.baddbmm`, nn.Linear's fused addmm on a contiguous input: the second layer, and the
first when ep is 1) or after it (nn.Linear's matmul + add on the non-contiguous share [ep, 1, ...] the
loop hands the first layer when ep > 1). It saves the parameters themselves for backward, not the stack (a
stack saved by autograd would hold a copy of every expert's weights from forward to backward: up to a
GB per layer for fine-grained experts), and stacks them again there for the input's gradient; the
weights' gradients come from one `bmm` and are handed to each parameter as its slice, so every
expert's own parameter receives its gradient (names, state dicts, optimizer and ZeRO partitioning
unchanged). bmm, not the grouped GEMM of ops/grouped_gemm: every expert has the same capacity here
(DeepSpeed's buffer), so the groups are equal and a strided batched GEMM (cuBLAS, every transpose
free) is exactly the problem; the grouped kernels' gain is skipping the padding of uneven groups, which
this buffer already holds, and their CPU path is a loop over groups. Forward + backward on one CPU
thread (`Experts`, GatedMLP experts; two runs on a shared, loaded machine): 16 experts 128 -> 88 -> 128
at capacity 32, loop 2.4-6.5 ms, bmm 1.6-2.4 ms, grouped_mlp 2.1-6.2 ms; 64 experts 64 -> 48 -> 64 at
16, 4.5-7.0 / 2.3-2.5 / 3.2-3.3 ms; 8 experts 256 -> 512 -> 256 at 64, 14-31 / 18-44 / 20-100 ms: the
batched path wins where experts are many and small (the Python and launch cost of the loop), and on
the CPU loses some to bmm's transposed operands for few large experts, the regime where the GPU loop
is near the GEMM roofline anyway (cuBLAS' batched GEMM takes either transpose at no cost).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.nn.modules import module as torch_module

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
    """One nn.Linear per expert over an [E, R, in] buffer (the Note on the batched linear); `fused`: the
    bias added inside the product (baddbmm), else after it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, n: int, fused: bool, *params: torch.Tensor) -> torch.Tensor:
        weights, biases = params[:n], params[n:]
        w = torch.stack(weights).transpose(1, 2)
        ctx.n, ctx.bias = n, bool(biases)
        ctx.save_for_backward(x, *weights)
        if biases and fused:
            return torch.baddbmm(torch.stack(biases).unsqueeze(1), x, w)
        out = torch.bmm(x, w)
        return out + torch.stack(biases).unsqueeze(1) if biases else out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, *weights = ctx.saved_tensors
        n = ctx.n
        need = ctx.needs_input_grad
        grad_x = torch.bmm(grad, torch.stack(weights)) if need[0] else None
        grad_w = [None] * n
        if any(need[3:3 + n]):
            grad_w = list(torch.bmm(grad.transpose(1, 2), x).unbind(0))
        grad_b = []
        if ctx.bias:
            grad_b = list(grad.sum(1).unbind(0)) if any(need[3 + n:]) else [None] * n
        return (grad_x, None, None, *grad_w, *grad_b)


def _no_hooks(module: nn.Module) -> bool:
    return not (module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks or "forward" in module.__dict__)


def _autocast_may_run(device_type: str) -> bool:
    """True when autocast is on for `device_type`, or torch knows no autocast there (e.g. "meta")."""
    try:
        return torch.is_autocast_enabled(device_type)
    except RuntimeError:
        return True


def _global_hooks() -> bool:
    return any(getattr(torch_module, name, None) for name in (
        "_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
        "_global_backward_pre_hooks"))


_PLAIN_FUNCTION = nn.Parameter.__torch_function__
_PLAIN_DISPATCH = torch.Tensor.__torch_dispatch__


def _plain_param(p, shape: tuple, dtype: torch.dtype, device: torch.device) -> bool:
    cls = type(p)
    return (issubclass(cls, nn.Parameter) and cls.__torch_function__ is _PLAIN_FUNCTION
            and cls.__torch_dispatch__ is _PLAIN_DISPATCH and p.shape == shape and p.dtype == dtype
            and p.device == device)


def _linear_params(linears: tuple, x: torch.Tensor) -> list | None:
    """[weights..., biases...] of the experts' i-th nn.Linear layers, or None when they cannot batch."""
    first = linears[0]
    if type(first) is not nn.Linear:
        return None
    has_bias = first._parameters.get("bias") is not None
    weight_shape = torch.Size((first.out_features, first.in_features))
    bias_shape = torch.Size((first.out_features,))
    dtype, device = x.dtype, x.device
    weights, biases = [], []
    for lin in linears:
        if type(lin) is not nn.Linear or not _no_hooks(lin):
            return None
        params = lin._parameters
        weight, bias = params.get("weight"), params.get("bias")
        if (bias is not None) != has_bias or not _plain_param(weight, weight_shape, dtype, device):
            return None
        if has_bias and not _plain_param(bias, bias_shape, dtype, device):
            return None
        weights.append(weight)
        if has_bias:
            biases.append(bias)
    return weights + biases


def _activation(acts: tuple) -> nn.Module | None:
    first = acts[0]
    kind = type(first)
    if kind not in ACTIVATIONS:
        return None
    key = first.extra_repr()
    if any(type(a) is not kind or not _no_hooks(a) or a.extra_repr() != key for a in acts):
        return None
    return first


def _layers(modules: list) -> tuple | None:
    """(first linears, activations, second linears, gated) of the experts, or None if not recognised."""
    kind = type(modules[0])
    if any(type(m) is not kind for m in modules):
        return None
    if kind is nn.Sequential:
        layers = [tuple(m._modules.values()) for m in modules]
        if any(len(children) != 3 for children in layers):
            return None
        return (*zip(*layers), False)
    if kind is GatedMLP:
        names = ("gate_up", "act", "down")
        return (*zip(*([m._modules.get(name) for name in names] for m in modules)), True)
    return None


def batched_experts(experts: nn.ModuleList, x: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The batched forward of `experts` ([E, R, in] -> [E, R, out]) for the input `x`, or None when the
    experts or the call are not the Note's recognised case (then the loop runs)."""
    modules = list(experts)
    if x.dim() != 4 or not modules or x.size(1) != len(modules) or _global_hooks():
        return None
    if _autocast_may_run(x.device.type) or not all(_no_hooks(m) for m in modules):
        return None
    layers = _layers(modules)
    if layers is None:
        return None
    first, acts, second, gated = layers
    act = _activation(acts)
    p1 = None if act is None else _linear_params(first, x)
    p2 = None if p1 is None else _linear_params(second, x)
    if p2 is None or first[0].in_features != x.size(-1):
        return None
    if first[0].out_features != (2 if gated else 1) * second[0].in_features:
        return None
    n = len(modules)
    fused = x[:, :1].is_contiguous()  # the loop's first layer sees a contiguous share: nn.Linear's addmm

    def forward(buffer: torch.Tensor) -> torch.Tensor:
        h = BatchedLinear.apply(buffer, n, fused, *p1)
        if gated:
            gate, up = h.chunk(2, dim=-1)
            h = act(gate) * up
        else:
            h = act(h)
        return BatchedLinear.apply(h, n, True, *p2)
    return forward
