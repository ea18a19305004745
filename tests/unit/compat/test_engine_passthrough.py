"""DeepSpeed's engine surface beyond the training step, on a real `initialize()`d engine (world size 1,
in process): attribute passthrough to the wrapped module (a Hugging Face model's `generate`,
`gradient_checkpointing_enable`, `config_class`, `.model`), the engine's own names winning, unknown
names raising AttributeError naming the engine class, and `engine.tput_timer`."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

import lightspeed
from lightspeed._utils.timers import ThroughputTimer
from lightspeed.config.monitoring import ThroughputTimerConfig
from lightspeed.testing.models import TinyMLP, regression_data

pytestmark = pytest.mark.timeout(180)

CONFIG = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**6,
          "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}}


def _llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=64))


class Wrapped(TinyMLP):
    """TinyMLP with attributes the engine also has (`config`, `step`) and a property that fails."""

    config = "the module's config"
    marker = 7

    def step(self):
        raise AssertionError("the module's step must not be reached through the engine")

    def shout(self, word: str) -> str:
        return word.upper()


def test_hf_model_attributes_pass_through():
    model = _llama()
    engine, *_ = lightspeed.initialize(model=model, config=CONFIG, dist_init_required=False)
    assert engine.config_class is transformers.LlamaConfig
    assert engine.model is model.model and engine.lm_head is model.lm_head  # a submodule of the module
    assert not model.is_gradient_checkpointing
    engine.gradient_checkpointing_enable()
    assert model.is_gradient_checkpointing and engine.is_gradient_checkpointing
    model.gradient_checkpointing_disable()
    ids = torch.tensor([[1, 2, 3]])
    out = engine.generate(ids, max_new_tokens=3, do_sample=False)
    assert torch.equal(out, model.generate(ids, max_new_tokens=3, do_sample=False)) and out.shape == (1, 6)


def test_engine_names_win_and_unknown_names_raise():
    model = Wrapped()
    engine, *_ = lightspeed.initialize(model=model, config=CONFIG, dist_init_required=False)
    assert engine.marker == 7 and engine.shout("a") == "A"
    assert engine.config is not Wrapped.config and engine.config.train_batch_size == 2  # the engine's own
    assert engine.module is model and engine.fc1 is model.fc1  # through nn.Module's submodule lookup
    x, y = regression_data(2)
    engine.backward(engine(x, y))
    engine.step()  # the engine's step, not the module's (which raises)
    assert engine.global_steps == 1
    with pytest.raises(AttributeError, match="'LightspeedEngine' object has no attribute 'no_such_name'"):
        engine.no_such_name
    assert not hasattr(engine, "no_such_name") and hasattr(engine, "shout")


def test_an_engine_property_failing_is_not_answered_by_the_module(monkeypatch):
    model = Wrapped()
    model.global_rank = "the module's"
    engine, *_ = lightspeed.initialize(model=model, config=CONFIG, dist_init_required=False)
    assert engine.global_rank == 0
    monkeypatch.setattr(engine, "groups", object(), raising=False)  # global_rank's getter now raises
    with pytest.raises(AttributeError, match="world_rank"):
        engine.global_rank


def test_dunder_probes_see_the_engine_not_the_module():
    class Probed(TinyMLP):
        def __deepcopy__(self, memo):
            raise AssertionError("reached the module's __deepcopy__")

    model = Probed()
    engine, *_ = lightspeed.initialize(model=model, config=CONFIG, dist_init_required=False)
    assert hasattr(model, "__deepcopy__") and getattr(engine, "__deepcopy__", None) is None
    assert copy.copy(engine).module is model  # copy's probes (__reduce_ex__, __deepcopy__...) are the engine's


def test_tput_timer_measures_the_timed_steps():
    engine, *_ = lightspeed.initialize(model=TinyMLP(), config={**CONFIG, "train_batch_size": 6,
                                                               "gradient_accumulation_steps": 3},
                                       dist_init_required=False)
    timer = engine.tput_timer
    assert timer.batch_size == 6 and timer.start_step == 2
    assert timer.avg_samples_per_sec() == float("-inf")  # nothing timed yet
    x, y = regression_data(6)
    for step in range(5):
        for micro in range(3):
            engine.backward(engine(x[2 * micro:2 * micro + 2], y[2 * micro:2 * micro + 2]))
            engine.step()
        if step < 2:  # the warm-up steps are not timed
            assert timer.total_elapsed_time == 0 and timer.avg_samples_per_sec() == float("-inf")
    assert (timer.global_step_count, timer.micro_step_count) == (5, 15)
    assert timer.total_elapsed_time > 0 and not timer.started
    assert timer.avg_samples_per_sec() == pytest.approx(6 * 3 / timer.total_elapsed_time)
    timer.update_epoch_count()
    assert (timer.epoch_count, timer.micro_step_count) == (1, 0)


def test_tput_timer_disabled_by_config():
    config = {**CONFIG, "timers": {"throughput": {"enabled": False}}}
    engine, *_ = lightspeed.initialize(model=TinyMLP(), config=config, dist_init_required=False)
    x, y = regression_data(2)
    for _ in range(4):
        engine.backward(engine(x, y))
        engine.step()
    assert engine.tput_timer.global_step_count == 0 and engine.tput_timer.avg_samples_per_sec() == float("-inf")


def test_throughput_timer_counts_micro_and_global_steps_without_an_engine():
    timer = ThroughputTimer(ThroughputTimerConfig(synchronized=False), batch_size=4, device=torch.device("cpu"),
                            start_step=0)
    timer.stop(global_step=True)  # not started: nothing counted
    assert timer.micro_step_count == 0
    timer.start()
    timer.stop(global_step=False)
    timer.start()
    timer.stop(global_step=True)
    assert (timer.micro_step_count, timer.global_step_count) == (2, 1) and timer.step_elapsed_time == 0
    assert timer.avg_samples_per_sec() == pytest.approx(4 / timer.total_elapsed_time)
