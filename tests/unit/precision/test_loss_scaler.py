"""Loss scalers against hand-written step tables (DeepSpeed's DynamicLossScaler.update_scale)."""

import io
import logging
from types import SimpleNamespace

import pytest
import torch

from lightspeed.config.errors import ConfigError
from lightspeed.precision.loss_scaler import (
    DynamicLossScaler,
    MinLossScaleError,
    StaticLossScaler,
    build_loss_scaler,
)

T, F = True, False


def run(scaler, flags):
    """Feed ``flags`` one step at a time; return (scale, hysteresis) after every step."""
    trace = []
    for flag in flags:
        scaler.update_scale(flag)
        trace.append((scaler.loss_scale, scaler.cur_hysteresis))
    return trace


# Flags and the expected (scale, hysteresis) after each step, worked out by hand from DeepSpeed's rule
# with init 1024, window 3, hysteresis 2, min 1. "stable" = cur_iter - last_overflow_iter - 1.
FLAGS = [F, F, F, F, T, T, F, T, F, F, F, F, T, F, T]
EXPECTED_PLAIN = [
    (1024, 2),  # it0 stable 0
    (1024, 2),  # it1 stable 1
    (1024, 2),  # it2 stable 2
    (2048, 2),  # it3 stable 3 = window: grow
    (2048, 1),  # it4 overflow: hysteresis 2 -> 1, scale kept
    (1024, 1),  # it5 overflow with hysteresis 1: halve (hysteresis stays 1)
    (1024, 1),  # it6 good, no refill without consecutive_hysteresis; stable 0
    (512, 1),   # it7 overflow, hysteresis still 1: halve at once
    (512, 1),   # it8 stable 0
    (512, 1),   # it9 stable 1
    (512, 1),   # it10 stable 2
    (1024, 2),  # it11 stable 3: grow and refill hysteresis
    (1024, 1),  # it12 overflow absorbed
    (1024, 1),  # it13 good, no refill
    (512, 1),   # it14 overflow: halve
]
EXPECTED_CONSECUTIVE = [
    (1024, 2),
    (1024, 2),
    (1024, 2),
    (2048, 2),  # it3 grow
    (2048, 1),  # it4 absorbed
    (1024, 1),  # it5 halve
    (1024, 2),  # it6 good step refills hysteresis
    (1024, 1),  # it7 absorbed this time
    (1024, 2),  # it8 refill; stable 0 (last overflow it7)
    (1024, 2),  # it9 stable 1
    (1024, 2),  # it10 stable 2
    (2048, 2),  # it11 stable 3: grow
    (2048, 1),  # it12 absorbed
    (2048, 2),  # it13 refill
    (2048, 1),  # it14 absorbed
]


def make(**kw):
    args = dict(init_scale=1024, scale_window=3, delayed_shift=2, min_scale=1)
    args.update(kw)
    return DynamicLossScaler(**args)


def test_hysteresis_two_without_consecutive():
    s = make(consecutive_hysteresis=False)
    assert run(s, FLAGS) == EXPECTED_PLAIN
    assert s.cur_iter == len(FLAGS)
    assert s.last_overflow_iter == 14


def test_hysteresis_two_with_consecutive():
    s = make(consecutive_hysteresis=True)
    assert run(s, FLAGS) == EXPECTED_CONSECUTIVE
    assert s.last_overflow_iter == 14


def test_tensor_flags_behave_like_bools():
    s = make()
    flags = [torch.tensor(float(f)) for f in FLAGS]
    assert run(s, flags) == EXPECTED_PLAIN


def test_window_growth_timing():
    # DeepSpeed grows on the (window+1)-th good step, then every window steps.
    s = DynamicLossScaler(init_scale=1, scale_window=2, delayed_shift=1)
    assert [sc for sc, _ in run(s, [F] * 7)] == [1, 1, 2, 2, 4, 4, 8]
    s = DynamicLossScaler(init_scale=8, scale_window=5, delayed_shift=1)
    assert [sc for sc, _ in run(s, [F] * 6)] == [8, 8, 8, 8, 8, 16]


def test_growth_counts_from_last_overflow():
    s = DynamicLossScaler(init_scale=64, scale_window=2, delayed_shift=1)
    #           it0 T  it1 F  it2 F  it3 F  it4 F  it5 F
    expected = [32,    32,    32,    64,    64,    128]
    assert [sc for sc, _ in run(s, [T, F, F, F, F, F])] == expected


def test_delayed_shift_one_halves_every_overflow():
    s = DynamicLossScaler(init_scale=64, scale_window=100, delayed_shift=1)
    assert [sc for sc, _ in run(s, [T, T, F, T])] == [32, 16, 16, 8]


def test_min_scale_floor_without_raise():
    s = DynamicLossScaler(init_scale=4, delayed_shift=1, min_scale=1, raise_error_at_min_scale=False)
    assert [sc for sc, _ in run(s, [T, T, T, T])] == [2, 1, 1, 1]
    s = DynamicLossScaler(init_scale=8, delayed_shift=1, min_scale=3, raise_error_at_min_scale=False)
    assert [sc for sc, _ in run(s, [T, T, T])] == [4, 3, 3]
    s = DynamicLossScaler(init_scale=1, delayed_shift=1, min_scale=0.25, raise_error_at_min_scale=False)
    assert [sc for sc, _ in run(s, [T, T, T])] == [0.5, 0.25, 0.25]


def test_min_scale_raises_like_deepspeed():
    s = DynamicLossScaler(init_scale=4, delayed_shift=1, min_scale=1)
    run(s, [T, T])
    assert s.loss_scale == 1
    before = s.state_dict()
    with pytest.raises(MinLossScaleError, match="Current loss scale already at minimum - cannot decrease scale"):
        s.update_scale(True)
    assert s.state_dict() == before  # the failed step changed nothing


def test_min_scale_raise_waits_for_hysteresis():
    # Only an overflow that would cut the scale raises; one that hysteresis absorbs does not.
    s = DynamicLossScaler(init_scale=1, delayed_shift=2, min_scale=1, consecutive_hysteresis=True)
    s.update_scale(True)  # absorbed
    s.update_scale(False)  # refilled
    s.update_scale(True)  # absorbed again
    with pytest.raises(MinLossScaleError):
        s.update_scale(True)


def test_static_scaler():
    s = StaticLossScaler(128)
    assert not s.dynamic and s.loss_scale == 128 and s.cur_scale == 128
    for flag in [T, F, T, torch.tensor(1.0)]:
        s.update_scale(flag)
    assert s.loss_scale == 128 and s.num_overflows == 3
    loss = torch.tensor(1000.0, dtype=torch.float16)
    scaled = s.scale_loss(loss)
    assert scaled.dtype == torch.float32 and scaled.item() == 128000.0  # would be inf in fp16
    one = StaticLossScaler()
    assert one.scale_loss(loss) is loss
    with pytest.raises(ValueError):
        StaticLossScaler(0)


def test_scale_loss_keeps_graph():
    w = torch.tensor(2.0, requires_grad=True)
    s = DynamicLossScaler(init_scale=8)
    s.scale_loss(w * 3).backward()
    assert w.grad.item() == 24.0


def _plain(value):
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return type(value) in (int, float, bool)


@pytest.mark.parametrize("consecutive", [False, True])
def test_state_dict_round_trip(consecutive):
    a = make(consecutive_hysteresis=consecutive)
    run(a, FLAGS[:9])
    sd = a.state_dict()
    assert _plain(sd)
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    b = make(consecutive_hysteresis=consecutive, init_scale=2.0**30, scale_window=3)
    b.load_state_dict(torch.load(buf, weights_only=True))
    assert b.state_dict() == sd
    assert run(b, FLAGS[9:]) == run(a, FLAGS[9:])

    st = StaticLossScaler(64)
    st.update_scale(True)
    st2 = StaticLossScaler(64)
    st2.load_state_dict(st.state_dict())
    assert st2.state_dict() == st.state_dict() and _plain(st.state_dict())


def test_kind_mismatch_keeps_configured_scaler():
    d = make()
    d.load_state_dict(StaticLossScaler(4).state_dict())
    assert d.loss_scale == 1024 and d.dynamic


def test_constructor_validation():
    for bad in (dict(scale_window=0), dict(delayed_shift=0), dict(min_scale=0), dict(init_scale=float("inf")),
                dict(scale_factor=1.0)):
        with pytest.raises(ValueError):
            make(**bad)


def test_build_from_dict_and_object():
    s = build_loss_scaler({"enabled": True})
    assert isinstance(s, DynamicLossScaler)
    assert (s.loss_scale, s.scale_window, s.delayed_shift, s.min_scale) == (2**16, 1000, 2, 1)
    assert s.consecutive_hysteresis is False and s.raise_error_at_min_scale is True
    cfg = SimpleNamespace(enabled=True, loss_scale=0, initial_scale_power=8, loss_scale_window=50, hysteresis=4,
                          consecutive_hysteresis=True, min_loss_scale=0.5)
    s = build_loss_scaler(cfg, raise_error_at_min_scale=False)
    assert (s.loss_scale, s.scale_window, s.delayed_shift, s.min_scale) == (256, 50, 4, 0.5)
    assert s.consecutive_hysteresis and not s.raise_error_at_min_scale
    st = build_loss_scaler({"enabled": True, "loss_scale": 128.0})
    assert isinstance(st, StaticLossScaler) and st.loss_scale == 128
    off = build_loss_scaler(SimpleNamespace(enabled=False, loss_scale=0))
    assert isinstance(off, StaticLossScaler) and off.loss_scale == 1.0
    assert build_loss_scaler(None).loss_scale == 1.0


def test_build_rejects_bad_values():
    with pytest.raises(ConfigError, match=r"fp16.hysteresis"):
        build_loss_scaler({"enabled": True, "hysteresis": 0})
    with pytest.raises(ConfigError, match=r"fp16.loss_scale"):
        build_loss_scaler({"enabled": True, "loss_scale": -1})
    with pytest.raises(ConfigError) as info:
        build_loss_scaler({"enabled": True, "loss_scale_window": 0, "min_loss_scale": 0})
    assert len(info.value.problems) == 2


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)


def test_overflow_logging_is_rate_limited():
    logger = logging.getLogger("lightspeed.precision.loss_scaler")
    handler = _Records()
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.DEBUG)
    try:
        s = DynamicLossScaler(init_scale=2.0**20, delayed_shift=1, scale_window=1000)
        run(s, [T] * 10)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    info = [r.getMessage() for r in handler.records if r.levelno == logging.INFO]
    assert len(info) == 4  # overflows 1, 2, 4, 8
    assert info[0].startswith("OVERFLOW! Skipping step. Attempted loss scale: 1048576, reducing to 524288")
    assert all("\n" not in m for m in info)


def test_build_from_real_config_object():
    from lightspeed.config import load

    cfg = load({"train_micro_batch_size_per_gpu": 1,
                "fp16": {"enabled": True, "initial_scale_power": 12, "hysteresis": 3, "min_loss_scale": 2}})
    s = build_loss_scaler(cfg.fp16)
    assert isinstance(s, DynamicLossScaler)
    assert (s.loss_scale, s.delayed_shift, s.cur_hysteresis, s.min_scale) == (4096, 3, 3, 2)
    assert isinstance(build_loss_scaler(load({"train_micro_batch_size_per_gpu": 1}).fp16), StaticLossScaler)
