"""1F1B over gloo with its receives posted ahead (comm/pipelining.py's `PostedRecv1F1B`) against torch's
own `Schedule1F1B` on the same stages, micro-batches and weights: the losses and every gradient bit
for bit, at pp=3 (a middle stage receives from both sides), and the class `schedule_class` picks."""

from __future__ import annotations

import pytest
import torch

from lightspeed.testing.run_world import run_world

pytestmark = [pytest.mark.dist, pytest.mark.timeout(120)]


def _run(schedule_name: str, n: int):
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules as torch_schedules

    from lightspeed.comm.pipelining import PostedRecv1F1B

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(100 + rank)
    module = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh())
    example = torch.zeros(2, 6, requires_grad=rank > 0)
    stage = PipelineStage(module, rank, world, torch.device("cpu"), input_args=(example,),
                          output_args=(module(example).detach().requires_grad_(),))
    cls = PostedRecv1F1B if schedule_name == "posted" else torch_schedules.Schedule1F1B
    schedule = cls(stage, n, loss_fn=lambda out, target: ((out - target) ** 2).mean(), scale_grads=False)
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(2 * n, 6, generator=g), torch.randn(2 * n, 6, generator=g)
    losses = []
    for _ in range(2):  # the second step reuses the receive buffers
        step_losses = []
        schedule.step(*([x] if rank == 0 else []), **({"target": y, "losses": step_losses} if rank == world - 1 else {}))
        losses.append([float(v) for v in step_losses])
    return losses, [p.grad.clone() for p in module.parameters()]


def _world():
    from torch.distributed.pipelining import schedules as torch_schedules

    from lightspeed.comm.pipelining import PostedRecv1F1B, schedule_class

    picked = (schedule_class("Schedule1F1B") is PostedRecv1F1B,
              schedule_class("ScheduleGPipe") is torch_schedules.ScheduleGPipe)
    return picked, _run("torch", 5), _run("posted", 5)


def test_posted_receives_match_torch_1f1b():
    for picked, (want_losses, want_grads), (losses, grads) in run_world(_world, 3):
        assert picked == (True, True)
        assert losses == want_losses
        assert all(torch.equal(a, b) for a, b in zip(grads, want_grads))
    assert len(want_losses[0]) == 5  # the last rank checked the losses of every micro-batch
