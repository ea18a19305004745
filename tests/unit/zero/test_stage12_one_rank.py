"""ZeRO stages 1-2 at a data-parallel world of one (Note: one rank in zero/stage12.py): where the master
is in the parameters' own dtype it is the flat parameter buffer itself, and training gives what a
separate master gives, bit for bit; the memory breakdown counts no master."""

import pytest
import torch

import lightspeed
from lightspeed.zero import stage12
from tests.unit.zero.test_stage3_units import Nested

pytestmark = pytest.mark.timeout(120)

BF16_MASTERS = {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}


def _train(alias: bool, stage: int, bf16: dict | None, optimizer: str, monkeypatch, steps: int = 4):
    monkeypatch.setattr(stage12, "ONE_RANK_MASTER_ALIAS", alias)
    cfg = {"train_batch_size": 4, "steps_per_print": 10**6, "gradient_clipping": 0.5,
           "optimizer": {"type": optimizer, "params": {"lr": 0.01, "weight_decay": 0.01}},
           "zero_optimization": {"stage": stage}}
    if bf16:
        cfg["bf16"] = bf16
    torch.manual_seed(0)
    engine, *_ = lightspeed.initialize(model=Nested(), config=cfg, dist_init_required=False)
    dtype = torch.bfloat16 if bf16 else torch.float32
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(4, 4, generator=g).to(dtype), torch.randn(4, 4, generator=g).to(dtype)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return engine, losses


@pytest.mark.parametrize("stage,bf16,optimizer", [(1, BF16_MASTERS, "AdamW"), (2, BF16_MASTERS, "AdamW"),
                                                  (2, None, "AdamW"), (1, None, "SGD")])
def test_master_is_the_parameters_at_one_rank(stage, bf16, optimizer, monkeypatch):
    ref, ref_losses = _train(False, stage, bf16, optimizer, monkeypatch)
    engine, losses = _train(True, stage, bf16, optimizer, monkeypatch)
    assert losses == ref_losses
    state, ref_state = engine.module.state_dict(), ref.module.state_dict()
    assert all(torch.equal(state[k], ref_state[k]) for k in ref_state)
    got, want = engine.optimizer.state_dict()["state"], ref.optimizer.state_dict()["state"]
    assert got.keys() == want.keys() and all(
        torch.equal(got[i][k], want[i][k]) for i in want for k in want[i] if torch.is_tensor(want[i][k]))
    for s in engine.strategy.shards:
        assert s.aliased and s.master.data_ptr() == s.flat.lp_flat.data_ptr()
    assert not any(s.aliased for s in ref.strategy.shards)
    assert "master_params" not in engine.memory_breakdown()["cpu"]
    assert ref.memory_breakdown()["cpu"]["master_params"] == sum(s.master.nbytes for s in ref.strategy.shards)


def test_mixed_precision_keeps_its_fp32_master(monkeypatch):
    engine, _ = _train(True, 2, {"enabled": True}, "AdamW", monkeypatch, steps=1)
    assert not any(s.aliased for s in engine.strategy.shards)
    assert all(s.master.dtype == torch.float32 for s in engine.strategy.shards)
