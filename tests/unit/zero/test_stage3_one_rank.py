"""ZeRO-3 at a data-parallel world of one (Note: one rank in zero/stage3/param_group.py): the
parameters view their shards from set-up on, nothing is gathered or released, no unit has forward
hooks (engine.compile() takes the whole module), and training and GatheredParameters writes give what
the gather machinery gives, bit for bit."""

import pytest
import torch

import lightspeed
from lightspeed.zero import GatheredParameters
from lightspeed.zero.stage3 import options as stage3_options
from lightspeed.zero.stage3.param_group import GATHERED
from tests.unit.zero.test_stage3_units import RELEASE_ALL, Nested

pytestmark = pytest.mark.timeout(60)


def _train(one_rank_views: bool, monkeypatch, steps: int = 4):
    monkeypatch.setattr(stage3_options, "ONE_RANK_VIEWS", one_rank_views)
    cfg = {"train_batch_size": 4, "steps_per_print": 10**6, "gradient_clipping": 0.5,
           "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
           "bf16": {"enabled": True}, "zero_optimization": {"stage": 3, **RELEASE_ALL}}
    engine, *_ = lightspeed.initialize(model=Nested(), config=cfg, dist_init_required=False)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(4, 4, generator=g).bfloat16(), torch.randn(4, 4, generator=g).bfloat16()
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return engine, losses


def test_parameters_view_their_shards_and_train_as_gathered(monkeypatch):
    gathered, ref = _train(False, monkeypatch)
    engine, losses = _train(True, monkeypatch)
    assert losses == ref
    state, ref_state = engine.strategy.module_state_dict(), gathered.strategy.module_state_dict()
    assert state.keys() == ref_state.keys() and all(torch.equal(state[k], ref_state[k]) for k in state)
    for g in engine.strategy.groups:
        assert g.always_gathered and g.state == GATHERED and g.full_flat is g.lp_shard
        for p, view in zip(g.params, g.views):
            assert p.data_ptr() == view.data_ptr() and p.shape == view.shape
    # no gathered copy is counted: the parameters are the shard
    assert engine.memory_breakdown()["cpu"]["lp_params"] == sum(g.lp_shard.nbytes for g in engine.strategy.groups)
    assert all(not g.always_gathered for g in gathered.strategy.groups)
    # nothing to gather: no unit has forward hooks, and engine.compile() takes the whole module
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in engine.module.modules())
    assert engine.strategy.compile_regions() == [engine.module]
    assert any(m._forward_pre_hooks for m in gathered.module.modules())


def test_gathered_parameters_write_at_one_rank(monkeypatch):
    engine, _ = _train(True, monkeypatch, steps=1)
    w = engine.module.out.weight
    with GatheredParameters([w], modifier_rank=0):
        w.data.fill_(0.25)
    assert torch.equal(engine.strategy.module_state_dict()["out.weight"].float(), torch.full((4, 6), 0.25))
    frag = engine.strategy.fragment(w)
    assert torch.equal(frag.master, torch.full((24,), 0.25))  # the fp32 master follows the write
