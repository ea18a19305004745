"""An optimizer's own small state tensors (not one value per element of the parameter) come back from a
ZeRO checkpoint as they were, beside the elementwise state (checkpoint/universal.py's Note: optimizer
state). DeepSpeed's checkpoint tests use such an optimizer (an int and a one-element tensor per parameter)."""

import torch

import lightspeed


class CountingSGD(torch.optim.Optimizer):
    """SGD keeping a step count as an int, one as a one-element tensor, and a momentum per element."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["integer_step"], state["tensor_step"] = 0, torch.zeros(1)
                    state["momentum"] = torch.zeros_like(p)
                state["momentum"].mul_(0.9).add_(p.grad)
                p.data.add_(state["momentum"], alpha=-group["lr"])
                state["integer_step"] += 1
                state["tensor_step"] += 1


def _engine(stage):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
           "zero_allow_untested_optimizer": True}
    engine, *_ = lightspeed.initialize(model=model, optimizer=CountingSGD(model.parameters()), config=cfg,
                                       dist_init_required=False)
    return engine


def test_small_state_tensors_round_trip(tmp_path):
    for stage in (1, 2):
        engine = _engine(stage)
        for _ in range(3):
            engine.backward(engine(torch.randn(2, 6)).pow(2).mean())
            engine.step()
        engine.save_checkpoint(tmp_path / str(stage), tag="t")
        loaded = _engine(stage)
        loaded.load_checkpoint(tmp_path / str(stage), tag="t")
        for saved, got in zip(engine.optimizer.state.values(), loaded.optimizer.state.values()):
            assert got["integer_step"] == 3 and torch.is_tensor(got["tensor_step"])
            assert got["tensor_step"].shape == (1,) and got["tensor_step"].item() == 3
            torch.testing.assert_close(got["momentum"], saved["momentum"], rtol=0, atol=0)
