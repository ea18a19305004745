"""The DeepSpeed-style layer's batched experts (parallel/experts/batched.py) against its per-expert loop
(`Experts.forward_loop`, the reference): outputs, the input's gradient and every expert parameter's
gradient agree (fp32 tight, bf16 looser) for nn.Sequential and GatedMLP experts, biases on and off,
capacity 1, odd sizes, one and several local experts, an ep axis of 1 and 2, frozen parameters; what is
not recognised (other modules, hooks, instance forwards, mixed dtypes, autocast, `batched = False`)
runs the loop; and a whole MoE layer gives the loop's results."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightspeed.parallel.experts import Experts, GatedMLP, MoE
from lightspeed.parallel.experts.batched import BatchedLinear, batched_experts

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _seq(m, i, bias, act=None):
    return nn.Sequential(nn.Linear(m, i, bias=bias), act or nn.GELU(), nn.Linear(i, m, bias=bias))


def _experts(expert: nn.Module, n: int, dtype) -> Experts:
    torch.manual_seed(0)
    experts = Experts(expert, n).to(dtype)
    with torch.no_grad():  # distinct experts, so a mixed-up expert shows
        for module in experts.deepspeed_experts:
            for p in module.parameters():
                p.copy_(torch.randn_like(p, dtype=torch.float32).to(dtype) * 0.5)
    return experts


def _run(experts: Experts, x: torch.Tensor, loop: bool):
    x = x.detach().requires_grad_()
    out = experts.forward_loop(x) if loop else experts(x)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(out.dtype))
    grads = {n: p.grad for n, p in experts.named_parameters()}
    return out, x.grad, grads


def _compare(experts: Experts, x: torch.Tensor):
    assert batched_experts(experts.deepspeed_experts, x) is not None, "the batched path did not engage"
    reference = copy.deepcopy(experts)
    out, gx, grads = _run(experts, x, loop=False)
    want, want_gx, want_grads = _run(reference, x, loop=True)
    tol = TOL[x.dtype]
    torch.testing.assert_close(out, want, **tol)
    torch.testing.assert_close(gx, want_gx, **tol)
    assert set(grads) == set(want_grads)
    for name, g in want_grads.items():
        if g is None:
            assert grads[name] is None, name
        else:
            assert grads[name] is not None and grads[name].shape == g.shape, name
            torch.testing.assert_close(grads[name], g, **tol, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["seq", "seq-bias", "gated", "gated-bias"])
@pytest.mark.parametrize("ep,local,capacity,hidden,inter", [(1, 1, 1, 7, 5), (2, 3, 1, 5, 3), (1, 4, 6, 9, 11),
                                                           (2, 2, 3, 1, 1)])
def test_batched_matches_loop(dtype, kind, ep, local, capacity, hidden, inter):
    bias = kind.endswith("bias")
    expert = _seq(hidden, inter, bias) if kind.startswith("seq") else GatedMLP(hidden, inter, bias=bias)
    experts = _experts(expert, local, dtype)
    x = torch.randn(ep, local, capacity, hidden, generator=torch.Generator().manual_seed(1)).to(dtype)
    _compare(experts, x)


@pytest.mark.parametrize("act", [nn.ReLU(inplace=True), nn.GELU(approximate="tanh"), nn.SiLU(), nn.Tanh(),
                                 nn.LeakyReLU(0.2)])
def test_activations_and_gated_activation(act):
    x = torch.randn(2, 3, 4, 6, generator=torch.Generator().manual_seed(2))
    _compare(_experts(_seq(6, 5, True, copy.deepcopy(act)), 3, torch.float32), x)
    if not getattr(act, "inplace", False):  # an in-place act on a chunk fails in GatedMLP's own forward too
        _compare(_experts(GatedMLP(6, 5, act=copy.deepcopy(act)), 3, torch.float32), x)


def test_frozen_parameters_get_no_gradient():
    experts = _experts(_seq(5, 4, True), 3, torch.float32)
    experts.deepspeed_experts[1][0].weight.requires_grad_(False)
    for p in experts.deepspeed_experts[2].parameters():
        p.requires_grad_(False)
    _compare(experts, torch.randn(1, 3, 2, 5))
    assert experts.deepspeed_experts[1][0].weight.grad is None


class _MyLinear(nn.Linear):
    pass


def _unrecognised():
    """name -> (Experts, input) that must run the loop."""
    x = torch.randn(1, 2, 3, 4)
    seq = lambda: _experts(_seq(4, 6, True), 2, torch.float32)  # noqa: E731
    cases = {
        "dropout": (_experts(nn.Sequential(nn.Linear(4, 6), nn.Dropout(0.0), nn.Linear(6, 4)), 2, torch.float32), x),
        "four layers": (_experts(nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 4), nn.ReLU()), 2,
                                 torch.float32), x),
        "linear subclass": (_experts(nn.Sequential(_MyLinear(4, 6), nn.ReLU(), nn.Linear(6, 4)), 2, torch.float32),
                            x),
        "softmax": (_experts(nn.Sequential(nn.Linear(4, 6), nn.Softmax(-1), nn.Linear(6, 4)), 2, torch.float32), x),
        "other module": (_experts(nn.Linear(4, 4), 2, torch.float32), x),
        "input dtype": (seq(), x.double()),
        "3-d input": (seq(), x[0]),
    }
    hooked = seq()
    hooked.deepspeed_experts[1].register_forward_hook(lambda *a: None)
    cases["hook on an expert"] = (hooked, x)
    pre = seq()
    pre.deepspeed_experts[0][2].register_forward_pre_hook(lambda *a: None)
    cases["pre-hook on a layer"] = (pre, x)
    inst = seq()
    inst.deepspeed_experts[0][0].forward = lambda t: t
    cases["instance forward"] = (inst, x)
    mixed = seq()
    mixed.deepspeed_experts[1][2].double()
    cases["an expert of another dtype"] = (mixed, x)
    shapes = _experts(_seq(4, 6, True), 2, torch.float32)
    shapes.deepspeed_experts[1][0] = nn.Linear(4, 6, bias=False)
    cases["biases in some experts"] = (shapes, x)
    return cases


@pytest.mark.parametrize("case", list(_unrecognised()))
def test_unrecognised_experts_run_the_loop(case):
    experts, x = _unrecognised()[case]
    assert batched_experts(experts.deepspeed_experts, x) is None


def test_hooks_still_run_and_the_switch(monkeypatch):
    experts = _experts(_seq(4, 6, False), 2, torch.float32)
    x = torch.randn(2, 2, 3, 4)
    assert batched_experts(experts.deepspeed_experts, x) is not None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert batched_experts(experts.deepspeed_experts, x) is None
    calls = []
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: calls.append(m))
    try:
        assert batched_experts(experts.deepspeed_experts, x) is None
        experts(x)
    finally:
        handle.remove()
    assert len(calls) == 1 + 2 * 4  # Experts, every expert module and its three layers: the loop ran
    applied = []
    apply = BatchedLinear.apply
    monkeypatch.setattr(BatchedLinear, "apply", lambda *a: applied.append(1) or apply(*a))
    experts(x)
    assert len(applied) == 2
    experts.batched = False
    torch.testing.assert_close(experts(x), experts.forward_loop(x), rtol=0, atol=0)
    assert len(applied) == 2


@pytest.mark.parametrize("expert", ["seq", "gated"])
def test_moe_layer_matches_the_loop(expert):
    d = 6
    module = _seq(d, 10, True) if expert == "seq" else GatedMLP(d, 10)
    torch.manual_seed(0)
    layer = MoE(d, module, num_experts=4, k=2, min_capacity=1, use_rts=False, drop_tokens=False)
    with torch.no_grad():
        for i, m in enumerate(layer.deepspeed_moe.experts.deepspeed_experts):
            for p in m.parameters():
                p.mul_(1 + 0.1 * i)
    probe = torch.zeros(1, 4, 2, d)
    assert batched_experts(layer.deepspeed_moe.experts.deepspeed_experts, probe) is not None
    loop = copy.deepcopy(layer)
    loop.deepspeed_moe.experts.batched = False
    x = torch.randn(3, 5, d, generator=torch.Generator().manual_seed(4))
    outs = []
    for model in (layer, loop):
        torch.manual_seed(7)  # top-2's sampled second expert: the same routes on both
        out, l_aux, _ = model(x)
        (out.square().sum() + l_aux).backward()
        outs.append((out, {n: p.grad for n, p in model.named_parameters()}))
    torch.testing.assert_close(outs[0][0], outs[1][0], **TOL[torch.float32])
    assert set(outs[0][1]) == set(outs[1][1])
    for name, g in outs[1][1].items():
        torch.testing.assert_close(outs[0][1][name], g, **TOL[torch.float32], msg=name)
