"""A model's `forward_*` methods called through the engine run as forwards (module_passthrough.py's
Note: [forward methods]; coordinator.py's Note: other forward methods): at stage 3 the root unit's
groups are gathered around `engine.forward_value(...)` and released after it, its result and gradients
are the plain model's, and other methods pass through untouched. One process, the gather machinery on
(conftest.py); DeepSpeed-Chat's step 3 runs it at a world of two (tests/distributed/test_deepspeed_chat.py)."""

import copy

import pytest
import torch

import lightspeed

pytestmark = pytest.mark.timeout(120)


class ValueModel(torch.nn.Module):
    """DeepSpeed-Chat's RewardModel in miniature: the root holds the embedding and the value head (the
    root unit's parameters), the blocks are units of their own; `forward_value` never calls `forward`."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))
        self.v_head = torch.nn.Linear(8, 1, bias=False)

    def forward(self, ids):
        return self.forward_value(ids).sum()

    def forward_value(self, ids, scale=1.0):
        h = self.embed(ids)
        for block in self.blocks:
            h = torch.tanh(block(h))
        return self.v_head(h).squeeze(-1) * scale

    def describe(self):
        return "value model"


def _engine(model, stage):
    cfg = {"train_batch_size": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "gradient_clipping": 0.0,
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    engine, *_ = lightspeed.initialize(model=model, config=cfg, dist_init_required=False)
    return engine


def test_forward_value_through_the_engine_gathers_the_root_unit_and_trains_as_the_plain_model():
    torch.manual_seed(0)
    model = ValueModel()
    plain = copy.deepcopy(model)
    engine = _engine(model, 3)
    root_groups = engine.strategy.coordinator.uses[id(engine.module)]
    assert root_groups and all(g.state == "released" for g in root_groups)
    ids = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])

    with pytest.raises(RuntimeError):  # the module's own method, bypassing the engine: nothing gathered
        engine.module.forward_value(ids)

    values = engine.forward_value(ids, scale=2.0)  # keyword arguments pass through
    expected = plain.forward_value(ids, scale=2.0)
    torch.testing.assert_close(values, expected)
    engine.backward(values.square().mean())
    engine.step()
    expected.square().mean().backward()
    with torch.no_grad():
        for p in plain.parameters():
            p -= 0.1 * p.grad
    assert all(g.state == "released" for g in engine.strategy.groups)  # every group released after the step
    with torch.no_grad():  # a no-grad call releases what it gathered right away
        torch.testing.assert_close(engine.forward_value(ids), plain.forward_value(ids))
    assert all(g.state == "released" for g in engine.strategy.groups)
    # forward_value inside the engine's own forward (the root's hooks already ran): not gathered twice
    torch.testing.assert_close(engine(ids), plain(ids))


def test_only_forward_methods_are_wrapped_and_whole_parameters_pass_them_through():
    engine = _engine(ValueModel(), 3)
    assert engine.describe() == "value model"
    assert engine.describe.__self__ is engine.module  # not a forward method: the module's own bound method
    assert engine.forward_value.__name__ == "forward_value" and not hasattr(engine.forward_value, "__self__")
    stage0 = _engine(ValueModel(), 0)
    assert stage0.forward_value == stage0.module.forward_value  # nothing to gather: the method itself
