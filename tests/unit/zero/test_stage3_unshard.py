"""engine.unshard / reshard / unsharded at a world of one, in one process: the gather machinery
(conftest.py turns the one-rank views off) for the demo GPT and a tiny Hugging Face GPT-2, the rules
(twice, reshard without unshard, an exception, a submodule, nesting, the step refused), parameter
offload, the one-rank views, and the no-ops of stages 0-2. The same scenario runs at world sizes 2
and 4 in tests/distributed/test_stage3.py."""

import pytest
import torch

import lightspeed
from lightspeed.zero.stage3 import options as stage3_options
from tests.distributed.test_stage3 import (RELEASE_ALL, GatherCounter, build_model, check_unshard, config,
                                           unshard_scenario)

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("name", ["gpt", "hf-gpt2"])
def test_unsharded_forwards_gather_nothing_and_training_is_unchanged(name):
    if name == "hf-gpt2":
        pytest.importorskip("transformers")
    check_unshard(unshard_scenario(name, RELEASE_ALL), 1)


def test_unshard_with_parameter_offload():
    check_unshard(unshard_scenario("gpt", {**RELEASE_ALL, "offload_param": {"device": "cpu"}}), 1)


def test_unshard_where_parameters_view_their_shards(monkeypatch):
    monkeypatch.setattr(stage3_options, "ONE_RANK_VIEWS", True)
    check_unshard(unshard_scenario("gpt", RELEASE_ALL), 1, views=True)


def _engine(zero=RELEASE_ALL, stage=3):
    engine, *_ = lightspeed.initialize(model=build_model("gpt"), config=config(1, stage, zero=zero),
                                       dist_init_required=False)
    return engine


def _gathered(engine) -> list[str]:
    return [g.name for g in engine.strategy.groups if g.state != "released"]


def test_unshard_rules():
    engine = _engine()
    model, groups = engine.module, engine.strategy.groups
    counter = GatherCounter(groups)
    x = torch.randint(0, 256, (2, 8))
    engine.reshard()  # nothing unsharded: a no-op
    assert counter.releases == [] and _gathered(engine) == []

    engine.unshard(model.blocks[0])  # a submodule: only its group
    assert counter.gathers == ["blocks.0"] and _gathered(engine) == ["blocks.0"]
    assert all(p.numel() > 0 for p in model.blocks[0].parameters())
    engine.unshard(model.blocks[0])  # twice: a no-op
    assert counter.gathers == ["blocks.0"]
    counter.reset()
    with torch.no_grad():
        engine(x)  # the other groups are gathered and released as usual, blocks.0 is left alone
    assert sorted(set(counter.gathers)) == ["<root>", "blocks.1"] and "blocks.0" not in counter.releases
    assert _gathered(engine) == ["blocks.0"]

    counter.reset()
    engine.unshard()  # the whole model: the groups not unsharded yet, all issued before the first wait
    assert sorted(counter.gathers) == ["<root>", "blocks.1"]
    with engine.unsharded(model.blocks[1]):  # nested: unsharded already, so its exit keeps them
        pass
    assert counter.releases == [] and len(_gathered(engine)) == 3
    engine.reshard(model.blocks[0])  # a submodule of what is unsharded
    assert counter.releases == ["blocks.0"] and sorted(_gathered(engine)) == ["<root>", "blocks.1"]
    engine.reshard()
    assert _gathered(engine) == [] and all(p.numel() == 0 for p in model.parameters())
    assert all(g.full_flat.untyped_storage().nbytes() == 0 for g in groups)

    with pytest.raises(KeyError):  # resharded on an exception
        with engine.unsharded(model.blocks[1]) as block:
            assert block is model.blocks[1] and _gathered(engine) == ["blocks.1"]
            raise KeyError("inside")
    assert _gathered(engine) == []

    with pytest.raises(ValueError, match="not a module of the model"):
        engine.unshard(torch.nn.Linear(2, 2))


def test_step_refused_while_unsharded_then_taken():
    engine, ref = _engine(), _engine()
    x = torch.randint(0, 256, (2, 8))
    for e in (engine, ref):
        e.backward(e(x, x))
    engine.unshard()
    with pytest.raises(RuntimeError, match=r"step\(\) while parameters are unsharded .* engine.reshard\(\)"):
        engine.step()
    engine.reshard()
    engine.step()
    ref.step()
    assert engine.global_steps == ref.global_steps == 1
    assert torch.equal(engine(x, x), ref(x, x))


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_unshard_is_a_no_op_at_stages_0_to_2(stage):
    engine = _engine(zero={}, stage=stage)
    x = torch.randint(0, 256, (2, 8))
    with torch.no_grad():
        before = engine(x)
    engine.unshard()
    engine.unshard(engine.module.blocks[0])
    engine.reshard()
    engine.reshard()
    with engine.unsharded() as model, torch.no_grad():
        assert model is engine.module
        assert torch.equal(engine(x), before)
    with engine.unsharded(engine.module.ln_f) as ln_f:
        assert ln_f is engine.module.ln_f
    engine.backward(engine(x, x))
    engine.step()  # never refused: nothing is unsharded at these stages
    assert engine.global_steps == 1
