"""bf16.stochastic_rounding through the engine (ZeRO stage 1, one process): bf16 masters and optimizer
state written with stochastic rounding train, differ from round-to-nearest, repeat bitwise under a fixed
seed, resume from a checkpoint exactly where the uninterrupted run is, and the key is refused with its
name where it has no meaning."""
from __future__ import annotations

import pytest
import torch

import lightspeed
from lightspeed.config.errors import ConfigError

STEPS = 8


def _config(rounding: bool, *, masters: bool = True, offload: bool = False, torch_adam: bool = False) -> dict:
    bf16 = {"enabled": True, "stochastic_rounding": rounding}
    if masters:
        bf16.update(bf16_master_weights_and_grads=True, bf16_optimizer_states=True)
    zero = {"stage": 1}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    params = {"lr": 1e-2, "weight_decay": 0.01}
    if torch_adam:
        params["torch_adam"] = True
    return {"train_micro_batch_size_per_gpu": 16, "optimizer": {"type": "AdamW", "params": params},
            "bf16": bf16, "zero_optimization": zero, "steps_per_print": 1000}


def _engine(cfg: dict):
    torch.manual_seed(0)  # the model's initialisation and the rounding seed (torch's initial seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    engine, *_ = lightspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg,
                                       dist_init_required=False)
    return engine


def _batch(step: int):
    gen = torch.Generator().manual_seed(100 + step % 2)  # two batches, taken in turn
    x = torch.randn(16, 16, generator=gen)
    return x.bfloat16(), torch.sin(x[:, :1] * 2) + 0.1 * x[:, 1:2]


def _train(engine, steps: range) -> list[float]:
    losses = []
    for step in steps:
        x, y = _batch(step)
        loss = torch.nn.functional.mse_loss(engine(x).float(), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _params(engine) -> list[torch.Tensor]:
    return [p.detach().clone() for p in engine.module.parameters()]


@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
def test_stochastic_rounding_trains_repeats_and_resumes(offload, tmp_path):
    rtn = _engine(_config(False, offload=offload))
    rtn_losses = _train(rtn, range(STEPS))
    sr = _engine(_config(True, offload=offload))
    assert sr.optimizer.stochastic_rounding and not rtn.optimizer.stochastic_rounding
    half = _train(sr, range(STEPS // 2))
    sr.save_checkpoint(tmp_path, tag="t")
    sr_losses = half + _train(sr, range(STEPS // 2, STEPS))
    # it trains (the loss falls over the run) and is not the round-to-nearest run
    assert all(torch.isfinite(torch.tensor(sr_losses)))
    assert sr_losses[-2] < 0.8 * sr_losses[0] and sr_losses[-1] < 0.8 * sr_losses[1]
    assert sr_losses[0] == rtn_losses[0] and sr_losses != rtn_losses
    assert any(not torch.equal(a, b) for a, b in zip(_params(sr), _params(rtn)))
    # a fixed seed repeats the run bitwise
    again = _engine(_config(True, offload=offload))
    assert _train(again, range(STEPS)) == sr_losses
    assert all(torch.equal(a, b) for a, b in zip(_params(again), _params(sr)))
    # the checkpoint loads, and the resumed run continues exactly as the uninterrupted one
    resumed = _engine(_config(True, offload=offload))
    resumed.load_checkpoint(tmp_path, tag="t")
    state = resumed.optimizer.state
    assert all(v.dtype == torch.bfloat16 for s in state.values() for k, v in s.items() if k.startswith("exp_avg"))
    assert _train(resumed, range(STEPS // 2, STEPS)) == sr_losses[STEPS // 2:]
    assert all(torch.equal(a, b) for a, b in zip(_params(resumed), _params(sr)))


def test_stochastic_rounding_refused_where_it_means_nothing():
    with pytest.raises(ConfigError, match=r"bf16\.stochastic_rounding: .*bf16_master_weights_and_grads"):
        _engine(_config(True, masters=False))
    with pytest.raises(ConfigError, match=r"bf16\.stochastic_rounding: .*AdamW"):
        _engine(_config(True, torch_adam=True))


def test_policy_reads_the_key():
    from lightspeed.precision.policy import policy_from_config

    on = {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True,
          "stochastic_rounding": True}
    assert policy_from_config({"bf16": on, "zero_optimization": {"stage": 1}}).stochastic_rounding
    assert not policy_from_config({"bf16": {**on, "stochastic_rounding": False}}).stochastic_rounding
    with pytest.raises(ConfigError, match=r"^bf16\.stochastic_rounding: .*\(got false\)$"):
        policy_from_config({"bf16": {"enabled": True, "stochastic_rounding": True}})
