"""CPU optimizers (CPUAdam, CPUAdagrad, CPULion) vs their references and vs torch.optim."""
from __future__ import annotations

import copy

import pytest
import torch

from lightspeed.ops.adagrad import CPUAdagrad, DeepSpeedCPUAdagrad, adagrad_step
from lightspeed.ops.adam import CPUAdam, DeepSpeedCPUAdam, adam_step
from lightspeed.ops.lion import CPULion, DeepSpeedCPULion, lion_step

SIZES = [0, 1, 7, 33, 1023, 4099]
# (atol, rtol) per param dtype, states always fp32
TOL = {torch.float32: (1e-6, 1e-5), torch.bfloat16: (1e-2, 1e-2), torch.float16: (2e-3, 2e-3)}
STEPS = 3


def _params(dtype, seed=0, sizes=SIZES):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen).to(dtype).requires_grad_() for n in sizes]


def _set_grads(params, step, seed=1):
    gen = torch.Generator().manual_seed(seed * 1000 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)


def _close(a, b, dtype):
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(a.float(), b.float(), atol=atol, rtol=rtol)


def _run(opt_cls, kwargs, params, steps=STEPS, **step_kw):
    opt = opt_cls(params, **kwargs)
    for s in range(steps):
        _set_grads(params, s)
        opt.step(**step_kw)
    return opt


def test_aliases():
    assert DeepSpeedCPUAdam is CPUAdam and DeepSpeedCPUAdagrad is CPUAdagrad and DeepSpeedCPULion is CPULion


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("adamw", [True, False])
@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_adam_vs_reference(dtype, adamw, bias_correction, wd):
    kw = dict(lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=wd)
    params = _params(dtype)
    opt = _run(CPUAdam, dict(kw, bias_correction=bias_correction, adamw_mode=adamw), params)
    ref = _params(dtype)
    ms = [torch.zeros(p.shape) for p in ref]
    vs = [torch.zeros(p.shape) for p in ref]
    for s in range(STEPS):
        _set_grads(ref, s)
        for p, m, v in zip(ref, ms, vs):
            adam_step(p.data, p.grad, m, v, step=s + 1, lr=kw["lr"], beta1=0.8, beta2=0.95, eps=1e-6,
                      weight_decay=wd, adamw=adamw, bias_correction=bias_correction)
    for p, r, m, v in zip(params, ref, ms, vs):
        assert p.dtype == dtype
        _close(p, r, dtype)
        st = opt.state[p]
        assert st["step"] == STEPS
        assert st["exp_avg"].dtype == torch.float32 and st["exp_avg_sq"].dtype == torch.float32
        _close(st["exp_avg"], m, dtype)
        _close(st["exp_avg_sq"], v, dtype)


@pytest.mark.parametrize("adamw", [True, False])
@pytest.mark.parametrize("wd", [0.0, 0.05])
def test_adam_vs_torch(adamw, wd):
    kw = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=wd)
    params = _params(torch.float32)
    _run(CPUAdam, dict(kw, adamw_mode=adamw), params, steps=5)
    ref = _params(torch.float32)
    _run(torch.optim.AdamW if adamw else torch.optim.Adam, dict(kw, foreach=False), ref, steps=5)
    for p, r in zip(params, ref):
        _close(p, r, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_adagrad(dtype, wd):
    params = _params(dtype)
    _run(CPUAdagrad, dict(lr=1e-2, eps=1e-10, weight_decay=wd), params)
    ref = _params(dtype)
    ss = [torch.zeros(p.shape) for p in ref]
    for s in range(STEPS):
        _set_grads(ref, s)
        for p, v in zip(ref, ss):
            adagrad_step(p.data, p.grad, v, step=s + 1, lr=1e-2, eps=1e-10, weight_decay=wd)
    for p, r in zip(params, ref):
        _close(p, r, dtype)
    if dtype == torch.float32:
        tref = _params(dtype)
        _run(torch.optim.Adagrad, dict(lr=1e-2, eps=1e-10, weight_decay=wd, foreach=False), tref)
        for p, r in zip(params, tref):
            _close(p, r, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_lion(dtype, wd):
    params = _params(dtype)
    opt = _run(CPULion, dict(lr=1e-3, betas=(0.9, 0.99), weight_decay=wd), params)
    ref = _params(dtype)
    ms = [torch.zeros(p.shape) for p in ref]
    for s in range(STEPS):
        _set_grads(ref, s)
        for p, m in zip(ref, ms):
            lion_step(p.data, p.grad, m, step=s + 1, lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=wd)
    for p, r, m in zip(params, ref, ms):
        _close(p, r, dtype)
        _close(opt.state[p]["exp_avg"], m, dtype)


def test_lion_zero_momentum_sign():
    # DeepSpeed copies the sign bit of c onto lr: c == +0 moves the param by -lr
    p = torch.zeros(5, requires_grad=True)
    p.grad = torch.zeros(5)
    CPULion([p], lr=0.5).step()
    torch.testing.assert_close(p.detach(), torch.full((5,), -0.5))


@pytest.mark.parametrize("cls,kw", [(CPUAdam, dict(lr=1e-2, weight_decay=0.01)),
                                    (CPUAdagrad, dict(lr=1e-2)), (CPULion, dict(lr=1e-3))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_dict_round_trip(cls, kw, dtype):
    params = _params(dtype, sizes=[5, 1000])
    opt = _run(cls, kw, params, steps=2)
    sd = copy.deepcopy(opt.state_dict())
    clone = [p.detach().clone().requires_grad_() for p in params]
    opt2 = cls(clone, **kw)
    opt2.load_state_dict(sd)
    for p, q in zip(params, clone):
        for k, v in opt.state[p].items():
            w = opt2.state[q][k]
            if isinstance(v, torch.Tensor):
                assert w.dtype == v.dtype == torch.float32
                assert torch.equal(v, w)
            else:
                assert v == w
    for s in range(2, 4):
        _set_grads(params, s)
        _set_grads(clone, s)
        opt.step()
        opt2.step()
    for p, q in zip(params, clone):
        assert torch.equal(p, q)


@pytest.mark.parametrize("cls,kw", [(CPUAdam, dict(lr=1e-2, weight_decay=0.01)),
                                    (CPUAdagrad, dict(lr=1e-2)), (CPULion, dict(lr=1e-3))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lowp", [torch.bfloat16, torch.float16])
def test_fp16_param_groups_copy(cls, kw, dtype, lowp, monkeypatch):
    import lightspeed.ops.adam.cpu_adam as mod
    monkeypatch.setattr(mod, "CHUNK_ELEMS", 1000)  # exercise several chunks and a ragged tail
    params = _params(dtype, sizes=[0, 1, 7, 4099])
    copies = [torch.zeros(p.shape, dtype=lowp) for p in params]
    _run(cls, kw, params, fp16_param_groups=[copies])
    plain = _params(dtype, sizes=[0, 1, 7, 4099])
    _run(cls, kw, plain)
    for p, q, c in zip(params, plain, copies):
        assert torch.equal(p, q)
        if dtype == torch.float32 or dtype == lowp:
            assert torch.equal(c, p.detach().to(lowp))
        else:  # the copy is rounded from the fp32 result, not from the bf16 param
            _close(c, p.detach(), dtype)


def test_skips_params_without_grad_and_closure():
    a = torch.randn(4, requires_grad=True)
    b = torch.randn(4, requires_grad=True)
    b0 = b.detach().clone()
    opt = CPUAdam([a, b])

    def closure():
        a.grad = torch.ones(4)
        return torch.tensor(3.0)

    assert opt.step(closure).item() == 3.0
    assert torch.equal(b.detach(), b0) and b not in opt.state
    assert opt.state[a]["step"] == 1


def test_param_groups_and_amsgrad():
    a = torch.randn(10, requires_grad=True)
    b = torch.randn(3, requires_grad=True)
    opt = CPUAdam([{"params": [a]}, {"params": [b], "lr": 0.1, "bias_correction": False}])
    a.grad, b.grad = torch.randn(10), torch.randn(3)
    a_ref, b_ref = a.detach().clone(), b.detach().clone()
    opt.step()
    for p, ref, lr, bc in [(a, a_ref, 1e-3, True), (b, b_ref, 0.1, False)]:
        m, v = torch.zeros_like(ref), torch.zeros_like(ref)
        adam_step(ref, p.grad, m, v, step=1, lr=lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0,
                  adamw=True, bias_correction=bc)
        _close(p, ref, torch.float32)
    with pytest.raises(RuntimeError):
        CPUAdam([a], amsgrad=True)


def test_fp16_states_when_not_fp32_optimizer_states():
    p = torch.randn(100).bfloat16().requires_grad_()
    p.grad = torch.randn(100).bfloat16()
    opt = CPUAdam([p], fp32_optimizer_states=False)
    opt.step()
    assert opt.state[p]["exp_avg"].dtype == torch.bfloat16


def test_non_contiguous_param_uses_reference():
    base = torch.randn(8, 6)
    p = base.t().contiguous().t().requires_grad_()  # non-contiguous leaf
    assert not p.is_contiguous()
    p.grad = torch.randn(8, 6)
    q = p.detach().clone()
    CPUAdam([p], lr=0.1).step()
    m, v = torch.zeros_like(q), torch.zeros_like(q)
    adam_step(q, p.grad, m, v, step=1, lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0, adamw=True)
    _close(p, q, torch.float32)


@pytest.mark.parametrize("cls,kw", [(CPUAdam, dict(lr=1e-2, weight_decay=0.01)),
                                    (CPUAdagrad, dict(lr=1e-2)), (CPULion, dict(lr=1e-3))])
@pytest.mark.parametrize("scale", [None, 0.37])
def test_zero_step_pieces_match_the_plain_step(cls, kw, scale, monkeypatch):
    """The ZeRO step (grads= / grad_scale= / lowp_out=): stepped in pieces (several, with a ragged
    tail) it gives the plain step on gradients multiplied by the coefficient, and each low-precision
    target holds the updated values from its offset on (targets of odd offsets and dtypes)."""
    import lightspeed.ops.adam.cpu_adam as mod
    monkeypatch.setattr(mod, "PIECE_ELEMS", 1000)
    sizes = [7, 4099, 2500]
    params = [p.detach() for p in _params(torch.float32, sizes=sizes)]
    plain = [p.clone().requires_grad_() for p in params]
    opt, ref = cls(params, **kw), cls(plain, **kw)
    targets = {p: [(0, torch.zeros(3, dtype=torch.bfloat16)), (3, torch.zeros(p.numel() - 3, dtype=torch.bfloat16))]
               for p in params}
    targets[params[1]] = [(1000, torch.zeros(2099)), (3100, torch.zeros(999, dtype=torch.float16))]
    for s in range(STEPS):
        _set_grads(plain, s)
        grads = {p: q.grad.clone() for p, q in zip(params, plain)}
        if scale is not None:
            for q in plain:
                q.grad.mul_(scale)
        opt.step(grads=grads, grad_scale=None if scale is None else torch.tensor(scale), lowp_out=targets)
        ref.step()
        for p, q in zip(params, plain):
            if scale is not None and cls is CPUAdam:  # the kernel divides by 1/scale: one rounding apart
                torch.testing.assert_close(p, q.detach(), atol=1e-6, rtol=1e-6)
            else:
                assert torch.equal(p, q.detach())
            for offset, t in targets[p]:
                assert torch.equal(t, p[offset:offset + t.numel()].to(t.dtype))
    with pytest.raises(ValueError, match="pass one"):
        opt.step(fp16_param_groups=[[torch.zeros(7)] * 3], lowp_out=targets)


def _one_call_per_piece(opt, p, g, step, scale, lo, hi):
    """The fp32 ZeRO step as it was before the gradient was staged: one kernel call per piece on the
    host gradient itself (which the kernel, or the multiply before it, overwrites)."""
    group = opt.param_groups[0]
    state = opt.state[p]
    gp = g.view(-1)[lo:hi]
    kwargs = {}
    if opt._kernel_scales:
        kwargs = {"grad_scale": 1.0 / scale}
    else:
        gp.mul_(scale)
    opt._kernel([p.view(-1)[lo:hi]], [gp], [[state[k].view(-1)[lo:hi]] for k in opt._state_keys], [step], group,
                **kwargs)


@pytest.mark.parametrize("cls,kw", [(CPUAdam, dict(lr=1e-2, weight_decay=0.01)),
                                    (CPUAdam, dict(lr=1e-2, weight_decay=0.01, adamw_mode=False)),
                                    (CPUAdagrad, dict(lr=1e-2)), (CPULion, dict(lr=1e-3))])
def test_zero_step_with_coefficient_reads_the_gradient_only(cls, kw, monkeypatch):
    """With a coefficient the fp32 ZeRO step stages the gradient chunk by chunk: after N steps (ranges
    of odd bounds, pieces of several chunks, ragged tails) the parameters and state equal bitwise
    one kernel call per piece on the host gradient, and the host gradient is left as handed in
    (the scaled input), where that call overwrote it."""
    import lightspeed.ops.adam.cpu_adam as mod
    monkeypatch.setattr(mod, "PIECE_ELEMS", 3 * 1024 + 128)
    monkeypatch.setattr(mod, "STAGE_ELEMS", 1024)
    params = [p.detach() for p in _params(torch.float32, sizes=[7, 9001])]
    old = [p.clone() for p in params]
    opt, ref = cls(params, **kw), cls(old, **kw)
    for s in range(STEPS):
        gen = torch.Generator().manual_seed(s)
        grads = {p: torch.randn(p.shape, generator=gen) for p in params}
        handed = {p: g.clone() for p, g in grads.items()}
        scale = torch.tensor(0.37 + s, dtype=torch.float32)
        opt.begin_zero_step(grads, scale)
        for p in params:  # two ranges, the first ending off any vector width
            cut = min(p.numel(), 5003)
            opt.zero_step_range(p, 0, cut)
            opt.zero_step_range(p, cut, p.numel())
        opt.end_zero_step()
        for p, q in zip(params, old):
            g = grads[p].clone()
            step = ref._init_state(q)["step"] = ref.state[q].get("step", 0) + 1
            cut = min(q.numel(), 5003)
            for lo, hi in ((0, cut), (cut, q.numel())):
                for a in range(lo, hi, mod.PIECE_ELEMS):
                    _one_call_per_piece(ref, q, g, step, scale, a, min(hi, a + mod.PIECE_ELEMS))
            assert not torch.equal(g, handed[p]) or p.numel() == 0  # the old path wrote the gradient
            assert torch.equal(grads[p], handed[p]), "the host gradient was written"
            assert torch.equal(p, q)
            for k in opt._state_keys:
                assert torch.equal(opt.state[p][k], ref.state[q][k])


def test_zero_step_low_precision_chunks_match_one_reference_call(monkeypatch):
    """bf16 masters with bf16 state (bf16_optimizer_states offloaded): the plain path runs chunk by
    chunk and equals bitwise one reference call over the whole range; the gradient is only read and
    the state stays bf16."""
    import lightspeed.ops.adam.cpu_adam as mod
    monkeypatch.setattr(mod, "CHUNK_ELEMS", 1000)
    p = torch.randn(4099).bfloat16()
    q = p.clone()
    opt = CPUAdam([p], lr=1e-2, weight_decay=0.01, fp32_optimizer_states=False)
    m, v = torch.zeros_like(q), torch.zeros_like(q)
    for s in range(STEPS):
        g = torch.randn(4099, generator=torch.Generator().manual_seed(s)).bfloat16()
        handed = g.clone()
        scale = torch.tensor(0.37)
        opt.step(grads={p: g}, grad_scale=scale)
        adam_step(q, handed * scale, m, v, step=s + 1, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                  weight_decay=0.01, adamw=True)
        assert torch.equal(g, handed)
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["exp_avg"], m) and torch.equal(opt.state[p]["exp_avg_sq"], v)
        assert opt.state[p]["exp_avg"].dtype == torch.bfloat16


def test_speculative_redo_reads_the_gradient_as_handed_in():
    """The speculative step (offload/speculative.py) steps with 1/loss_scale, restores, and redoes the
    step with the clip coefficient on the same host gradients: the redo equals stepping once with that
    coefficient (it would unscale twice if the first step had written the unscaled gradient back)."""
    from lightspeed.offload.speculative import Rollback

    p = torch.randn(5000)
    q = p.clone()
    g = torch.randn(5000)
    handed = g.clone()
    # eps of the gradient's order: Adam's update then depends on the gradient's scale
    opt, ref = CPUAdam([p], lr=1e-2, eps=1e-3), CPUAdam([q], lr=1e-2, eps=1e-3)
    rollback = Rollback(opt)
    params = opt.begin_zero_step({p: g}, torch.tensor(1 / 256.0))
    rollback.begin(params, torch.tensor(1 / 256.0))
    rollback.save(p, 0, p.numel())
    opt.zero_step_range(p, 0, p.numel())
    opt.end_zero_step()
    rollback.restore()
    clip = torch.tensor(0.001)
    opt.step(grads={p: g}, grad_scale=clip)
    ref.step(grads={q: handed}, grad_scale=clip)
    assert torch.equal(p, q)


EPS32 = torch.finfo(torch.float32).eps


@pytest.mark.parametrize("adamw", [True, False])
@pytest.mark.parametrize("wd", [0.0, 0.1])
@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("steps_before", [0, 3])
def test_adam_inverse_undoes_the_step(adamw, wd, bias_correction, steps_before, monkeypatch):
    """ops/adam/inverse.py undoes CPUAdam's ZeRO step (the fused kernel, with a coefficient) to within
    a few fp32 roundings of the values it is computed from: each recovered master and moment within
    8 eps32 of |before| + |after| elementwise (measured: at most 3.5 eps32); at step 1 the moments come
    back as the zeros they were."""
    from lightspeed.ops.adam import inverse

    monkeypatch.setattr(inverse, "CHUNK_ELEMS", 1000)  # the larger sizes span several chunks, a partial last
    sizes = [1, 7, 33, 1023, 4099, 100_003]
    gen = torch.Generator().manual_seed(7)
    params = [torch.randn(n, generator=gen) for n in sizes]
    opt = CPUAdam(params, lr=1e-2, betas=(0.9, 0.99), weight_decay=wd, adamw_mode=adamw,
                  bias_correction=bias_correction)
    for _ in range(steps_before):
        opt.step(grads={p: torch.randn(p.shape, generator=gen) for p in params}, grad_scale=torch.tensor(0.5))
    before = [[p.clone()] + [opt.state[p][k].clone() if opt.state.get(p) else torch.zeros_like(p)
                             for k in ("exp_avg", "exp_avg_sq")] for p in params]
    # a gradient spike (10x): the moments' history is small against the term taken out of them
    grads = {p: 10 * torch.randn(p.shape, generator=gen) for p in params}
    coef = torch.tensor(1 / 3.0)
    opt.step(grads=grads, grad_scale=coef)
    handed = {p: g.clone() for p, g in grads.items()}
    for p, old in zip(params, before):
        new = [p.clone(), opt.state[p]["exp_avg"].clone(), opt.state[p]["exp_avg_sq"].clone()]
        assert opt.state[p]["step"] == steps_before + 1
        opt.undo_zero_step_range(p, 0, p.numel(), grads[p], coef)
        assert torch.equal(grads[p], handed[p])  # the gradient is only read
        got = [p, opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]]
        for name, x, was, stepped in zip(("param", "exp_avg", "exp_avg_sq"), got, old, new):
            bound = 8 * EPS32 * (was.abs() + stepped.abs())
            assert bool(((x - was).abs() <= bound).all()), (name, float((x - was).abs().max()))
            if steps_before == 0 and name != "param":
                assert torch.equal(x, torch.zeros_like(x)), name
        assert bool((opt.state[p]["exp_avg_sq"] >= 0).all())


def test_adam_inverse_of_a_range_leaves_the_rest():
    """`undo_zero_step_range` undoes elements [start, end) only."""
    p = torch.randn(1000)
    opt = CPUAdam([p], lr=1e-2, weight_decay=0.1)
    g = torch.randn(1000)
    opt.step(grads={p: torch.randn(1000)})
    opt.step(grads={p: g})
    stepped = [p.clone(), opt.state[p]["exp_avg"].clone(), opt.state[p]["exp_avg_sq"].clone()]
    opt.undo_zero_step_range(p, 100, 333, g, None)
    for now, was in zip((p, opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]), stepped):
        assert torch.equal(now[:100], was[:100]) and torch.equal(now[333:], was[333:])
        assert not torch.equal(now[100:333], was[100:333])


def test_speculative_inverse_rollback_redoes_the_step():
    """The inverse rollback (offload/speculative.py): a speculative step with 1/loss_scale undone from
    its gradient and redone with the clip coefficient lands within a few fp32 ulps of stepping once
    with that coefficient; a range with a non-finite gradient is held back, not stepped."""
    from lightspeed.offload.speculative import Rollback

    gen = torch.Generator().manual_seed(3)
    p = torch.randn(5000, generator=gen)
    q = p.clone()
    opt, ref = CPUAdam([p], lr=1e-2), CPUAdam([q], lr=1e-2)
    for _ in range(2):
        g0 = torch.randn(5000, generator=gen)
        opt.step(grads={p: g0})
        ref.step(grads={q: g0.clone()})
    g = torch.randn(5000, generator=gen)
    g[4500] = float("inf")
    rollback = Rollback(opt, "inverse")
    coef = torch.tensor(1 / 256.0)
    params = opt.begin_zero_step({p: g}, coef)
    rollback.begin(params, coef, {p: g})
    for start, end in ((0, 2000), (2000, 4000), (4000, 5000)):
        if rollback.save(p, start, end):
            opt.zero_step_range(p, start, end)
    opt.end_zero_step()
    assert rollback.deferred and rollback.held_back == 1
    assert torch.equal(p[4000:], q[4000:])  # the held-back range was not stepped
    rollback.restore()
    g[4500] = 1.0
    clip = torch.tensor(0.001)
    opt.step(grads={p: g}, grad_scale=clip)
    ref.step(grads={q: g.clone()}, grad_scale=clip)
    assert opt.state[p]["step"] == ref.state[q]["step"] == 3
    torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)  # q's elements ~1: ulps relative
    for k in ("exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(opt.state[p][k], ref.state[q][k], rtol=1e-4, atol=0)


def test_rollback_mode_follows_the_optimizer():
    """`super_offload_rollback` unset: "inverse" for fp32 Adam/AdamW, "copy" where no inverse exists;
    "inverse" asked of an optimizer without one names the key."""
    from lightspeed.offload.speculative import rollback_mode

    p = torch.randn(10)
    assert rollback_mode(CPUAdam([p]), None) == "inverse"
    assert rollback_mode(CPUAdam([p]), "copy") == "copy"
    assert rollback_mode(CPULion([p]), None) == "copy"
    assert rollback_mode(CPUAdam([p.bfloat16()]), None) == "copy"
    with pytest.raises(NotImplementedError, match="super_offload_rollback"):
        rollback_mode(CPUAdagrad([p]), "inverse")
    with pytest.raises(NotImplementedError, match="bfloat16 gradients"):
        rollback_mode(CPUAdam([p]), "inverse", {p: torch.zeros(10, dtype=torch.bfloat16)})
    with pytest.raises(ValueError, match="super_offload_rollback"):
        rollback_mode(CPUAdam([p]), "exact")
