"""Config values DeepSpeed accepts and lightspeed used to refuse, each read as DeepSpeed reads it:
`optimizer.params.torch_adam`, `eigenvalue.model_name` (in DeepSpeed's own example config),
`fp16.loss_scale` written as a numeric string, `zero_allow_untested_optimizer: 1`, and OneCycle with
`cycle_second_step_size` 0 (a cycle that only rises). What stays refused is refused with the key named."""

import pytest
import torch

import lightspeed
from lightspeed import config
from lightspeed.config.errors import ConfigError
from lightspeed.optim.schedules import OneCycle
from lightspeed.testing.models import TinyMLP

pytestmark = pytest.mark.timeout(120)


def _load(**extra):
    return config.load({"train_batch_size": 1, **extra})


def test_torch_adam_builds_torchs_adam():
    for kind, adam_w_mode, expected in (("Adam", True, torch.optim.AdamW), ("Adam", False, torch.optim.Adam),
                                        ("AdamW", True, torch.optim.AdamW)):
        params = {"lr": 0.1, "torch_adam": True, "adam_w_mode": adam_w_mode}
        engine, *_ = lightspeed.initialize(model=TinyMLP(), dist_init_required=False, config={
            "train_batch_size": 1, "optimizer": {"type": kind, "params": params}})
        assert type(engine.optimizer) is expected, (kind, adam_w_mode)


def test_eigenvalue_model_name_is_accepted():
    assert _load(eigenvalue={"enabled": False, "model_name": "bert"}).eigenvalue.model_name == "bert"
    with pytest.raises(ConfigError, match="eigenvalue.model_name: must be a string"):
        _load(eigenvalue={"model_name": 3})


def test_loss_scale_as_a_numeric_string():
    assert _load(fp16={"enabled": True, "loss_scale": "3"}).fp16.loss_scale == 3.0
    assert _load(fp16={"enabled": True, "loss_scale": "0"}).fp16.dynamic
    for bad in ("big", "-1", "inf", "nan", True):
        with pytest.raises(ConfigError, match="fp16.loss_scale: must be a number >= 0"):
            _load(fp16={"enabled": True, "loss_scale": bad})
    with pytest.raises(ConfigError, match="fp16.loss_scale_window: must be an integer"):
        _load(fp16={"loss_scale_window": "1000"})  # only loss_scale reads strings, as DeepSpeed's float() of it


def test_zero_allow_untested_optimizer_as_an_integer():
    assert _load(zero_allow_untested_optimizer=1).zero_allow_untested_optimizer is True
    assert _load(zero_allow_untested_optimizer=0).zero_allow_untested_optimizer is False
    for bad in (2, "1", None):
        with pytest.raises(ConfigError, match=r"zero_allow_untested_optimizer: must be true or false \(or 1 or 0\)"):
            _load(zero_allow_untested_optimizer=bad)


def test_one_cycle_without_a_falling_half():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = OneCycle(opt, cycle_min_lr=0.2, cycle_max_lr=1.0, cycle_first_step_size=4, cycle_second_step_size=0,
                     decay_lr_rate=1.0, decay_step_size=1, cycle_momentum=False)
    lrs = []
    for _ in range(7):
        lrs.append(opt.param_groups[0]["lr"])
        sched.step()
    # rises over 4 steps (DeepSpeed's formula with a step ratio of 1), then decays from the minimum
    assert lrs[:4] == pytest.approx([0.2, 0.4, 0.6, 0.8])
    assert lrs[4:] == pytest.approx([0.2, 0.2 / 2, 0.2 / 3])
    # and through a config
    engine, *_ = lightspeed.initialize(model=TinyMLP(), dist_init_required=False, config={
        "train_batch_size": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0.1, "cycle_max_lr": 0.5,
                                                     "cycle_first_step_size": 2, "cycle_second_step_size": 0}}})
    assert engine.lr_scheduler.total_size == 2
    with pytest.raises(ConfigError, match="scheduler.params.cycle_second_step_size: must be an integer >= 0"):
        lightspeed.initialize(model=TinyMLP(), dist_init_required=False, config={
            "train_batch_size": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0.1, "cycle_max_lr": 0.5,
                                                         "cycle_second_step_size": -1}}})
