"""A checkpoint resumed at another `gradient_accumulation_steps` starts a whole accumulation window: the
micro-step count follows the steps taken at this engine's accumulation steps, not the count saved."""

import torch

import lightspeed


def _engine(gas: int):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    engine, *_ = lightspeed.initialize(model=model, dist_init_required=False, config={
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    return engine


def _micro_step(engine):
    loss = engine(torch.ones(2, 4)).sum()
    engine.backward(loss)
    engine.step()


def test_resume_at_other_accumulation_steps_keeps_the_boundary(tmp_path):
    saved = _engine(3)
    for _ in range(4):  # one whole window (3) and one micro-step into the next
        _micro_step(saved)
    assert saved.global_steps == 1 and saved.micro_steps == 4
    saved.save_checkpoint(tmp_path, tag="t")
    resumed = _engine(2)
    resumed.load_checkpoint(tmp_path, tag="t")
    assert resumed.global_steps == 1 and resumed.micro_steps == 2
    _micro_step(resumed)
    assert resumed.global_steps == 1  # the first micro-step of a new window of 2: no step
    _micro_step(resumed)
    assert resumed.global_steps == 2 and resumed.was_step_applied()
