"""``gradient_allreduce_op``: "sum" adds the ranks' gradients, "mean" (the default) averages them, at
ZeRO stages 0, 1 and 2 on two gloo processes; with "sum" neither prescale_gradients nor
gradient_predivide_factor scales anything (DeepSpeed tests `gradient_average` first). One SGD step at
lr 1 makes the update the reduced gradient itself, which is compared with the sum of both ranks'
local gradients. Stage 3 refuses "sum", as DeepSpeedConfig does.
"""

from __future__ import annotations

import pytest
import torch

from lightspeed.testing.run_world import run_world

pytestmark = [pytest.mark.dist, pytest.mark.timeout(120)]


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def _update(stage: int, op: str, extra: dict):
    import torch.distributed as dist

    import lightspeed

    model = _model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_allreduce_op": op, "zero_optimization": {"stage": stage},
           **extra}
    engine, *_ = lightspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                                       config=cfg)
    x = torch.randn(2, 6, generator=torch.Generator().manual_seed(dist.get_rank()))
    engine.backward(engine(x).square().sum())
    engine.step()
    after = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
    return {n: before[n] - after[n] for n in before}


def _local_sum():
    import torch.distributed as dist

    model = _model()
    x = torch.randn(2, 6, generator=torch.Generator().manual_seed(dist.get_rank()))
    model(x).square().sum().backward()
    out = {}
    for n, p in model.named_parameters():
        dist.all_reduce(p.grad)
        out[n] = p.grad
    return out


def _world():
    import lightspeed
    from lightspeed.config.errors import ConfigError

    total = _local_sum()
    for stage in (0, 1, 2):
        for op, extra, factor in (("mean", {}, 0.5), ("sum", {}, 1.0),
                                  ("SUM", {"prescale_gradients": stage == 0, "gradient_predivide_factor": 4.0}, 1.0)):
            update = _update(stage, op, extra)
            for name, value in update.items():
                torch.testing.assert_close(value, total[name] * factor, atol=1e-6, rtol=1e-5,
                                           msg=f"stage {stage} {op} {extra} {name}")
    model = _model()
    with pytest.raises(ConfigError, match='gradient_allreduce_op: "sum" is not supported with zero_optimization.stage 3'):
        lightspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                              config={"train_micro_batch_size_per_gpu": 2, "gradient_allreduce_op": "sum",
                                      "zero_optimization": {"stage": 3}})
    return True


def test_gradient_allreduce_op():
    assert run_world(_world, 2) == [True, True]
