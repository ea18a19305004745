"""The hybrid engine in one process (a world of one): the `hybrid_engine` section (DeepSpeed's keys and
defaults, the refused settings, inference_tp_size's checks; enable_cuda_graph's are in
test_hybrid_cuda_graph.py), which initialize() builds it, generate at stage 0 and at stage 3 with the gather machinery on (pinned and layer by layer), LoRA fused and restored
exactly, max_out_tokens, the timing line, destroy, and the DeepSpeed names. World size 2 runs in
tests/distributed/test_hybrid_engine.py."""

import copy
import logging

import pytest
import torch

import lightspeed
from lightspeed.config import ConfigError, load
from lightspeed.hybrid import HybridEngine, fused_lora, lora_modules
from lightspeed.runtime.initialize import initialize as runtime_initialize
from lightspeed.testing.lora import LinearLayer_LoRA, convert_lora_to_linear_layer
from lightspeed.zero.stage3 import options as stage3_options

pytestmark = pytest.mark.timeout(120)

transformers = pytest.importorskip("transformers")

from tests.distributed.test_hybrid_engine import GEN, RELEASE_ALL, config, dschat_lora, peft_lora, tiny_opt  # noqa: E402
from tests.distributed.test_stage3 import GatherCounter  # noqa: E402

BASE = {"train_batch_size": 2}


def _init(model, cfg, initialize=lightspeed.initialize):
    """A world of one without a process group (none is left behind for later tests)."""
    return initialize(model=model, config=cfg, dist_init_required=False)


@pytest.fixture(autouse=True)
def gather_machinery_at_one_rank(monkeypatch):
    """At a world of one, stage 3's parameters would view their shards (never gathered); turn that off so
    the gather / release path runs as at any larger world."""
    monkeypatch.setattr(stage3_options, "ONE_RANK_VIEWS", False)


# ------------------------------------------------------------------ config
def test_section_has_deepspeeds_keys_and_defaults():
    he = load(BASE, world_size=1).hybrid_engine
    assert he.model_dump() == {"enabled": False, "max_out_tokens": 512, "inference_tp_size": 1,
                               "release_inference_cache": False, "pin_parameters": True,
                               "tp_gather_partition_size": 8, "enable_cuda_graph": False}


def test_enabled_loads_and_unbuilt_settings_are_refused_by_name():
    cfg = load({**BASE, "hybrid_engine": {"enabled": True, "max_out_tokens": 64, "release_inference_cache": True,
                                          "pin_parameters": False, "tp_gather_partition_size": 4}}, world_size=1)
    assert cfg.hybrid_engine.enabled and cfg.hybrid_engine.max_out_tokens == 64
    assert load({**BASE, "hybrid_engine": {"enabled": True, "inference_tp_size": 2}},
                world_size=1).hybrid_engine.inference_tp_size == 2
    with pytest.raises(NotImplementedError, match=r"^hybrid_engine.tp_gather_partition_size=4 .*not implemented"):
        load({**BASE, "hybrid_engine": {"enabled": True, "inference_tp_size": 2, "tp_gather_partition_size": 4}},
             world_size=1)
    # DeepSpeed reads the section only when the engine is enabled
    load({**BASE, "hybrid_engine": {"inference_tp_size": 2, "enable_cuda_graph": True, "tp_gather_partition_size": 4}},
         world_size=1)
    with pytest.raises(ConfigError, match="hybrid_engine.max_out_token"):
        load({**BASE, "hybrid_engine": {"enabled": True, "max_out_token": 64}}, world_size=1)
    with pytest.raises(ConfigError, match="hybrid_engine.max_out_tokens"):
        load({**BASE, "hybrid_engine": {"max_out_tokens": 0}}, world_size=1)


def test_initialize_builds_the_hybrid_engine_only_when_enabled():
    engine, *_ = _init(tiny_opt(), config(1, 0))
    assert type(engine) is HybridEngine
    plain = {**config(1, 0), "hybrid_engine": {"enabled": False}}
    assert type(_init(tiny_opt(), plain)[0]) is not HybridEngine
    with pytest.raises(ConfigError, match=r"^hybrid_engine.enabled: .*lightspeed.initialize"):
        _init(tiny_opt(), config(1, 0), runtime_initialize)
    with pytest.raises(ConfigError, match=r"^hybrid_engine.inference_tp_size: 2 does not divide the world size 1"):
        _init(tiny_opt(), config(1, 0, inference_tp_size=2))
    with pytest.raises(ConfigError, match=r"^hybrid_engine.inference_tp_size: .*pin_parameters true"):
        _init(tiny_opt(), config(1, 3, inference_tp_size=2, pin_parameters=False))
    pytest.importorskip("peft")
    with pytest.raises(NotImplementedError, match=r"^hybrid_engine.inference_tp_size > 1 with PEFT"):
        _init(peft_lora(tiny_opt()), config(1, 0, inference_tp_size=2))
    from lightspeed.parallel.pipeline import PipelineModule

    pipe = PipelineModule(layers=[torch.nn.Linear(4, 4)], num_stages=1, loss_fn=torch.nn.MSELoss())
    with pytest.raises(ConfigError, match=r"^hybrid_engine.enabled: .*PipelineModule"):
        _init(pipe, config(1, 0))


def test_deepspeed_names():
    from lightspeed.compat import deepspeed as ds
    from lightspeed.compat.deepspeed.runtime.hybrid_engine import DeepSpeedHybridEngine

    assert DeepSpeedHybridEngine is HybridEngine and ds.DeepSpeedHybridEngine is HybridEngine
    assert issubclass(DeepSpeedHybridEngine, ds.DeepSpeedEngine)


# ------------------------------------------------------------------ generate
def _reference(engine, model_before):
    model_before.load_state_dict(engine.strategy.module_state_dict(), strict=False)
    return model_before.eval()


@pytest.mark.parametrize("stage,bf16,zero", [(0, False, None), (3, False, None), (3, True, None),
                                             (3, False, {"stage": 3}),
                                             (3, False, {**RELEASE_ALL, "stage": 3,
                                                         "zero_quantized_nontrainable_weights": True})],
                         ids=["stage0", "stage3", "stage3-bf16", "stage3-persistent", "stage3-int8-frozen"])
def test_generate_with_lora_fuses_and_restores_exactly(stage, bf16, zero):
    """`stage3-persistent`: stage 3's default thresholds, under which this model's groups stay gathered
    between forwards, so the fused weights are the ones training reads next; `stage3-int8-frozen`:
    DeepSpeed-Chat's `enable_mixed_precision_lora` (the frozen base weights stored in int8)."""
    persistent = zero is not None and "stage3_param_persistence_threshold" not in zero
    model = dschat_lora(tiny_opt())
    reference = copy.deepcopy(model).to(torch.bfloat16 if bf16 else torch.float32)
    cfg = {**config(1, stage), "bf16": {"enabled": bf16}}
    if zero is not None:
        cfg["zero_optimization"] = zero
    engine, *_ = _init(model, cfg)
    assert len(lora_modules(engine.module)) == 12
    x = torch.randint(4, 96, (2, 8))
    loss = engine(input_ids=x, labels=x).loss
    engine.backward(loss)
    engine.step()
    engine.eval()
    before = {k: v.clone() for k, v in engine.strategy.module_state_dict().items()}
    whole = {n: p.detach().clone() for n, p in engine.module.named_parameters()}  # stage 3: what stays gathered
    with torch.no_grad():
        loss_before = engine(input_ids=x, labels=x).loss
    prompt = torch.randint(4, 96, (2, 5), generator=torch.Generator().manual_seed(3))
    counter = GatherCounter(engine.strategy.groups) if stage == 3 else None
    out = engine.generate(prompt, output_scores=True, return_dict_in_generate=True, **GEN)
    if counter is not None and not persistent:  # one gather per group for the whole generate, released after
        assert sorted(counter.gathers) == sorted(g.name for g in engine.strategy.groups)
        assert all(g.state == "released" for g in engine.strategy.groups)
    if persistent:  # nothing to gather: the groups stayed gathered, and were fused and restored in place
        assert counter.gathers == [] and all(g.state != "released" for g in engine.strategy.groups)
    after = engine.strategy.module_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(torch.equal(whole[n], p) for n, p in engine.module.named_parameters())
    with torch.no_grad():
        assert torch.equal(engine(input_ids=x, labels=x).loss, loss_before)
    assert not any(m.fuse_lora for m in engine.module.modules() if isinstance(m, LinearLayer_LoRA))
    merged = convert_lora_to_linear_layer(_reference(engine, reference))
    with torch.no_grad():
        expected = merged.generate(prompt, output_scores=True, return_dict_in_generate=True, **GEN)
    assert torch.equal(out.sequences, expected.sequences)
    assert all(torch.equal(a, b) for a, b in zip(out.scores, expected.scores))


def test_unpinned_stage3_gathers_layer_by_layer_and_generates_the_same():
    model = tiny_opt()
    reference = copy.deepcopy(model)
    cfg = config(1, 3, pin_parameters=False, release_inference_cache=True)
    engine, *_ = _init(model, cfg)
    engine.eval()
    counter = GatherCounter(engine.strategy.groups)
    prompt = torch.randint(4, 96, (2, 5), generator=torch.Generator().manual_seed(3))
    out = engine.generate(prompt, **GEN)
    assert len(counter.gathers) > len(engine.strategy.groups)  # gathered and released per forward
    with torch.no_grad():
        assert torch.equal(out, _reference(engine, reference).generate(prompt, **GEN))


def test_max_out_tokens_bounds_a_generate_call():
    engine, *_ = _init(tiny_opt(), config(1, 0, max_out_tokens=10))
    prompt = torch.randint(4, 96, (1, 5))
    assert engine.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=1).shape[1] <= 10
    with pytest.raises(ValueError, match=r"^hybrid_engine.max_out_tokens: .* 11 tokens"):
        engine.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=1)
    with pytest.raises(ValueError, match="hybrid_engine.max_out_tokens"):
        engine.generate(prompt, max_length=12, do_sample=False, pad_token_id=1)


def test_timing_line_at_eval(caplog):
    logger = logging.getLogger("lightspeed")
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.INFO, logger="lightspeed")
    try:
        engine, *_ = _init(tiny_opt(), config(1, 0))
        prompt = torch.randint(4, 96, (2, 5))
        for _ in range(2):
            engine.eval()
            engine.generate(prompt, **GEN)
            engine.train()
            loss = engine(input_ids=prompt, labels=prompt).loss
            engine.backward(loss)
            engine.step()
        engine.eval()
    finally:
        logger.removeHandler(caplog.handler)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("|E2E latency=")]
    assert len(lines) == 2
    for part in ("|Gather latency=", "|Generate time=", "|Training time=", "|Others=", "|Generated tokens/s",
                 "|CurSamplesPerSec=", "|AvgSamplesPerSec="):
        assert part in lines[-1], lines[-1]


def test_model_without_generate_and_destroy():
    engine, *_ = _init(torch.nn.Linear(4, 4), config(1, 0))
    with pytest.raises(TypeError, match="has no generate method"):
        engine.generate(torch.zeros(1, 4))
    engine, *_ = _init(tiny_opt(), config(1, 0))
    model = engine.module
    calls = []
    engine.generate = lambda *a, **k: calls.append(a)  # what the model's generate reaches
    model.generate(torch.zeros(1, 2, dtype=torch.long))
    assert len(calls) == 1
    # a copy of the model (a reference model) generates on its own, without the engine
    copied = copy.deepcopy(model)
    assert copied.generate.__self__ is copied and copied.generate.__func__ is type(model).generate
    del engine.generate
    engine.destroy()
    assert "generate" not in vars(model) and model.generate.__func__ is type(model).generate


def test_fused_lora_restores_on_an_exception():
    model = dschat_lora(tiny_opt())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(RuntimeError, match="inside"):
        with fused_lora(model) as count:
            assert count == 12 and all(m.fuse_lora for m in lora_modules(model))
            raise RuntimeError("inside")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not any(m.fuse_lora for m in lora_modules(model))
