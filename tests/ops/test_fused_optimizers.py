"""FusedAdam / FusedLamb / FusedLion / FusedAdagrad: the Triton multi-tensor kernels (on CUDA, or on CPU
under TRITON_INTERPRET=1, set by tests/conftest.py) against the plain-PyTorch references and torch.optim,
on awkward sizes, mixed dtypes, the fused ZeRO extras (grads=, grad_scale=, lowp_out=) and state."""
from __future__ import annotations

import copy
import gc
import os
import weakref

import pytest
import torch

from lightspeed.ops.adagrad import FusedAdagrad
from lightspeed.ops.adam import FusedAdam
from lightspeed.ops.lamb import FusedLamb
from lightspeed.ops.lion import FusedLion

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)

# sizes: empty, tiny, around the kernels' block (1024 elements), several blocks, not a multiple of 8
SHAPES = [(0,), (1,), (7, 3), (1023,), (1024,), (1025,), (33, 65), (4099,)]
# (rtol, atol) by parameter dtype; fp32: the same formula in another fp32 order (and FMA contraction on GPU). bf16: one ulp (2^-8
# relative) from rounding differences on the GPU; the interpreter rounds fp32 -> bf16 toward zero
# instead of to nearest even, and over 3 steps that reaches 3 ulps.
INTERPRETED = DEVICE == "cpu"
TOL = {torch.float32: (1e-5, 1e-6), torch.float16: (1e-3, 1e-3),
       torch.bfloat16: (2.4e-2, 2.4e-2) if INTERPRETED else (8e-3, 8e-3)}

FAMILIES = {
    "adam": (FusedAdam, dict(lr=1e-2, weight_decay=0.1, betas=(0.8, 0.95), eps=1e-6)),
    "adam_l2": (FusedAdam, dict(lr=1e-2, weight_decay=0.1, adam_w_mode=False)),
    "adam_nobc": (FusedAdam, dict(lr=1e-3, bias_correction=False)),
    "lion": (FusedLion, dict(lr=1e-3, weight_decay=0.1, betas=(0.9, 0.99))),
    "adagrad": (FusedAdagrad, dict(lr=1e-2, lr_decay=0.05, weight_decay=0.01, initial_accumulator_value=0.1)),
    "lamb": (FusedLamb, dict(lr=1e-2, weight_decay=0.01, max_grad_norm=0.5)),
    "lamb_inside": (FusedLamb, dict(lr=1e-2, eps=1e-4, eps_inside_sqrt=True, min_coeff=0.5, max_coeff=0.6)),
}


def _params(seed, dtype, shapes=SHAPES):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).to(DEVICE, dtype) for s in shapes]


def _grads(seed, params, dtype=None):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(p.shape, generator=gen) * 0.3).to(DEVICE, dtype or p.dtype) for p in params]


def _close(got, want, dtype):
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol)


def _pair(family, dtype, seed=0):
    cls, hyper = FAMILIES[family]
    ps, qs = _params(seed, dtype), _params(seed, dtype)
    return ps, qs, cls(ps, backend="triton", **hyper), cls(qs, backend="reference", **hyper)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_matches_reference(family, dtype):
    ps, qs, fast, ref = _pair(family, dtype)
    for step in range(3):
        for p, q, g in zip(ps, qs, _grads(100 + step, ps)):
            p.grad, q.grad = g, g.clone()
        scale = torch.tensor(0.5, device=DEVICE) if step == 1 else None
        fast.step(grad_scale=scale)
        ref.step(grad_scale=scale)
    for p, q in zip(ps, qs):
        _close(p, q, dtype)
    for p, q in zip(ps, qs):
        for key, value in fast.state[p].items():
            if isinstance(value, torch.Tensor):
                assert value.dtype == torch.float32  # fp32 state whatever the parameter dtype
                if dtype == torch.float32:
                    _close(value, ref.state[q][key], dtype)
                else:  # the state follows parameters that may be an ulp apart (weight decay)
                    torch.testing.assert_close(value, ref.state[q][key], rtol=TOL[dtype][0], atol=1e-3)
    if family.startswith("lamb"):
        rel = 1e-4 if dtype == torch.float32 else TOL[dtype][0]
        assert fast.get_lamb_coeffs() == pytest.approx(ref.get_lamb_coeffs(), rel=rel)


@pytest.mark.parametrize("torch_cls, ours, hyper", [
    (torch.optim.AdamW, lambda ps, **h: FusedAdam(ps, backend="triton", **h), dict(lr=1e-2, weight_decay=0.1)),
    (torch.optim.Adam, lambda ps, **h: FusedAdam(ps, backend="triton", adam_w_mode=False, **h),
     dict(lr=1e-2, weight_decay=0.1)),
    (torch.optim.Adagrad, lambda ps, **h: FusedAdagrad(ps, backend="triton", **h),
     dict(lr=1e-2, lr_decay=0.1, weight_decay=0.1, initial_accumulator_value=0.2)),
])
def test_kernel_matches_torch_optim(torch_cls, ours, hyper):
    ps, qs = _params(1, torch.float32), _params(1, torch.float32)
    a, b = ours(ps, **hyper), torch_cls(qs, **hyper)
    for step in range(4):
        for p, q, g in zip(ps, qs, _grads(7 + step, ps)):
            p.grad, q.grad = g, g.clone()
        a.step()
        b.step()
    for p, q in zip(ps, qs):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", ["adam", "lion", "adagrad"])
@pytest.mark.parametrize("grad_dtype, out_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
                                                   (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("offset", [0, 3])  # 3: every piece starts off the vector alignment
def test_fused_zero_step_on_flat_shard(family, grad_dtype, out_dtype, offset):
    """The ZeRO form: an fp32 master shard stepped with low-precision gradients passed by `grads=`, the
    unscale/clip coefficient as a device tensor, and the low-precision copy written piece by piece."""
    n = 5000 + offset
    master, twin = _params(2, torch.float32, [(n,)])[0], None
    twin = master.clone()
    grad = _grads(3, [master], grad_dtype)[0]
    cuts = [offset, offset + 1000, offset + 1000 + 2049, n]  # three pieces and an uncovered head
    outs = [torch.full((b - a,), -7.0, device=DEVICE, dtype=out_dtype) for a, b in zip(cuts, cuts[1:])]
    cls, hyper = FAMILIES[family]
    fast = cls([master], backend="triton", **hyper)
    ref = cls([twin], backend="reference", **hyper)
    coef = torch.tensor(0.25, device=DEVICE)
    for _ in range(2):
        fast.step(grads={master: grad}, grad_scale=coef,
                  lowp_out={master: [(a, out) for a, out in zip(cuts, outs)]})
        ref.step(grads={twin: grad}, grad_scale=coef)
    assert master.grad is None
    _close(master, twin, torch.float32)
    for a, b, out in zip(cuts, cuts[1:], outs):
        _close(out, twin[a:b].to(out_dtype), out_dtype)
        assert out.dtype == out_dtype


def test_many_tensors_one_launch_and_plan_cache():
    from lightspeed.ops import multi_tensor

    ps = _params(4, torch.float32, [(i * 37 % 301 + 1,) for i in range(120)])
    qs = [p.clone() for p in ps]
    fast, ref = FusedAdam(ps, backend="triton"), FusedAdam(qs, backend="reference")
    for step in range(2):
        for p, q, g in zip(ps, qs, _grads(step, ps)):
            p.grad, q.grad = g, g.clone()
        fast.step()
        ref.step()
    for p, q in zip(ps, qs):
        _close(p, q, torch.float32)
    assert len(multi_tensor._cache) >= 1


def test_launch_cache_survives_new_gradients_and_keeps_none_alive():
    ps = _params(11, torch.float32, [(300,), (5, 7)])
    qs = [p.clone() for p in ps]
    fast, ref = FusedAdam(ps, backend="triton", lr=0.01), FusedAdam(qs, backend="reference", lr=0.01)
    for p, q, g in zip(ps, qs, _grads(12, ps)):
        p.grad, q.grad = g, g.clone()
    fast.step()
    ref.step()
    first = fast._launch_cache[0][1]
    fast.step()  # same tensors: the cached launches are used
    ref.step()
    assert fast._launch_cache[0][1] is first
    for p, q, g in zip(ps, qs, _grads(13, ps)):  # new gradient tensors (as after zero_grad(set_to_none)):
        p.grad, q.grad = g, g.clone()             # same launches, the gradient offsets follow
    fast.step()
    ref.step()
    assert fast._launch_cache[0][1] is first
    probe = weakref.ref(ps[0].grad)
    fast.zero_grad()  # set_grad_none: nothing in the optimizer may keep the gradient alive
    gc.collect()
    assert probe() is None
    ps[1].grad = _grads(14, ps)[1]  # a parameter without a gradient is skipped, and its step does not advance
    qs[1].grad = ps[1].grad.clone()
    qs[0].grad = None
    fast.step()
    ref.step()
    for p, q in zip(ps, qs):
        _close(p, q, torch.float32)
    assert fast.state[ps[0]]["step"] == 3 and fast.state[ps[1]]["step"] == 4


def test_noncontiguous_param_and_set_grad_none():
    base = _params(5, torch.float32, [(6, 9)])[0]
    p = base.t()  # a transposed view: the step works on a contiguous copy and writes it back
    q = p.clone()
    a, b = FusedAdam([p], backend="triton", lr=0.1), FusedAdam([q], backend="reference", lr=0.1)
    g = _grads(6, [q])[0]
    p.grad, q.grad = g.t().contiguous().t(), g.clone()
    a.step()
    b.step()
    _close(p, q, torch.float32)
    a.zero_grad()
    assert p.grad is None
    c = FusedAdam([q], set_grad_none=False)
    q.grad = torch.ones_like(q)
    c.zero_grad()
    assert q.grad is not None and not q.grad.any()


@pytest.mark.parametrize("family", ["adam", "lion", "adagrad", "lamb"])
def test_state_dict_round_trip_continues_identically(family):
    cls, hyper = FAMILIES[family]
    ps = _params(8, torch.float32, [(33,), (5, 7)])
    opt = cls(ps, backend="triton", **hyper)
    for step in range(2):
        for p, g in zip(ps, _grads(step, ps)):
            p.grad = g
        opt.step()
    saved = copy.deepcopy(opt.state_dict())  # state_dict() holds the live state tensors
    qs = [p.detach().clone() for p in ps]
    twin = cls(qs, backend="triton", **hyper)
    twin.load_state_dict(saved)
    for p, q, g in zip(ps, qs, _grads(9, ps)):
        p.grad, q.grad = g, g.clone()
    opt.step()
    twin.step()
    for p, q in zip(ps, qs):
        assert torch.equal(p, q)


def test_errors():
    p = _params(0, torch.float32, [(4,)])
    with pytest.raises(RuntimeError, match="AMSGrad"):
        FusedAdam(p, amsgrad=True)
    with pytest.raises(RuntimeError, match="AMSGrad"):
        FusedLamb(p, amsgrad=True)
    with pytest.raises(ValueError, match="backend"):
        FusedAdam(p, backend="cuda")
    with pytest.raises(ValueError, match="lowp_out"):
        FusedLamb(p).step(lowp_out={p[0]: [(0, torch.empty(4, device=DEVICE))]})
    opt = FusedAdam(p)
    p[0].grad = torch.ones(4, device=DEVICE)
    with pytest.raises(ValueError, match="overlap or exceed"):
        opt.step(lowp_out={p[0]: [(2, torch.empty(3, device=DEVICE))]})


def test_gradients_moving_to_unaligned_addresses_take_the_unaligned_kernel():
    ps = _params(15, torch.float32, [(1000,), (1000,)])
    qs = [p.clone() for p in ps]
    fast, ref = FusedAdam(ps, backend="triton", lr=0.01), FusedAdam(qs, backend="reference", lr=0.01)
    for step in range(3):
        flat = _grads(20 + step, [torch.empty(2020)])[0]
        start = 0 if step == 0 else 3  # step 0: aligned views; then views 3 elements off alignment
        grads = [flat[start:start + 1000], flat[start + 1008:start + 2008]]
        for p, q, g in zip(ps, qs, grads):
            p.grad, q.grad = g, g.clone()
        fast.step()
        ref.step()
        (plan, _), = fast._launch_cache[0][1][0]._plans.values()
        assert plan.aligned == (step == 0)
    for p, q in zip(ps, qs):
        _close(p, q, torch.float32)
