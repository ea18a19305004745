"""The batch triad, resolved and checked as DeepSpeed's _set_batch_related_parameters and
_batch_assertion do, and the world size it is resolved with."""

import sys
import types

import pytest

from lightspeed.config import ConfigError, load
from lightspeed.config.batch import detect_world_size, resolve_batch


def triad(config, world_size=None):
    cfg = load(config, world_size=world_size)
    return cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps


@pytest.mark.parametrize(
    "config, world_size, expected",
    [
        ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 4, (32, 4, 2)),
        ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 4, (32, 4, 2)),
        ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, 4, (32, 4, 2)),
        ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 4, (32, 4, 2)),
        ({"train_batch_size": 32}, 4, (32, 8, 1)),
        ({"train_micro_batch_size_per_gpu": 4}, 4, (16, 4, 1)),
        ({"train_micro_batch_size_per_gpu": 4, "train_batch_size": None}, 1, (4, 4, 1)),
    ],
)  # fmt: skip
def test_any_two_determine_the_third(config, world_size, expected):
    result = triad(config, world_size)
    assert result == expected and all(type(v) is int for v in result)


def test_neither_train_nor_micro_given():
    for config, tail in (({}, "(got neither)"), ({"gradient_accumulation_steps": 4}, "only gradient_accumulation_steps=4)")):
        with pytest.raises(ConfigError) as info:
            load(config, world_size=1)
        assert str(info.value).startswith("train_batch_size, train_micro_batch_size_per_gpu: at least one must be given")
        assert str(info.value).endswith(tail)


def test_all_three_inconsistent():
    with pytest.raises(ConfigError) as info:
        load({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, world_size=2)
    assert str(info.value) == (
        "train_batch_size: must equal train_micro_batch_size_per_gpu * gradient_accumulation_steps * world_size "
        "= 4 * 2 * 2 = 16 (got 32; world_size 2 from the world_size argument)"
    )


def test_derived_accumulation_does_not_divide():
    with pytest.raises(ConfigError) as info:
        load({"train_batch_size": 4096, "train_micro_batch_size_per_gpu": 16}, world_size=3)
    message = str(info.value)
    assert "= 16 * 85 * 3 = 4080 (got 4096" in message
    assert "gradient_accumulation_steps derived as train_batch_size // train_micro_batch_size_per_gpu // world_size" in message


def test_derived_micro_batch_does_not_divide():
    with pytest.raises(ConfigError, match=r"= 3 \* 4 \* 2 = 24 \(got 30; train_micro_batch_size_per_gpu derived"):
        load({"train_batch_size": 30, "gradient_accumulation_steps": 4}, world_size=2)


def test_derived_accumulation_is_zero():
    with pytest.raises(ConfigError, match=r"^gradient_accumulation_steps: must be > 0 \(got 0, derived as .* = 8 // 16 // 1 = 0"):
        load({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 16}, world_size=1)


def test_derived_micro_batch_is_zero():
    with pytest.raises(ConfigError, match=r"^train_micro_batch_size_per_gpu: must be > 0 \(got 0"):
        load({"train_batch_size": 3}, world_size=4)
    with pytest.raises(ConfigError, match=r"^train_micro_batch_size_per_gpu: must be > 0 \(got 0"):
        load({"train_batch_size": 6, "gradient_accumulation_steps": 4}, world_size=2)


@pytest.mark.parametrize("key", ["train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"])
@pytest.mark.parametrize("value", [0, -4])
def test_non_positive_sizes(key, value):
    config = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, key: value}
    with pytest.raises(ConfigError) as info:
        load(config, world_size=1)
    assert info.value.problems == [f"{key}: must be a positive integer (got {value})"]


def test_world_size_from_environment(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert detect_world_size() == (4, "env WORLD_SIZE")
    cfg = load({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4})
    assert cfg.gradient_accumulation_steps == 2 and cfg.world_size == 4
    with pytest.raises(ConfigError, match="world_size 4 from env WORLD_SIZE"):
        load({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4})
    monkeypatch.setenv("WORLD_SIZE", "many")
    with pytest.raises(ConfigError, match='env WORLD_SIZE: must be a positive integer \\(got "many"\\)'):
        load({"train_batch_size": 8})


def test_world_size_from_an_initialized_process_group(monkeypatch):
    fake = types.SimpleNamespace(is_available=lambda: True, is_initialized=lambda: True, get_world_size=lambda: 8)
    monkeypatch.setitem(sys.modules, "torch.distributed", fake)
    monkeypatch.setenv("WORLD_SIZE", "2")  # an initialized group wins over the environment
    assert detect_world_size() == (8, "torch.distributed")
    assert detect_world_size(2) == (2, "the world_size argument")


def test_world_size_default():
    size, source = detect_world_size()
    if source != "torch.distributed":
        assert size == 1 and source.startswith("the default")


def test_resolve_batch_is_pure():
    assert resolve_batch(None, 4, 2, 8, "test") == (64, 4, 2, [])


def test_reload_with_another_world_size():
    cfg = load({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, world_size=4)
    assert load(cfg) is cfg and load(cfg, world_size=4) is cfg
    again = load(cfg, world_size=8)
    assert (again.train_batch_size, again.gradient_accumulation_steps, again.world_size) == (32, 1, 8)


def test_elasticity_sets_the_triad_itself():
    cfg = load({"elasticity": {"enabled": True, "max_train_batch_size": 64, "micro_batch_sizes": [2, 4]}}, world_size=2)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (48, 4, 6)  # 12 x 4: the largest HCN multiple of 4 within 64
    with pytest.raises(ConfigError, match="elasticity.max_train_batch_size: required"):
        load({"elasticity": {"enabled": True}}, world_size=2)
