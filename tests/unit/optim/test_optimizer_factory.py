"""build_optimizer: names, Adam modes, hyperparameters, errors; Lamb and Lion against reference steps
written out here (fp32, awkward sizes, a few steps)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from lightspeed import ConfigError
from lightspeed.ops.adagrad import FusedAdagrad
from lightspeed.ops.adam import FusedAdam
from lightspeed.ops.lamb import FusedLamb as Lamb
from lightspeed.ops.lion import FusedLion as Lion
from lightspeed.optim import build_optimizer

SHAPES = [(7, 13), (1,), (3, 5, 2), (257,), (0,)]
ATOL, RTOL = 1e-6, 1e-5  # fp32, identical formulas in a different order


def _params(seed: int = 0, shapes=SHAPES) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]


def _grads(step: int, shapes=SHAPES) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(s, generator=gen) * 0.1 for s in shapes]


def _defaults(opt, *keys):
    return {k: opt.defaults[k] for k in keys}


# ---- names and Adam modes -------------------------------------------------------------------


@pytest.mark.parametrize(
    "type_name, extra, cls, adamw, weight_decay",
    [
        ("Adam", {}, FusedAdam, True, 0.0),  # adam_w_mode defaults to true; FusedAdam's wd default 0
        ("adam", {"adam_w_mode": False}, FusedAdam, False, 0.0),
        ("ADAMW", {}, FusedAdam, True, 0.0),
        ("AdamW", {"adam_w_mode": False}, FusedAdam, True, 0.0),  # type AdamW forces decoupled decay
        ("Adam", {"torch_adam": True}, torch.optim.AdamW, True, 0.01),  # torch's own defaults with torch_adam
        ("Adam", {"torch_adam": True, "adam_w_mode": False}, torch.optim.Adam, False, 0.0),
        ("AdamW", {"torch_adam": True, "adam_w_mode": False}, torch.optim.AdamW, True, 0.01),
    ],
)
def test_adam_family_modes(type_name, extra, cls, adamw, weight_decay):
    opt = build_optimizer({"type": type_name, "params": {"lr": 3e-4, **extra}}, _params())
    assert type(opt) is cls
    if cls is FusedAdam:
        assert opt.adam_w_mode is adamw
    assert opt.defaults["lr"] == 3e-4 and opt.defaults["weight_decay"] == weight_decay
    assert tuple(opt.defaults["betas"]) == (0.9, 0.999) and opt.defaults["eps"] == 1e-8
    assert "torch_adam" not in opt.defaults and "adam_w_mode" not in opt.defaults


def test_adam_bias_correction_false_reaches_fused_adam():
    opt = build_optimizer({"type": "Adam", "params": {"bias_correction": False}}, _params())
    assert opt.defaults["bias_correction"] is False


def test_adagrad_with_torch_only_params_builds_torch_adagrad():
    opt = build_optimizer({"type": "Adagrad", "params": {"lr": 0.1, "maximize": True}}, _params())
    assert type(opt) is torch.optim.Adagrad and opt.defaults["maximize"] is True


def test_adam_hyperparameters_are_passed():
    config = {"type": "Adam", "params": {"lr": 1e-3, "betas": [0.8, 0.95], "eps": 1e-6, "weight_decay": 0.1,
                                         "bias_correction": True, "set_grad_none": False}}
    opt = build_optimizer(config, _params())
    assert _defaults(opt, "lr", "betas", "eps", "weight_decay") == dict(lr=1e-3, betas=(0.8, 0.95), eps=1e-6,
                                                                       weight_decay=0.1)


def test_torch_adam_accepts_torch_only_arguments():
    opt = build_optimizer({"type": "Adam", "params": {"torch_adam": True, "foreach": False, "amsgrad": True}},
                          _params())
    assert opt.defaults["foreach"] is False and opt.defaults["amsgrad"] is True


@pytest.mark.parametrize(
    "type_name, params, cls, expected",
    [
        ("SGD", {"lr": 0.1, "momentum": 0.9, "nesterov": True}, torch.optim.SGD,
         dict(lr=0.1, momentum=0.9, nesterov=True)),
        ("sgd", {"lr": 0.2}, torch.optim.SGD, dict(lr=0.2, momentum=0)),
        ("Adagrad", {"lr": 0.05, "eps": 1e-9}, FusedAdagrad, dict(lr=0.05, eps=1e-9)),
        ("ADAGRAD", {"lr_decay": 0.1, "initial_accumulator_value": 0.5}, FusedAdagrad,
         dict(lr=0.01, lr_decay=0.1, initial_accumulator_value=0.5)),
        ("RMSprop", {"lr": 1e-3, "alpha": 0.9}, torch.optim.RMSprop, dict(lr=1e-3, alpha=0.9)),
        ("Lamb", {"lr": 2e-3, "max_coeff": 5.0, "min_coeff": 0.1, "weight_decay": 0.01}, Lamb,
         dict(lr=2e-3, max_coeff=5.0, min_coeff=0.1, weight_decay=0.01, bias_correction=True, betas=(0.9, 0.999))),
        ("LAMB", {"bias_correction": False, "eps_inside_sqrt": True}, Lamb,
         dict(lr=1e-3, max_coeff=10.0, min_coeff=0.01, bias_correction=False, eps=1e-8)),
        ("Lion", {"lr": 1e-4, "weight_decay": 0.1}, Lion, dict(lr=1e-4, weight_decay=0.1, betas=(0.9, 0.999))),
        ("lion", {"betas": [0.95, 0.98], "set_grad_none": True}, Lion, dict(lr=1e-3, betas=(0.95, 0.98))),
    ],
)
def test_types_build_the_right_class(type_name, params, cls, expected):
    opt = build_optimizer({"type": type_name, "params": params}, _params())
    assert type(opt) is cls
    assert _defaults(opt, *expected) == expected


def test_lamb_eps_inside_sqrt_reaches_the_optimizer():
    assert build_optimizer({"type": "lamb", "params": {"eps_inside_sqrt": True}}, _params()).eps_inside_sqrt


def test_attribute_config_generator_params_and_none_params():
    model = torch.nn.Linear(4, 3)
    opt = build_optimizer(SimpleNamespace(type="AdamW", params=None), model.parameters())
    assert type(opt) is FusedAdam and len(opt.param_groups[0]["params"]) == 2


def test_param_groups_are_honoured():
    p = _params()
    groups = [{"params": p[:2], "weight_decay": 0.0}, {"params": p[2:], "lr": 0.5}]
    for type_name in ["Adam", "Lamb", "Lion", "SGD", "Adagrad"]:
        opt = build_optimizer({"type": type_name, "params": {"lr": 0.01, "weight_decay": 0.1}}, groups)
        g0, g1 = opt.param_groups
        assert g0["params"] == p[:2] and g1["params"] == p[2:]
        assert (g0["lr"], g0["weight_decay"]) == (0.01, 0.0)
        assert (g1["lr"], g1["weight_decay"]) == (0.5, 0.1)


# ---- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config, message",
    [
        ({"type": "Adamm"}, 'optimizer.type: unknown optimizer "Adamm"; did you mean "Adam"?'),
        ({"type": "Optimizer"}, "optimizer.type: unknown optimizer"),
        ({"type": ""}, "optimizer.type: must be a non-empty string"),
        ({"params": {}}, "optimizer.type: must be a non-empty string"),
        ({"type": "Adam", "params": "lr=1"}, "optimizer.params: must be an object"),
        ({"type": "Adam", "params": {"lrr": 1e-3}}, 'optimizer.params.lrr: unknown key; did you mean "lr"?'),
        ({"type": "Adam", "params": {"lr": "1e-3"}}, "optimizer.params.lr: must be a number >= 0"),
        ({"type": "Adam", "params": {"lr": -1.0}}, "optimizer.params.lr: must be a number >= 0 (got -1.0)"),
        ({"type": "Adam", "params": {"betas": [0.9]}}, "optimizer.params.betas: must be a list of two numbers"),
        ({"type": "Adam", "params": {"betas": [0.9, 1.0]}}, "optimizer.params.betas"),
        ({"type": "Adam", "params": {"torch_adam": "yes"}}, "optimizer.params.torch_adam: must be true or false"),
        ({"type": "Adam", "params": {"adam_w_mode": 1}}, "optimizer.params.adam_w_mode: must be true or false"),
        ({"type": "Adam", "params": {"max_grad_norm": 1.0}}, "optimizer.params.max_grad_norm"),
        ({"type": "Lamb", "params": {"max_grad_norm": 1.0}}, "gradient_clipping"),
        ({"type": "Adam", "params": {"amsgrad": True}}, "optimizer.params.amsgrad"),
        ({"type": "Adam", "params": {"torch_adam": True, "bias_correction": True}},
         "optimizer.params.bias_correction: unknown key"),
        ({"type": "Lamb", "params": {"momentum": 0.9}}, "optimizer.params.momentum: unknown key"),
        ({"type": "Lamb", "params": {"amsgrad": True}}, "optimizer.params.amsgrad"),
        ({"type": "Lamb", "params": {"min_coeff": 2.0, "max_coeff": 1.0}}, "optimizer.params"),
        ({"type": "Lion", "params": {"eps": 1e-8}}, "optimizer.params.eps: unknown key"),
        ({"type": "SGD", "params": {"lr": 0.1, "momentun": 0.9}},
         'optimizer.params.momentun: unknown key; did you mean "momentum"?'),
        ({"type": "SGD", "params": {"lr": 0.1, "nesterov": "true"}},
         "optimizer.params.nesterov: must be true or false"),
        ({"type": "Adagrad", "params": {"betas": [0.9, 0.99]}}, "optimizer.params.betas: unknown key"),
    ],
)
def test_bad_configs_raise_config_error(config, message):
    with pytest.raises(ConfigError) as info:
        build_optimizer(config, _params())
    assert message in str(info.value)


def test_several_problems_reported_together():
    with pytest.raises(ConfigError) as info:
        build_optimizer({"type": "Adam", "params": {"lr": "x", "eps": -1, "foo": 1}}, _params())
    assert len(info.value.problems) == 3


@pytest.mark.parametrize("type_name", ["OneBitAdam", "ZeroOneAdam", "OneBitLamb", "onebitadam"])
def test_one_bit_optimizers_need_the_communicator(type_name):
    with pytest.raises(ConfigError, match="optimizer.type: .* needs the data-parallel communicator"):
        build_optimizer({"type": type_name, "params": {"lr": 1e-3}}, _params())


@pytest.mark.parametrize("type_name,cls", [("OneBitAdam", "OneBitAdam"), ("zerooneadam", "ZeroOneAdam"),
                                           ("ONEBITLAMB", "OneBitLamb")])
def test_one_bit_optimizers_are_built_with_deepspeed_params(type_name, cls):
    from lightspeed.comm.collectives import Communicator

    params = {"lr": 2e-3, "weight_decay": 0.01, "cuda_aware": False}
    extra = {"OneBitAdam": {"freeze_step": 7}, "ZeroOneAdam": {"var_freeze_step": 9, "local_step_clipper": 4},
             "OneBitLamb": {"freeze_step": 5, "coeff_beta": 0.8, "factor_max": 3.0}}[cls]
    opt = build_optimizer({"type": type_name, "params": {**params, **extra}}, _params(), comm=Communicator())
    assert type(opt).__name__ == cls and opt.param_groups[0]["lr"] == 2e-3
    for key, value in extra.items():
        assert getattr(opt, key) == value


def test_one_bit_optimizer_params_are_checked():
    from lightspeed.comm.collectives import Communicator

    with pytest.raises(ConfigError, match="optimizer.params.freeze_stepp"):
        build_optimizer({"type": "OneBitAdam", "params": {"freeze_stepp": 3}}, _params(), comm=Communicator())
    with pytest.raises(ConfigError, match="optimizer.params.local_step_clipper"):
        build_optimizer({"type": "ZeroOneAdam", "params": {"local_step_clipper": 0}}, _params(), comm=Communicator())
    with pytest.raises(NotImplementedError, match="comm_backend_name: .*MPI"):
        build_optimizer({"type": "OneBitLamb", "params": {"comm_backend_name": "mpi"}}, _params(),
                        comm=Communicator())
    with pytest.raises(ConfigError, match="comm_backend_name"):
        build_optimizer({"type": "OneBitLamb", "params": {"comm_backend_name": "ucx"}}, _params(),
                        comm=Communicator())


def test_empty_parameter_list():
    with pytest.raises(ValueError):
        build_optimizer({"type": "Adam"}, [])


# ---- Lamb against the FusedLamb formulas ----------------------------------------------------


def reference_lamb(params, grads_per_step, *, lr, betas, eps, weight_decay, bias_correction=True,
                   eps_inside_sqrt=False, max_grad_norm=0.0, max_coeff=10.0, min_coeff=0.01):
    """Per-tensor LAMB as DeepSpeed's fused_lamb kernel computes it; returns params and trust ratios."""
    b1, b2 = betas
    ps = [p.detach().clone() for p in params]
    ms = [torch.zeros_like(p) for p in ps]
    vs = [torch.zeros_like(p) for p in ps]
    coeffs = []
    for t, grads in enumerate(grads_per_step, start=1):
        scale = 1.0
        if max_grad_norm > 0:
            norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads))
            clip = (norm + 1e-6) / max_grad_norm
            scale = clip if clip > 1 else 1.0
        coeffs = []
        for i, g in enumerate(grads):
            g = g / scale
            ms[i] = b1 * ms[i] + (1 - b1) * g
            vs[i] = b2 * vs[i] + (1 - b2) * g * g
            c1 = 1 - b1**t if bias_correction else 1.0
            c2 = 1 - b2**t if bias_correction else 1.0
            m_hat, v_hat = ms[i] / c1, vs[i] / c2
            denom = torch.sqrt(v_hat + eps) if eps_inside_sqrt else torch.sqrt(v_hat) + eps
            update = m_hat / denom + weight_decay * ps[i]
            w_norm, u_norm = float(ps[i].norm()), float(update.norm())
            coeff = 1.0
            if w_norm != 0 and u_norm != 0:
                coeff = min(max(w_norm / u_norm, min_coeff), max_coeff)
            ps[i] = ps[i] - lr * coeff * update
            coeffs.append(coeff)
    return ps, coeffs


def _run_steps(opt, params, num_steps, shapes=SHAPES):
    for step in range(num_steps):
        for p, g in zip(params, _grads(step, shapes)):
            p.grad = g.clone()
        opt.step()


LAMB_CASES = [
    dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0),
    dict(lr=5e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.01),
    dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, bias_correction=False),
    dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-4, weight_decay=0.0, eps_inside_sqrt=True),
    dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, max_coeff=0.5, min_coeff=0.4),  # clamps
    dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, max_grad_norm=0.05),
]


@pytest.mark.parametrize("hyper", LAMB_CASES)
def test_lamb_matches_reference(hyper):
    params = _params()
    expected, expected_coeffs = reference_lamb(params, [_grads(s) for s in range(4)], **hyper)
    opt = Lamb(params, **hyper)
    _run_steps(opt, params, 4)
    for got, want in zip(params, expected):
        torch.testing.assert_close(got.detach(), want, atol=ATOL, rtol=RTOL)
    assert opt.get_lamb_coeffs() == pytest.approx(expected_coeffs, rel=1e-5)
    assert opt.state[params[0]]["step"] == 4


def test_lamb_built_from_config_matches_reference():
    params = _params(seed=3)
    hyper = dict(lr=2e-3, betas=(0.9, 0.98), eps=1e-7, weight_decay=0.05)
    expected, _ = reference_lamb(params, [_grads(s) for s in range(3)], **hyper)
    opt = build_optimizer({"type": "LAMB", "params": {**hyper, "betas": list(hyper["betas"])}}, params)
    _run_steps(opt, params, 3)
    for got, want in zip(params, expected):
        torch.testing.assert_close(got.detach(), want, atol=ATOL, rtol=RTOL)


def test_lamb_zero_weights_use_coefficient_one():
    p = torch.nn.Parameter(torch.zeros(5))
    opt = Lamb([p], lr=0.1)
    p.grad = torch.ones(5)
    opt.step()
    assert opt.get_lamb_coeffs() == [1.0]
    torch.testing.assert_close(p.detach(), torch.full((5,), -0.1), atol=1e-6, rtol=0)


def test_lamb_rejects_amsgrad():
    with pytest.raises(RuntimeError):
        Lamb(_params(), amsgrad=True)


# ---- Lion against the FusedLion formulas ----------------------------------------------------


def reference_lion(params, grads_per_step, *, lr, betas=(0.9, 0.999), weight_decay=0.0):
    """FusedLion's kernel: c = b1*m + (1-b1)*g; p = p*(1 - lr*wd) + (-lr if c > 0 else lr); m = b2*m + (1-b2)*g."""
    b1, b2 = betas
    ps = [p.detach().clone() for p in params]
    ms = [torch.zeros_like(p) for p in ps]
    for grads in grads_per_step:
        for i, g in enumerate(grads):
            c = b1 * ms[i] + (1 - b1) * g
            step = torch.where(c > 0, torch.full_like(c, -lr), torch.full_like(c, lr))
            ps[i] = ps[i] * (1 - lr * weight_decay) + step
            ms[i] = b2 * ms[i] + (1 - b2) * g
    return ps


@pytest.mark.parametrize(
    "hyper",
    [dict(lr=1e-3), dict(lr=3e-4, betas=(0.95, 0.98), weight_decay=0.1), dict(lr=1e-2, weight_decay=1.0)],
)
def test_lion_matches_reference(hyper):
    params = _params(seed=1)
    expected = reference_lion(params, [_grads(s) for s in range(5)], **hyper)
    opt = Lion(params, **hyper)
    _run_steps(opt, params, 5)
    for got, want in zip(params, expected):
        torch.testing.assert_close(got.detach(), want, atol=ATOL, rtol=RTOL)


def test_lion_built_from_config_matches_reference_with_groups():
    params = _params(seed=2)
    groups = [{"params": params[:3]}, {"params": params[3:], "lr": 1e-2, "weight_decay": 0.0}]
    expected = reference_lion(params[:3], [_grads(s)[:3] for s in range(3)], lr=1e-3, weight_decay=0.5)
    expected += reference_lion(params[3:], [_grads(s)[3:] for s in range(3)], lr=1e-2, weight_decay=0.0)
    opt = build_optimizer({"type": "Lion", "params": {"lr": 1e-3, "weight_decay": 0.5}}, groups)
    _run_steps(opt, params, 3)
    for got, want in zip(params, expected):
        torch.testing.assert_close(got.detach(), want, atol=ATOL, rtol=RTOL)


def test_lion_zero_update_direction_steps_up_like_the_kernel():
    p = torch.nn.Parameter(torch.ones(3))
    opt = Lion([p], lr=0.1)
    p.grad = torch.tensor([1.0, 0.0, -1.0])
    opt.step()
    torch.testing.assert_close(p.detach(), torch.tensor([0.9, 1.1, 1.1]))


def test_lion_state_dict_round_trip():
    params_a, params_b = _params(seed=4), _params(seed=4)
    opt_a = Lion(params_a, lr=1e-3, weight_decay=0.1)
    _run_steps(opt_a, params_a, 2)
    opt_b = Lion(params_b, lr=1e-3, weight_decay=0.1)
    with torch.no_grad():
        for a, b in zip(params_a, params_b):
            b.copy_(a)
    opt_b.load_state_dict(opt_a.state_dict())
    for step in range(2, 4):
        for pa, pb, g in zip(params_a, params_b, _grads(step)):
            pa.grad, pb.grad = g.clone(), g.clone()
        opt_a.step()
        opt_b.step()
    for a, b in zip(params_a, params_b):
        assert torch.equal(a, b)
