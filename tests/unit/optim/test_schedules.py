"""LR schedules against closed-form formulas written out here, independently of the implementation."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from lightspeed import ConfigError
from lightspeed.optim import LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR, build_scheduler

NUM_STEPS = 2000


def _adam(num_groups: int = 1, lr: float = 0.1) -> torch.optim.Optimizer:
    torch.manual_seed(0)
    groups = [{"params": [torch.nn.Parameter(torch.randn(3))]} for _ in range(num_groups)]
    return torch.optim.Adam(groups, lr=lr)


def _lrs(optimizer) -> list[float]:
    return [float(g["lr"]) for g in optimizer.param_groups]


def _close(a, b) -> bool:
    return math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-15)


# ---- closed forms (n = last_batch_iteration, W = max(2, warmup_num_steps)) -------------------


def warmup_progress(n, warmup_num_steps, warmup_type):
    w = max(2, warmup_num_steps)
    return math.log(n + 1) / math.log(w) if warmup_type == "log" else n / w


def ref_warmup(n, lo, hi, warmup_num_steps, warmup_type):
    w = max(2, warmup_num_steps)
    if n < 0:
        return lo
    gamma = warmup_progress(n, warmup_num_steps, warmup_type) if n < w else 1.0
    return lo + (hi - lo) * gamma


def ref_warmup_decay(n, lo, hi, warmup_num_steps, warmup_type, total):
    w = max(2, warmup_num_steps)
    if n < 0:
        return lo
    if n < w:
        gamma = warmup_progress(n, warmup_num_steps, warmup_type)
    else:
        gamma = max(0.0, (total - n) / max(1, total - w))
    return lo + (hi - lo) * gamma


def ref_cosine(n, base_lr, total, warmup_min_ratio, warmup_num_steps, cos_min_ratio, warmup_type):
    w = max(2, warmup_num_steps)
    if n < 0:
        return 0.0
    if n < w:
        ratio = warmup_min_ratio + (1 - warmup_min_ratio) * warmup_progress(n, warmup_num_steps, warmup_type)
    else:
        progress = min(1.0, (n - w + 1) / max(1, total - w))
        ratio = max(0.0, cos_min_ratio + (1 - cos_min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
    return base_lr * ratio


def ref_range_test(n, min_lr, step_size, step_rate, staircase):
    x = (n + 1) / step_size
    return min_lr * (1 + step_rate * (math.floor(x) if staircase else x))


def ref_one_cycle_scale(n, first, second, first_stairs, second_stairs):
    """Fraction of the way from the cycle's low end to its high end after batch n (n < first + second)."""
    total = first + second
    k = n + 1  # batches seen
    rising = k <= first or k == total
    frac = k / first if k <= first else (total - k) / second
    stairs = first_stairs if rising else second_stairs
    if stairs > 0:
        position = k * stairs / first if k <= first else (total - k) * stairs / second
        frac = math.floor(position) / stairs
    return frac


def ref_one_cycle(n, p):
    first = p["cycle_first_step_size"]
    second = p.get("cycle_second_step_size") or first
    total = first + second
    if n < 0:
        return p["cycle_min_lr"], p["cycle_min_mom"]
    if n < total:
        s = ref_one_cycle_scale(n, first, second, p.get("cycle_first_stair_count", 0),
                                p.get("cycle_second_stair_count", p.get("cycle_first_stair_count", 0)))
        lr = p["cycle_min_lr"] + (p["cycle_max_lr"] - p["cycle_min_lr"]) * s
        mom = p["cycle_max_mom"] - (p["cycle_max_mom"] - p["cycle_min_mom"]) * s
        return lr, mom
    decay_step_size = p.get("decay_step_size", 0)
    i = (n - total + 1) / decay_step_size if decay_step_size else 0.0
    lr_rate, mom_rate = p.get("decay_lr_rate", 0.0), p.get("decay_mom_rate", 0.0)
    lr = p["cycle_min_lr"] / (1 + lr_rate * i) if decay_step_size and lr_rate else p["cycle_min_lr"]
    mom = p["cycle_max_mom"] * (1 + mom_rate * i) if decay_step_size and mom_rate else p["cycle_max_mom"]
    return lr, mom


def _run(scheduler, optimizer, reference, num_steps=NUM_STEPS):
    for n in range(num_steps):
        scheduler.step()
        assert scheduler.last_batch_iteration == n
        expected = reference(n)
        for got, want in zip(_lrs(optimizer), expected):
            assert _close(got, want), (n, got, want)
        assert [float(x) for x in scheduler.get_last_lr()] == _lrs(optimizer)


# ---- WarmupLR / WarmupDecayLR / WarmupCosineLR -----------------------------------------------


@pytest.mark.parametrize("warmup_type", ["log", "linear"])
@pytest.mark.parametrize("warmup_num_steps", [1, 2, 7, 100])
def test_warmup_lr_matches_closed_form(warmup_type, warmup_num_steps):
    opt = _adam(num_groups=2)
    sched = WarmupLR(opt, warmup_min_lr=[1e-5, 0.0], warmup_max_lr=[3e-3, 1e-2],
                     warmup_num_steps=warmup_num_steps, warmup_type=warmup_type)
    assert _lrs(opt) == [1e-5, 0.0]  # construction writes the lr of iteration -1
    _run(sched, opt, lambda n: [ref_warmup(n, 1e-5, 3e-3, warmup_num_steps, warmup_type),
                                ref_warmup(n, 0.0, 1e-2, warmup_num_steps, warmup_type)])


def test_warmup_lr_defaults_to_optimizer_lr_as_max():
    opt = _adam(lr=0.05)
    sched = WarmupLR(opt)
    assert sched.max_lrs == [0.05] and sched.min_lrs == [0.0] and sched.warmup_num_steps == 1000
    assert sched.warmup_type == "log"


@pytest.mark.parametrize("warmup_type", ["log", "linear"])
@pytest.mark.parametrize("total, warmup", [(1000, 100), (1500, 1), (50, 100), (100, 100)])
def test_warmup_decay_lr_matches_closed_form(warmup_type, total, warmup):
    opt = _adam()
    sched = WarmupDecayLR(opt, total_num_steps=total, warmup_min_lr=1e-4, warmup_max_lr=2e-3,
                          warmup_num_steps=warmup, warmup_type=warmup_type)
    assert isinstance(sched, WarmupLR)
    assert _lrs(opt) == [1e-4]
    _run(sched, opt, lambda n: [ref_warmup_decay(n, 1e-4, 2e-3, warmup, warmup_type, total)])
    assert _close(_lrs(opt)[0], 1e-4)  # decayed to the floor past total_num_steps


@pytest.mark.parametrize("warmup_type", ["log", "linear"])
@pytest.mark.parametrize("total, warmup, wmr, cmr", [(1000, 100, 0.0, 1e-4), (1200, 10, 0.1, 0.05),
                                                     (80, 100, 0.0, 0.01), (500, 1, 0.2, 0.0)])
def test_warmup_cosine_lr_matches_closed_form(warmup_type, total, warmup, wmr, cmr):
    opt = _adam(num_groups=2)
    opt.param_groups[1]["lr"] = 0.3
    sched = WarmupCosineLR(opt, total_num_steps=total, warmup_min_ratio=wmr, warmup_num_steps=warmup,
                           cos_min_ratio=cmr, warmup_type=warmup_type)
    assert _lrs(opt) == [0.0, 0.0]
    _run(sched, opt, lambda n: [ref_cosine(n, base, total, wmr, warmup, cmr, warmup_type) for base in (0.1, 0.3)])
    assert _close(_lrs(opt)[0], 0.1 * cmr)  # held at the floor, no oscillation past the end


def test_unknown_warmup_type_falls_back_to_log_when_constructed_directly():
    sched = WarmupLR(_adam(), warmup_max_lr=1.0, warmup_num_steps=10, warmup_type="cosine")
    assert sched.warmup_type == "log"


# ---- LRRangeTest ------------------------------------------------------------------------------


@pytest.mark.parametrize("staircase", [False, True])
def test_lr_range_test(staircase):
    opt = _adam(num_groups=2)
    sched = LRRangeTest(opt, lr_range_test_min_lr=[1e-4, 2e-4], lr_range_test_step_size=70,
                        lr_range_test_step_rate=0.5, lr_range_test_staircase=staircase)
    assert _lrs(opt) == [1e-4, 2e-4] and sched.get_last_lr() == [1e-4, 2e-4]
    _run(sched, opt, lambda n: [ref_range_test(n, m, 70, 0.5, staircase) for m in (1e-4, 2e-4)])


def test_lr_range_test_staircase_is_flat_within_a_stair():
    opt = _adam()
    sched = LRRangeTest(opt, lr_range_test_min_lr=1e-3, lr_range_test_step_size=10, lr_range_test_staircase=True)
    seen = []
    for _ in range(30):
        sched.step()
        seen.append(_lrs(opt)[0])
    assert seen[:9] == [1e-3] * 9 and seen[9:19] == [2e-3] * 10 and seen[19:29] == [3e-3] * 10


# ---- OneCycle ---------------------------------------------------------------------------------

ONE_CYCLE_CASES = [
    dict(cycle_min_lr=1e-4, cycle_max_lr=1e-2, cycle_first_step_size=300),
    dict(cycle_min_lr=1e-4, cycle_max_lr=1e-2, cycle_first_step_size=300, cycle_second_step_size=900,
         decay_step_size=50, decay_lr_rate=0.1, decay_mom_rate=0.01, cycle_min_mom=0.85, cycle_max_mom=0.95),
    dict(cycle_min_lr=0.0, cycle_max_lr=1.0, cycle_first_step_size=100, cycle_second_step_size=250,
         cycle_first_stair_count=4, cycle_second_stair_count=5, decay_step_size=10, decay_lr_rate=0.5),
    dict(cycle_min_lr=1e-3, cycle_max_lr=2e-3, cycle_first_step_size=7, cycle_first_stair_count=3,
         decay_step_size=3, decay_lr_rate=0.0, decay_mom_rate=0.2),
]


@pytest.mark.parametrize("params", ONE_CYCLE_CASES)
def test_one_cycle_lr_and_momentum(params):
    opt = _adam(num_groups=2)
    sched = OneCycle(opt, **params)
    lr0, mom0 = ref_one_cycle(-1, {"cycle_min_mom": 0.8, "cycle_max_mom": 0.9, **params})
    assert _lrs(opt) == [lr0, lr0]
    assert [g["betas"] for g in opt.param_groups] == [(mom0, 0.99)] * 2
    with pytest.raises(RuntimeError, match="step"):
        sched.get_last_lr()  # as in DeepSpeed, OneCycle records no lr at construction
    full = {"cycle_min_mom": 0.8, "cycle_max_mom": 0.9, **params}
    for n in range(NUM_STEPS):
        sched.step()
        lr, mom = ref_one_cycle(n, full)
        for group in opt.param_groups:
            assert _close(group["lr"], lr), (n, group["lr"], lr)
            assert _close(group["betas"][0], mom) and group["betas"][1] == 0.99, (n, group["betas"], mom)


def test_one_cycle_peak_and_stairs_hit_exactly():
    opt = _adam()
    sched = OneCycle(opt, cycle_min_lr=0.0, cycle_max_lr=1.0, cycle_first_step_size=10, cycle_second_step_size=30,
                     cycle_first_stair_count=5, cycle_second_stair_count=3)
    lrs = []
    for _ in range(40):
        sched.step()
        lrs.append(_lrs(opt)[0])
    assert lrs[9] == 1.0  # batch 10 of 10 reaches the peak
    assert sorted(set(lrs[:10])) == [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
    assert set(lrs[10:]) <= {0.0, 1 / 3, 2 / 3}


def test_one_cycle_without_betas_disables_momentum():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1, momentum=0.9)
    sched = OneCycle(opt, cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=10)
    assert not sched.cycle_momentum and sched.get_mom() is None
    sched.step()
    assert "betas" not in opt.param_groups[0] and opt.param_groups[0]["momentum"] == 0.9


# ---- stepping contract, state_dict ------------------------------------------------------------

SCHEDULES = [
    (WarmupLR, dict(warmup_min_lr=1e-5, warmup_max_lr=1e-3, warmup_num_steps=100, warmup_type="linear")),
    (WarmupDecayLR, dict(total_num_steps=800, warmup_max_lr=1e-3, warmup_num_steps=100)),
    (WarmupCosineLR, dict(total_num_steps=800, warmup_num_steps=100, warmup_min_ratio=0.1)),
    (LRRangeTest, dict(lr_range_test_step_size=30, lr_range_test_staircase=True)),
    (OneCycle, dict(cycle_min_lr=1e-4, cycle_max_lr=1e-2, cycle_first_step_size=200, decay_step_size=20,
                    decay_lr_rate=0.1)),
]


@pytest.mark.parametrize("cls, params", SCHEDULES, ids=lambda x: getattr(x, "__name__", ""))
def test_state_dict_round_trip_continues_identically(cls, params):
    opt_a = _adam()
    sched_a = cls(opt_a, **params)
    for _ in range(437):
        sched_a.step()
    saved = sched_a.state_dict()
    assert saved == {"last_batch_iteration": 436}

    opt_b = _adam()
    sched_b = cls(opt_b, **params)
    sched_b.load_state_dict(saved)
    for _ in range(700):
        sched_a.step()
        sched_b.step()
        assert opt_a.param_groups[0]["lr"] == opt_b.param_groups[0]["lr"]
        assert opt_a.param_groups[0]["betas"] == opt_b.param_groups[0]["betas"]


@pytest.mark.parametrize("cls, params", SCHEDULES, ids=lambda x: getattr(x, "__name__", ""))
def test_step_with_explicit_iteration_and_resume_argument(cls, params):
    opt_a, opt_b = _adam(), _adam()
    sched_a = cls(opt_a, **params)
    for _ in range(301):
        sched_a.step()
    sched_b = cls(opt_b, **params, last_batch_iteration=250)
    assert opt_b.param_groups[0]["lr"] == 0.1  # resuming leaves the lr alone until step()
    sched_b.step(300)
    assert opt_a.param_groups[0]["lr"] == opt_b.param_groups[0]["lr"]
    sched_b.step()
    sched_a.step()
    assert sched_b.last_batch_iteration == 301 and opt_a.param_groups[0]["lr"] == opt_b.param_groups[0]["lr"]


def test_tensor_lr_stays_a_tensor():
    param = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.Adam([param], lr=torch.tensor(0.01))
    sched = WarmupLR(opt, warmup_max_lr=0.01, warmup_num_steps=10, warmup_type="linear")
    sched.step(5)
    assert torch.is_tensor(opt.param_groups[0]["lr"]) and float(opt.param_groups[0]["lr"]) == pytest.approx(0.005)


def test_wrapped_optimizer_is_unwrapped():
    opt = _adam()
    sched = WarmupLR(SimpleNamespace(optimizer=opt), warmup_max_lr=1.0, warmup_num_steps=10)
    assert sched.optimizer is opt
    with pytest.raises(TypeError):
        WarmupLR(object())


def test_direct_construction_rejects_negative_warmup_and_wrong_group_count():
    with pytest.raises(ValueError):
        WarmupLR(_adam(), warmup_num_steps=-1)
    with pytest.raises(ValueError, match="expected 1"):
        WarmupLR(_adam(), warmup_min_lr=[0.0, 0.1])


# ---- build_scheduler --------------------------------------------------------------------------


@pytest.mark.parametrize("cls, params", SCHEDULES, ids=lambda x: getattr(x, "__name__", ""))
def test_build_scheduler_builds_deepspeed_schedules(cls, params):
    opt_a, opt_b = _adam(), _adam()
    built = build_scheduler({"type": cls.__name__, "params": params}, opt_a)
    direct = cls(opt_b, **params)
    assert type(built) is cls
    for _ in range(300):
        built.step()
        direct.step()
        assert opt_a.param_groups[0]["lr"] == opt_b.param_groups[0]["lr"]


def test_build_scheduler_accepts_attribute_config_and_missing_params():
    opt = _adam(lr=0.02)
    sched = build_scheduler(SimpleNamespace(type="WarmupLR", params=None), opt)
    assert isinstance(sched, WarmupLR) and sched.max_lrs == [0.02]


def test_build_scheduler_torch_fallback():
    opt = _adam()
    sched = build_scheduler({"type": "StepLR", "params": {"step_size": 3, "gamma": 0.5}}, opt)
    assert isinstance(sched, torch.optim.lr_scheduler.StepLR)
    for _ in range(3):
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)


@pytest.mark.parametrize(
    "config, message",
    [
        ({"type": "WarmupLR", "params": {"warmup_num_steps": -5}},
         "scheduler.params.warmup_num_steps: must be a positive integer (got -5)"),
        ({"type": "WarmupLR", "params": {"warmup_max_lrr": 0.1}},
         'scheduler.params.warmup_max_lrr: unknown key; did you mean "warmup_max_lr"?'),
        ({"type": "WarmupLR", "params": {"warmup_type": "cosine"}}, "scheduler.params.warmup_type"),
        ({"type": "WarmupLR", "params": {"warmup_min_lr": "0"}}, "scheduler.params.warmup_min_lr"),
        ({"type": "WarmupLR", "params": {"warmup_min_lr": [0.0, 0.1]}},
         "scheduler.params.warmup_min_lr: must have one value per param group (1)"),
        ({"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}},
         "scheduler.params.total_num_steps: is required"),
        ({"type": "WarmupCosineLR", "params": {"total_num_steps": 1.5}}, "scheduler.params.total_num_steps"),
        ({"type": "OneCycle", "params": {"cycle_min_lr": 0.1}}, "scheduler.params.cycle_max_lr: is required"),
        ({"type": "OneCycle", "params": {"cycle_min_lr": 0.1, "cycle_max_lr": 1, "cycle_momentum": 1}},
         "scheduler.params.cycle_momentum: must be true or false"),
        ({"type": "LRRangeTest", "params": {"lr_range_test_step_size": 0}}, "scheduler.params.lr_range_test_step_size"),
        ({"type": "WarmupLr"}, 'scheduler.type: unknown scheduler "WarmupLr"; did you mean "WarmupLR"?'),
        ({"type": "NoSuchSchedule"}, 'scheduler.type: unknown scheduler "NoSuchSchedule"'),
        ({"type": "LRScheduler"}, "scheduler.type: unknown scheduler"),
        ({"type": 3}, "scheduler.type: must be a non-empty string"),
        ({"type": "WarmupLR", "params": [1]}, "scheduler.params: must be an object"),
        ({"type": "StepLR", "params": {"step_size": 3, "gama": 0.5}},
         'scheduler.params.gama: unknown key; did you mean "gamma"?'),
        ({"type": "StepLR", "params": {}}, "scheduler.params.step_size: is required"),
    ],
)
def test_build_scheduler_errors(config, message):
    with pytest.raises(ConfigError) as info:
        build_scheduler(config, _adam())
    assert message in str(info.value)


def test_build_scheduler_reports_every_problem_at_once():
    with pytest.raises(ConfigError) as info:
        build_scheduler({"type": "WarmupDecayLR", "params": {"warmup_num_steps": -5, "warmup_max_lrr": 1}}, _adam())
    assert len(info.value.problems) == 3


# ---- per-group values, tensor lrs, step sizes (DeepSpeed's rules; module Note [per-group values]) ----


def test_warmup_lr_without_max_warms_each_group_up_to_its_own_lr():
    opt = _adam(num_groups=2)
    opt.param_groups[1]["lr"] = 0.2
    sched = WarmupLR(opt, warmup_num_steps=4, warmup_type="linear")
    assert sched.max_lrs == [0.1, 0.2]
    for _ in range(10):
        sched.step()
    assert _lrs(opt) == [0.1, 0.2]


def test_one_cycle_takes_one_lr_and_momentum_per_group():
    opt = _adam(num_groups=2)
    sched = OneCycle(opt, cycle_min_lr=[0.01, 0.02], cycle_max_lr=[0.1, 0.4], cycle_first_step_size=4,
                     cycle_min_mom=[0.8, 0.85], cycle_max_mom=[0.9, 0.95])
    assert _lrs(opt) == [0.01, 0.02] and [g["betas"] for g in opt.param_groups] == [(0.8, 0.99), (0.85, 0.99)]
    for _ in range(4):
        sched.step()  # batch 4 of a 4 + 4 cycle: the peak
    assert _lrs(opt) == pytest.approx([0.1, 0.4])
    assert [g["betas"][0] for g in opt.param_groups] == pytest.approx([0.8, 0.85])
    with pytest.raises(ValueError, match="cycle_max_lr: expected 2 values"):
        OneCycle(_adam(num_groups=2), cycle_min_lr=0.01, cycle_max_lr=[0.1, 0.2, 0.3])


def test_a_tensor_lr_is_written_in_place():
    opt = _adam(num_groups=2)
    held = [torch.tensor(0.1), torch.tensor(0.1)]
    for group, lr in zip(opt.param_groups, held):
        group["lr"] = lr
    sched = WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=[1.0, 2.0], warmup_num_steps=4, warmup_type="linear")
    for _ in range(2):
        sched.step()
    assert all(g["lr"] is t for g, t in zip(opt.param_groups, held))  # the same tensors, new values
    assert [float(t) for t in held] == pytest.approx([0.25, 0.5])
    OneCycle(opt, cycle_min_lr=0.003, cycle_max_lr=0.01)
    assert opt.param_groups[0]["lr"] is held[0] and float(held[0]) == pytest.approx(0.003)


@pytest.mark.parametrize("build, message", [
    (lambda opt: WarmupLR(opt, warmup_num_steps=0), "warmup_num_steps must be a positive integer, got 0"),
    (lambda opt: WarmupDecayLR(opt, total_num_steps=10, warmup_num_steps=-3), "warmup_num_steps must be a positive"),
    (lambda opt: WarmupCosineLR(opt, total_num_steps=10, warmup_num_steps=0), "warmup_num_steps must be a positive"),
    (lambda opt: LRRangeTest(opt, lr_range_test_step_size=0), "lr_range_test_step_size must be an integer >= 1, got 0"),
    (lambda opt: OneCycle(opt, 0.01, 0.1, cycle_first_step_size=0), "cycle_first_step_size must be an integer >= 1"),
    (lambda opt: OneCycle(opt, 0.01, 0.1, cycle_second_step_size=-1), "cycle_second_step_size must be an integer >= 0"),
    (lambda opt: OneCycle(opt, 0.01, 0.1, decay_step_size=-1), "decay_step_size must be an integer >= 0, got -1"),
])
def test_non_positive_step_sizes_raise_value_error(build, message):
    with pytest.raises(ValueError, match=message):
        build(_adam())
