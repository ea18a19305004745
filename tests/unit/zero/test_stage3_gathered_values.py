"""Tensors taken from parameters inside `GatheredParameters` keep their values after the block
(param_group.py's Note: values taken inside GatheredParameters), as under DeepSpeed, whose release only
repoints `param.data`: DeepSpeed-Chat's `save_zero_three_model` saves `p.data.cpu()` taken inside the
block, which on the CPU is `p.data` itself. The group gathers into a new buffer next time, and training
is unchanged. One process, the gather machinery on (conftest.py)."""

import copy

import pytest
import torch

import lightspeed
from lightspeed.zero.stage3 import GatheredParameters

pytestmark = pytest.mark.timeout(120)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def test_values_taken_inside_the_block_survive_it_and_training_is_unchanged():
    model = _model()
    plain = copy.deepcopy(model)
    cfg = {"train_batch_size": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, *_ = lightspeed.initialize(model=model, config=cfg, dist_init_required=False)
    params = list(engine.module.parameters())
    assert all(p.numel() == 0 for p in params)

    taken = []
    for p in params:
        with GatheredParameters(p):
            taken.append(p.data.cpu())  # on the CPU: p.data itself, a view of the gathered buffer
    assert all(p.numel() == 0 for p in params)  # released
    for t, ref in zip(taken, plain.parameters()):
        torch.testing.assert_close(t, ref.detach())

    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        loss = engine(x).square().mean()
        engine.backward(loss)
        engine.step()
        ref_loss = plain(x).square().mean()
        ref_loss.backward()
        with torch.no_grad():
            for q in plain.parameters():
                q -= 0.1 * q.grad
                q.grad = None
        torch.testing.assert_close(loss, ref_loss)
    for t, ref in zip(taken, _model().parameters()):  # the handed-over tensors still hold the initial values
        torch.testing.assert_close(t, ref.detach())
    with GatheredParameters(params):
        for p, ref in zip(params, plain.parameters()):
            torch.testing.assert_close(p.data, ref.detach())
