"""lightspeed's exceptions are also instances of what DeepSpeed raises, with lightspeed's messages:
config problems are ValueErrors, and where DeepSpeed asserts (initialize(model=None), an untested
optimizer under ZeRO, no_sync() misuse, ranks saving different tags) they are AssertionErrors as well;
save_checkpoint with no directory is a ValueError, as in DeepSpeed."""

import pytest
import torch

import lightspeed
from lightspeed.checkpoint.engine_checkpoint import check_save_agreement
from lightspeed.checkpoint.errors import CheckpointAssertionError, CheckpointError
from lightspeed.config.errors import ConfigAssertionError, ConfigError
from lightspeed.runtime.errors import ArgumentAssertionError, UsageAssertionError
from lightspeed.testing.models import TinyMLP, regression_data

pytestmark = pytest.mark.timeout(120)


def _engine(stage: int, optimizer=None, **extra):
    cfg = {"train_batch_size": 2, "steps_per_print": 10**6, "zero_optimization": {"stage": stage}, **extra}
    if optimizer is None:
        cfg["optimizer"] = {"type": "SGD", "params": {"lr": 0.1}}
    model = TinyMLP()
    if callable(optimizer):
        optimizer = optimizer(model)
    engine, *_ = lightspeed.initialize(model=model, optimizer=optimizer, config=cfg, dist_init_required=False)
    return engine


def test_the_types_are_both():
    assert issubclass(ConfigError, ValueError)
    for cls, bases in ((ConfigAssertionError, (ConfigError, ValueError, AssertionError)),
                       (CheckpointAssertionError, (CheckpointError, ValueError, AssertionError)),
                       (UsageAssertionError, (RuntimeError, AssertionError)),
                       (ArgumentAssertionError, (ValueError, AssertionError))):
        assert all(issubclass(cls, b) for b in bases), cls
    err = ConfigAssertionError(["a: wrong", "b: wrong"])
    assert err.problems == ["a: wrong", "b: wrong"] and str(err).startswith("2 problems in the config")


def test_initialize_without_a_model():
    with pytest.raises(AssertionError, match=r"`model` is required") as info:
        lightspeed.initialize(model=None, config={"train_batch_size": 1})
    assert isinstance(info.value, ValueError)


class Untested(torch.optim.Optimizer):
    """An optimizer ZeRO has not been tested with (not elementwise for all it knows)."""

    def __init__(self, params):
        super().__init__(params, {"lr": 0.1})

    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.data.add_(p.grad, alpha=-group["lr"])


@pytest.mark.parametrize("stage", [1, 3])
def test_untested_optimizer_under_zero(stage):
    with pytest.raises(AssertionError, match='"zero_allow_untested_optimizer": true') as info:
        _engine(stage, lambda m: Untested(m.parameters()))
    assert isinstance(info.value, ConfigError)
    engine = _engine(stage, lambda m: Untested(m.parameters()), zero_allow_untested_optimizer=True)
    assert engine.zero_optimization_stage() == stage


def test_no_sync_misuse():
    with pytest.raises(AssertionError, match="incompatible with gradient partitioning logic of ZeRO stage 2") as info:
        with _engine(2).no_sync():
            pass
    assert isinstance(info.value, RuntimeError)
    engine = _engine(0)
    with engine.no_sync():
        with pytest.raises(AssertionError, match="not re-entrant"):
            with engine.no_sync():
                pass
        x, y = regression_data(2)
        engine.backward(engine(x, y))
        with pytest.raises(AssertionError, match=r"illegal to call Engine.step\(\) inside no_sync context manager at an accumulation boundary"):
            engine.step()


@pytest.mark.parametrize("save_dir", [None, ""])
def test_save_checkpoint_without_a_directory(save_dir):
    engine = _engine(0)
    with pytest.raises(ValueError, match="save_dir must be a non-empty path") as info:
        engine.save_checkpoint(save_dir)
    assert isinstance(info.value, CheckpointError)


class TwoRanks:
    """A communicator of two ranks whose all_gather_object answers with what each rank was given."""

    world_size = 2

    def __init__(self, other):
        self.other = other

    def all_gather_object(self, obj):
        return [obj, self.other]


def test_different_tags_are_an_assertion_error(tmp_path):
    with pytest.raises(AssertionError, match="the checkpoint tag is not the same on every rank") as info:
        check_save_agreement(tmp_path, "a", TwoRanks(("b", str(tmp_path))), "FAIL")
    assert isinstance(info.value, CheckpointError)
    with pytest.raises(CheckpointError, match="save_dir differs between ranks") as info:
        check_save_agreement(tmp_path, "a", TwoRanks(("a", str(tmp_path / "other"))))
    # Warn and Ignore: every rank's part goes under rank 0's tag (DeepSpeed's ranks would each write their own)
    for mode in ("WARN", "IGNORE"):
        assert check_save_agreement(tmp_path, "a", TwoRanks(("b", str(tmp_path))), mode) == "a"
    assert not isinstance(info.value, AssertionError)  # DeepSpeed does not check directories
    check_save_agreement(tmp_path, "a", TwoRanks(("a", str(tmp_path))))  # agreement: nothing raised
