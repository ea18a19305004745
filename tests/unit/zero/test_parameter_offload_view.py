"""DeepSpeed's ZeRO-3 internals that TRL's `unwrap_model_for_generation` touches, as lightspeed's compat
layer answers them (compat/deepspeed/runtime/zero/parameter_offload.py), at a world of one with the
gather machinery on (conftest.py): `engine.optimizer.parameter_offload` (hook handles, removal standing
for `unsharded()`, re-registration), the trace queries, `ds_external_parameters` and
`ds_active_sub_modules`. TRL's own trainers run in tests/distributed/test_trl.py."""

import pytest
import torch

from lightspeed.compat import deepspeed as ds
from lightspeed.zero import GatheredParameters, register_external_parameter
from tests.distributed.test_stage3 import RELEASE_ALL, GatherCounter, build_model, config

pytestmark = pytest.mark.timeout(120)


def _engine(stage=3):
    engine, *_ = ds.initialize(model=build_model("gpt"), config=config(1, stage, zero=RELEASE_ALL),
                               dist_init_required=False)
    return engine


def _train_step(engine, x):
    engine.backward(engine(x).float().pow(2).mean())
    engine.step()


def _gathered(engine) -> list[str]:
    return [g.name for g in engine.strategy.groups if g.state != "released"]


def test_trl_generation_sequence():
    """TRL's remove_hooks / add_hooks, step by step, inside a GatheredParameters of the whole model."""
    engine = _engine()
    offload, model = engine.optimizer.parameter_offload, engine.module
    coordinator = offload.get_param_coordinator()
    assert offload.module is model and len(offload.forward_hooks) == len(offload.backward_hooks) == 1
    x = torch.randint(0, 256, (2, 8))
    assert coordinator.is_invalid_trace()  # nothing recorded before the first forward+backward
    _train_step(engine, x)
    assert coordinator.is_complete_trace() and not coordinator.is_invalid_trace()
    counter = GatherCounter(engine.strategy.groups)

    with GatheredParameters(list(engine.parameters())):
        params = [p for _, p in model.named_parameters()] + [p for _, p in model.ds_external_parameters()]
        for p in params:
            assert len(p.ds_active_sub_modules) == 0  # no forward runs: nothing holds a parameter
            p.ds_active_sub_modules.clear()
        for hook in (*offload.forward_hooks, *offload.backward_hooks):
            hook.remove()
        offload.forward_hooks, offload.backward_hooks = [], []
        counter.reset()
        with torch.no_grad():
            first = model(x)
            assert torch.equal(model(x), first)  # "generation": forwards with no gather and no release
        assert counter.gathers == [] and counter.releases == []
        with pytest.raises(RuntimeError, match="unsharded"):
            engine.step()  # the hooks are out: no step, as in DeepSpeed
        coordinator._invalidate_trace()  # TRL's add_hooks
        assert coordinator.is_invalid_trace()
        with pytest.raises(RuntimeError, match="already invalid"):
            coordinator._invalidate_trace()
        offload._register_deepspeed_module(offload.module)
        assert len(offload.forward_hooks) == len(offload.backward_hooks) == 1
        assert _gathered(engine) != []  # still held by the GatheredParameters
    assert _gathered(engine) == []  # resharded: the removal's unsharded() and the gather are both gone

    with pytest.raises(RuntimeError, match="in place already"):
        offload._register_deepspeed_module(model)
    with pytest.raises(ValueError, match="whole model"):
        offload._register_deepspeed_module(model.blocks[0])
    _train_step(engine, x)  # training goes on; the restarted trace is recorded again
    assert coordinator.is_complete_trace()


def test_active_sub_modules_inside_a_forward():
    engine = _engine()
    model = engine.module
    seen = {}

    def probe(module, args):
        p = module.attn.c_attn.weight if hasattr(module, "attn") else next(module.parameters())
        seen["ids"] = set(p.ds_active_sub_modules)
        with pytest.raises(RuntimeError, match="running forward"):
            p.ds_active_sub_modules.clear()
        seen["cleared"] = True

    model.blocks[0].register_forward_pre_hook(probe)  # after the coordinator's: the block holds its group
    with torch.no_grad():
        engine(torch.randint(0, 256, (2, 8)))
    assert id(model.blocks[0]) in seen["ids"] and seen["cleared"]
    assert all(len(p.ds_active_sub_modules) == 0 for p in model.parameters())


def test_external_parameters():
    engine = _engine()
    model = engine.module
    assert model.ds_external_parameters() == []  # the root's subtree holds every parameter
    assert model.blocks[0].ds_external_parameters() == []
    register_external_parameter(model.blocks[0], model.wte.weight)
    # gathered a group at a time: the block now gathers wte's group (the root unit's) around its forward
    external = model.blocks[0].ds_external_parameters()
    assert all(key == id(p) for key, p in external)  # DeepSpeed's (id, parameter) pairs
    assert any(p is model.wte.weight for _, p in external)
    own = {id(p) for p in model.blocks[0].parameters()}
    assert external and all(id(p) not in own for _, p in external)


def test_only_stage3_engines_get_a_parameter_offload():
    engine = _engine(stage=2)
    assert not hasattr(engine.optimizer, "parameter_offload")
    assert engine.strategy.trace_complete() is False and engine.strategy.external_parameters(engine.module) == []


def test_deepspeed_unwrap_model_for_generation_takes_the_hooks_out_for_the_block():
    from lightspeed.compat.deepspeed.runtime.zero import unwrap_model_for_generation

    engine = _engine()
    offload = engine.optimizer.parameter_offload
    x = torch.randint(0, 256, (2, 8))
    _train_step(engine, x)
    with unwrap_model_for_generation(engine) as unwrapped:
        assert unwrapped is engine and offload.forward_hooks == [] and offload.backward_hooks == []
        assert _gathered(engine) != [] and all(p.numel() > 0 for p in engine.module.parameters())
    assert len(offload.forward_hooks) == len(offload.backward_hooks) == 1 and _gathered(engine) == []
    _train_step(engine, x)  # training goes on with the hooks back


def test_persistent_parameters_are_whole_after_a_step_and_a_load(tmp_path):
    """DeepSpeed gathers its persistent parameters after each step and each checkpoint load."""
    engine, *_ = ds.initialize(model=build_model("gpt"), config=config(1, 3, zero={
        **RELEASE_ALL, "stage3_param_persistence_threshold": 10000}), dist_init_required=False)
    persistent = [p for p in engine.module.parameters() if p.ds_persist]
    assert persistent and len(persistent) < len(list(engine.module.parameters()))
    _train_step(engine, torch.randint(0, 256, (2, 8)))
    assert all(p.numel() == p.ds_numel for p in persistent)
    assert _gathered(engine) == [g.name for g in engine.strategy.groups if g.persistent]
    engine.save_checkpoint(tmp_path, tag="t")
    engine.load_checkpoint(tmp_path, tag="t")
    assert all(p.numel() == p.ds_numel for p in persistent)
    _train_step(engine, torch.randint(0, 256, (2, 8)))
    # the coordinator's count of gathered elements follows (the prefetch budget reads it)
    gathered = sum(g.numel for g in engine.strategy.groups if g.state != "released")
    assert engine.strategy.coordinator.live_numel == gathered
