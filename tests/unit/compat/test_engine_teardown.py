"""DeepSpeed's `engine.destroy()` and `engine.empty_partition_cache()` at every ZeRO stage, in one process:
destroy waits for a background checkpoint save, removes every hook the engine put on the model and its
parameters (the model then runs and trains as plain PyTorch) and leaves the engine refusing to be used;
empty_partition_cache releases stage 3's persistent gathered groups (not those held) and is a no-op at
stages 0-2."""

import pytest
import torch

import lightspeed
from lightspeed.testing.models import TinyMLP, regression_data
from lightspeed.zero.stage3 import options as stage3_options
from lightspeed.zero.stage3.gathered import GatheredParameters

pytestmark = pytest.mark.timeout(120)


def _engine(stage: int, **extra):
    torch.manual_seed(0)
    cfg = {"train_batch_size": 2, "steps_per_print": 10**6, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "zero_optimization": {"stage": stage, **extra.pop("zero", {})}, **extra}
    engine, *_ = lightspeed.initialize(model=TinyMLP(), config=cfg, dist_init_required=False)
    return engine


def _hooks(model: torch.nn.Module) -> int:
    """The forward and gradient hooks on `model`'s modules and parameters."""
    modules = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
    params = sum(len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) for p in model.parameters())
    return modules + params


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_destroy(monkeypatch, tmp_path, stage):
    monkeypatch.setattr(stage3_options, "ONE_RANK_VIEWS", False)  # stage 3's gather machinery at one rank
    engine = _engine(stage, checkpoint={"writer": {"type": "PYTHON", "decoupled": True}})
    model = engine.module
    x, y = regression_data(2)
    engine.backward(engine(x, y))
    engine.step()
    assert _hooks(model) > 0
    engine.save_checkpoint(tmp_path, tag="t")  # written in the background
    engine.destroy()
    assert (tmp_path / "t").is_dir() and not engine._checkpoint_writer.pending  # the save finished first
    assert _hooks(model) == 0
    for use in (lambda: engine(x, y), lambda: engine.backward(torch.ones((), requires_grad=True)),
                engine.step, engine.zero_grad, lambda: engine.save_checkpoint(tmp_path, tag="u")):
        with pytest.raises(RuntimeError, match=r"engine.destroy\(\)"):
            use()
    engine.destroy()  # a second call does nothing
    if stage < 3:  # the model is plain PyTorch again: its gradients land in .grad, untouched by any hook
        model.zero_grad(set_to_none=True)
        loss = model(x, y)
        loss.backward()
        ref = TinyMLP()
        ref.load_state_dict(model.state_dict())
        ref(x, y).backward()
        assert all(torch.equal(p.grad, r.grad) for p, r in zip(model.parameters(), ref.parameters()) if p.requires_grad)


def _released(engine) -> list[str]:
    return sorted(g.name for g in engine.strategy.groups if g.state == "released")


def test_empty_partition_cache_releases_persistent_groups(monkeypatch):
    monkeypatch.setattr(stage3_options, "ONE_RANK_VIEWS", False)
    engine = _engine(3, zero={"stage3_param_persistence_threshold": 10**6})  # every group persists
    x, y = regression_data(2)
    with torch.no_grad():
        first = engine(x)
    names = [g.name for g in engine.strategy.groups]
    assert names and _released(engine) == []  # persistent: still gathered after the forward
    engine.empty_partition_cache()
    assert _released(engine) == sorted(names)
    assert all(p.numel() == 0 for p in engine.module.parameters())
    with torch.no_grad():
        assert torch.equal(engine(x), first)  # gathered again on use
    # a group something holds stays gathered
    with GatheredParameters([engine.module.fc1.weight]):
        engine.empty_partition_cache()
        assert engine.module.fc1.weight.numel() == 37 * 13
    with engine.unsharded():
        engine.empty_partition_cache()
        assert _released(engine) == []
    # training goes on as before
    engine.backward(engine(x, y))
    engine.step()
    assert engine.global_steps == 1


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_empty_partition_cache_is_a_no_op_at_stages_0_to_2(stage):
    engine = _engine(stage)
    x, y = regression_data(2)
    with torch.no_grad():
        before = engine(x)
    engine.empty_partition_cache()
    assert all(p.numel() > 0 for p in engine.module.parameters())
    with torch.no_grad():
        assert torch.equal(engine(x), before)
