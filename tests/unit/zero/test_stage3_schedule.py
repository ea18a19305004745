"""The ZeRO-3 coordinator at world size 1 (no processes): training equals plain PyTorch, external
parameters are found, prefetch and release follow the trace and the stage-3 knobs."""

import pytest
import torch
import torch.nn.functional as F

import lightspeed
from lightspeed.testing.parity import train_alongside
from lightspeed.zero.stage3 import param_state
from lightspeed.zero.stage3.param_group import RELEASED

pytestmark = pytest.mark.timeout(60)


class Chain(torch.nn.Module):
    """Four linears, the root reading `layers[0].weight` itself (an external use) and calling
    `layers[1]` twice."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))

    def forward(self, x, y):
        h = x
        for i, layer in enumerate(self.layers):
            h = torch.tanh(layer(h))
            if i == 1:
                h = torch.tanh(layer(h))
        h = h @ self.layers[0].weight
        return F.mse_loss(h, y)


def _engine(model, **zero):
    cfg = {"train_batch_size": 4, "steps_per_print": 10**6,
           "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
           "zero_optimization": {"stage": 3, **zero}}
    engine, *_ = lightspeed.initialize(model=model, config=cfg, dist_init_required=False)
    return engine


def _data(steps):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)) for _ in range(steps)]


RELEASE_ALL = {"stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0}


@pytest.mark.parametrize("zero", [RELEASE_ALL, {}, {**RELEASE_ALL, "stage3_prefetch_bucket_size": 100}])
def test_world_size_1_training_equals_plain_pytorch(zero):
    ref_model = Chain()
    opt = torch.optim.AdamW(ref_model.parameters(), lr=0.01, weight_decay=0.01)
    engine = _engine(Chain(), **zero)
    train_alongside(engine, ref_model, opt, _data(6))


def test_external_use_is_registered_with_the_module_that_reads_it():
    engine = _engine(Chain(), **RELEASE_ALL)
    model = engine.module
    coordinator = engine.strategy.coordinator
    group0 = param_state(model.layers[0].weight).group
    assert group0 not in coordinator.uses.get(id(model), [])
    (x, y), = _data(1)
    engine.backward(engine(x, y))
    engine.step()
    assert group0 in coordinator.uses[id(model)]
    assert all(g.state == RELEASED for g in engine.strategy.groups)
    assert coordinator._mode is None  # the detection mode is off once the trace is complete


def _states_seen(engine, steps=2):
    """Per module forward (after the first, traced step): (next layer's group state at this layer's
    pre-forward, this layer's group state after its forward)."""
    model = engine.module
    groups = [param_state(layer.weight).group for layer in model.layers]
    seen = []
    handles = []
    for i, layer in enumerate(model.layers[:-1]):
        handles.append(layer.register_forward_pre_hook(lambda m, a, i=i: seen.append(("pre", i, groups[i + 1].state))))
        handles.append(layer.register_forward_hook(lambda m, a, o, i=i: seen.append(("post", i, groups[i].state))))
    for s, (x, y) in enumerate(_data(steps)):
        seen.clear()
        engine.backward(engine(x, y))
        engine.step()
    for h in handles:
        h.remove()
    return seen


def test_prefetch_gathers_the_next_modules_group_ahead_of_its_forward():
    seen = _states_seen(_engine(Chain(), **RELEASE_ALL, stage3_prefetch_bucket_size=100))
    pre = [state for kind, i, state in seen if kind == "pre" and i in (0, 2)]
    assert pre and all(state != RELEASED for state in pre)
    seen = _states_seen(_engine(Chain(), **RELEASE_ALL, stage3_prefetch_bucket_size=0))
    assert all(state == RELEASED for kind, i, state in seen if kind == "pre" and i in (0, 2))
    # max_live_parameters bounds prefetching
    seen = _states_seen(_engine(Chain(), **RELEASE_ALL, stage3_prefetch_bucket_size=100,
                                stage3_max_live_parameters=72))  # one group: no room to prefetch
    assert all(state == RELEASED for kind, i, state in seen if kind == "pre" and i in (0, 2))


def test_release_follows_reuse_distance_and_persistence():
    released = [state for kind, i, state in _states_seen(_engine(Chain(), **RELEASE_ALL)) if kind == "post"]
    assert released and all(s == RELEASED for s in released[1:])  # layer 0 is reused by the root: kept
    kept = [state for kind, i, state in _states_seen(_engine(Chain(), stage3_param_persistence_threshold=0))
            if kind == "post"]
    assert all(s != RELEASED for s in kept)  # reused in backward within DeepSpeed's default distance
    persistent = [state for kind, i, state in _states_seen(_engine(Chain(), stage3_max_reuse_distance=0))
                  if kind == "post"]
    assert all(s != RELEASED for s in persistent)  # 72-element groups are under the 100k threshold


def test_checkpoint_round_trip(tmp_path):
    engine = _engine(Chain(), **RELEASE_ALL)
    (x, y), = _data(1)
    engine.backward(engine(x, y))
    engine.step()
    module_state = engine.strategy.module_state_dict()
    engine.save_checkpoint(str(tmp_path))
    other = _engine(Chain(), **RELEASE_ALL)
    other.load_checkpoint(str(tmp_path))
    for k, v in other.strategy.module_state_dict().items():
        assert torch.equal(v, module_state[k])
    for mine, theirs in zip(engine.strategy.fragments(), other.strategy.fragments()):
        assert mine.name == theirs.name and torch.equal(mine.master_view(), theirs.master_view())
    with pytest.raises(RuntimeError, match="missing keys"):
        other.strategy.load_module_state_dict({k: v for k, v in module_state.items() if k != "layers.0.bias"})
