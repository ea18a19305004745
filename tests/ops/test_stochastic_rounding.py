"""Stochastic rounding of bf16 masters and optimizer state (bf16.stochastic_rounding): the plain-PyTorch
spec (ops/rounding.py), the Triton kernels (on CUDA, or on CPU under TRITON_INTERPRET=1, set by
tests/conftest.py), the fused optimizers' reference path and the CPU Adam's chunked path.

Each stored bf16 value is one of the two bf16 neighbours of the fp32 value the same step computes
with fp32 tensors; the mean over many draws of one value is that value (unbiased; fixed seeds, and a
tolerance of 5 standard deviations of the mean, far below the round-to-nearest error the values are
chosen to have); with the option off the step is bitwise the round-to-nearest one."""
from __future__ import annotations

import os

import pytest
import torch

from lightspeed.ops.adagrad import FusedAdagrad
from lightspeed.ops.adam import CPUAdam, FusedAdam
from lightspeed.ops.lion import FusedLion
from lightspeed.ops.rounding import mix_seed, stochastic_round_bf16

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HAS_TRITON = DEVICE == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
# sizes: tiny, around the kernels' block (1024 elements), not multiples of 8, one constant run of 8192
SHAPES = [(1,), (7, 3), (1023,), (1025,), (33, 65)]
N_CONST = 8192
FAMILIES = {
    "adam": (FusedAdam, dict(lr=1e-3, weight_decay=0.1, betas=(0.9, 0.999), eps=1e-8)),
    "lion": (FusedLion, dict(lr=1e-3, weight_decay=0.1, betas=(0.9, 0.99))),
    "adagrad": (FusedAdagrad, dict(lr=1e-3, weight_decay=0.01)),
}


def _neighbours(exact: torch.Tensor, got: torch.Tensor) -> None:
    """Every finite `got` (bf16) is `exact` (fp32) with its low 16 bits cleared, or the next bf16 value
    away from zero when those bits are not all zero; inf and nan are kept."""
    raw = exact.float().reshape(-1).view(torch.int32)
    out = got.float().reshape(-1).view(torch.int32)
    finite = torch.isfinite(exact.reshape(-1))
    low = raw & ~0xFFFF
    high = low + torch.where((raw & 0xFFFF) != 0, 0x10000, 0)
    ok = (out == low) | (out == high)
    assert bool(ok[finite].all()), f"{int((~ok[finite]).sum())} values are not a bf16 neighbour of the fp32 value"
    nonfinite = ~finite
    assert torch.equal(torch.isnan(got.float().reshape(-1))[nonfinite], torch.isnan(exact.reshape(-1))[nonfinite])
    both = nonfinite & ~torch.isnan(exact.reshape(-1))
    assert torch.equal(got.float().reshape(-1)[both], exact.reshape(-1)[both])


def _unbiased(exact: float, draws: torch.Tensor) -> None:
    """The mean of `draws` (bf16 roundings of the one fp32 value `exact`) is `exact` within 5 standard
    deviations of the mean, and round-to-nearest is farther off than that (the test can fail)."""
    x = torch.tensor([exact], dtype=torch.float32)
    exact = float(x[0])
    lo = (x.view(torch.int32) & ~0xFFFF).view(torch.float32)
    gap = float((lo.view(torch.int32) + 0x10000).view(torch.float32).abs() - lo.abs())
    q = (abs(exact) - abs(float(lo))) / gap  # the probability of rounding away from zero
    assert 0.1 < q < 0.9, f"{exact} is too near a bf16 value for this check (q={q})"
    tol = 5 * gap * (q * (1 - q) / draws.numel()) ** 0.5
    mean = draws.double().mean().item()
    assert abs(mean - exact) < tol, (mean, exact, tol)
    assert abs(float(x.bfloat16()) - exact) > 3 * tol


def test_reference_rounding_neighbours_specials_and_bias():
    gen = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(4096, generator=gen) * 10.0 ** torch.randint(-30, 30, (4096,), generator=gen),
                   torch.tensor([0.0, -0.0, 1.0, -1.0, 1e-40, -1e-40, 3.0e38, -3.0e38, float("inf"), float("-inf"),
                                 float("nan"), torch.finfo(torch.float32).max, -torch.finfo(torch.float32).max])])
    got = stochastic_round_bf16(x, torch.Generator().manual_seed(1))
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    _neighbours(x, got)
    # both neighbours occur; the same generator seed draws the same bits
    def bits(t):
        return t.view(torch.int16)
    assert not torch.equal(bits(got), bits(x.bfloat16()))
    assert not torch.equal(bits(got), bits(stochastic_round_bf16(x, torch.Generator().manual_seed(2))))
    assert torch.equal(bits(got), bits(stochastic_round_bf16(x, torch.Generator().manual_seed(1))))
    for value in (1.0 - 1e-3, -0.0123456, 3.3e-5, 12300.0):
        _unbiased(value, stochastic_round_bf16(torch.full((1 << 16,), value), torch.Generator().manual_seed(2)))
    with pytest.raises(TypeError, match="fp32"):
        stochastic_round_bf16(x.double())


def test_mix_seed_is_a_62_bit_function_of_its_parts():
    seeds = {mix_seed(7, step, launch) for step in range(50) for launch in range(4)}
    assert len(seeds) == 200 and all(1 << 62 <= s < 1 << 63 for s in seeds)
    assert mix_seed(7, 3, 1) == mix_seed(7, 3, 1) != mix_seed(8, 3, 1)


def _tensors(seed: int):
    """bf16 params (awkward sizes, then a constant run) and bf16 gradients."""
    gen = torch.Generator().manual_seed(seed)
    ps = [torch.randn(s, generator=gen).bfloat16() for s in SHAPES] + [torch.ones(N_CONST, dtype=torch.bfloat16)]
    gs = [(torch.randn(s, generator=gen) * 0.3).bfloat16() for s in SHAPES]
    gs.append(torch.full((N_CONST,), 0.37, dtype=torch.bfloat16))
    return [p.to(DEVICE) for p in ps], [g.to(DEVICE) for g in gs]


def _optimizer(family, params, backend, rounding: bool | None):
    cls, hyper = FAMILIES[family]
    opt = cls(params, backend=backend, **hyper)
    if rounding is not None:  # None: fp32 params and state, the exact values
        opt.state_dtype = torch.bfloat16
        opt.stochastic_rounding, opt.rounding_seed = rounding, 1234
    return opt


def _check_family(family: str, backend: str) -> None:
    ps, gs = _tensors(0)
    sr = _optimizer(family, ps, backend, True)
    exact_ps = [p.float() for p in ps]
    exact = _optimizer(family, exact_ps, backend, None)
    rtn_ps = [p.clone() for p in ps]
    rtn = _optimizer(family, rtn_ps, backend, False)
    default_ps = [p.clone() for p in ps]
    default = _optimizer(family, default_ps, backend, None)
    default.state_dtype = torch.bfloat16
    outs = [torch.empty_like(p) for p in ps]
    for step in range(2):
        if step:  # the fp32 run restarts from the rounded values, so each step is compared on its own
            for p, q in zip(ps, exact_ps):
                q.copy_(p)
                for key, value in sr.state[p].items():
                    if isinstance(value, torch.Tensor):
                        exact.state[q][key].copy_(value)
        exact.step(grads=dict(zip(exact_ps, gs)))
        sr.step(grads=dict(zip(ps, gs)), lowp_out={p: [(0, o)] for p, o in zip(ps, outs)})
        rtn.step(grads=dict(zip(rtn_ps, gs)))
        default.step(grads=dict(zip(default_ps, gs)))
        if step == 0 and backend == "reference":  # torch's conversion: round to nearest even
            for p, q in zip(rtn_ps, exact_ps):
                assert torch.equal(p, q.bfloat16())
        for p, q, o in zip(ps, exact_ps, outs):
            _neighbours(q, p)
            assert torch.equal(o, p)  # the low-precision copy takes the stored master
            for key in exact.state[q]:
                if isinstance(exact.state[q][key], torch.Tensor):
                    assert sr.state[p][key].dtype == torch.bfloat16
                    _neighbours(exact.state[q][key], sr.state[p][key])
        if step == 0:  # the constant run: the mean over its elements is the one fp32 value
            assert exact_ps[-1].unique().numel() == 1 and ps[-1].unique().numel() == 2
            _unbiased(float(exact_ps[-1][0]), ps[-1])
    # off: bitwise the round-to-nearest step; on: different from it
    for p, q in zip(rtn_ps, default_ps):
        assert torch.equal(p, q)
    assert not all(torch.equal(p, q) for p, q in zip(ps, rtn_ps))


@pytest.mark.skipif(not HAS_TRITON, reason="Triton needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_triton_kernels_round_stochastically(family):
    pytest.importorskip("triton")
    _check_family(family, "triton")


@pytest.mark.parametrize("family", ["adam"])
def test_reference_path_rounds_stochastically(family):
    _check_family(family, "reference")


def test_fixed_seed_repeats_and_steps_draw_anew():
    def run(seed):
        ps, gs = _tensors(3)
        opt = _optimizer("adam", ps, "reference", True)
        opt.rounding_seed = seed
        history = []
        for _ in range(2):
            opt.step(grads=dict(zip(ps, gs)))
            history.append([p.clone() for p in ps])
        return history
    a, b, c = run(1), run(1), run(2)
    assert all(torch.equal(x, y) for step_a, step_b in zip(a, b) for x, y in zip(step_a, step_b))
    assert not all(torch.equal(x, y) for x, y in zip(a[1], c[1]))


def test_lamb_refuses_stochastic_rounding():
    from lightspeed.ops.lamb import FusedLamb

    p = torch.zeros(4, dtype=torch.bfloat16, requires_grad=True)
    p.grad = torch.ones(4, dtype=torch.bfloat16)
    opt = FusedLamb([p], backend="reference")
    opt.stochastic_rounding = True
    with pytest.raises(ValueError, match="does not round stochastically"):
        opt.step()


@pytest.mark.parametrize("states", [torch.bfloat16, torch.float32])
def test_cpu_adam_zero_step_rounds_stochastically(states, monkeypatch):
    import lightspeed.ops.adam.cpu_adam as cpu_adam

    monkeypatch.setattr(cpu_adam, "CHUNK_ELEMS", 1000)  # several chunks, the last one partial
    gen = torch.Generator().manual_seed(5)
    p0 = torch.cat([torch.randn(3000, generator=gen), torch.ones(N_CONST)]).bfloat16()
    g = torch.cat([torch.randn(3000, generator=gen) * 0.3, torch.full((N_CONST,), 0.37)]).bfloat16()

    def make(dtype, rounding):
        p = p0.clone().to(dtype)
        fp32_states = states == torch.float32 or dtype != p0.dtype
        opt = CPUAdam([p], lr=1e-3, weight_decay=0.1, fp32_optimizer_states=fp32_states)
        opt.stochastic_rounding, opt.rounding_seed = rounding, 99
        return p, opt

    p, sr = make(torch.bfloat16, True)
    q, exact = make(torch.float32, False)
    r, rtn = make(torch.bfloat16, False)
    out = torch.empty_like(p)
    sr.step(grads={p: g}, grad_scale=torch.tensor(1.0), lowp_out={p: [(0, out)]})
    exact.step(grads={q: g}, grad_scale=torch.tensor(1.0))
    rtn.step(grads={r: g}, grad_scale=torch.tensor(1.0))
    _neighbours(q, p)
    assert torch.equal(out, p)
    for key in ("exp_avg", "exp_avg_sq"):
        assert sr.state[p][key].dtype == states
        if states == torch.bfloat16:
            _neighbours(exact.state[q][key], sr.state[p][key])
        else:
            assert torch.equal(sr.state[p][key], exact.state[q][key])
    _unbiased(float(q[-1]), p[-N_CONST:])
    # off: the existing path, DeepSpeedCPUAdam's numbers (the reference's round-to-nearest)
    want = p0.clone()
    m = torch.zeros_like(want, dtype=states)
    v = torch.zeros_like(want, dtype=states)
    from lightspeed.ops.adam import adam_step

    adam_step(want, g, m, v, step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, adamw=True)
    assert torch.equal(r, want) and not torch.equal(p, want)
