"""Where the progress bars are used (each bar replaced by a recorder: it must end at its total), and
the ETA of the engine's step log line. One process, no process group."""

from __future__ import annotations

import logging

import pytest
import torch

import lightspeed
from lightspeed.testing.models import TinyMLP, regression_data


class Recorder:
    """Stands in for `progress(...)`: records the total, the updates and whether it was closed."""

    made: list["Recorder"] = []

    def __init__(self, iterable=None, *, total=None, desc="", **kwargs):
        self.iterable, self.desc, self.n, self.closed = iterable, desc, 0, False
        self.total = len(iterable) if total is None and iterable is not None else total
        Recorder.made.append(self)

    def __iter__(self):
        for item in self.iterable:
            yield item
            self.n += 1
        self.closed = True

    def update(self, n=1):
        self.n += n

    def close(self):
        self.closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@pytest.fixture
def bars(monkeypatch):
    Recorder.made = []
    for module in ("lightspeed.zero.stage3.strategy", "lightspeed.checkpoint.universal",
                   "lightspeed.inference.checkpoint", "lightspeed.inference.engine"):
        monkeypatch.setattr(f"{module}.progress", Recorder)
    return Recorder.made


STAGE3 = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 3},
          "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}


@pytest.mark.parametrize("under_init", [False, True])
def test_stage3_partitioning_bar_counts_every_parameter(bars, under_init):
    if under_init:
        initialized = torch.distributed.is_initialized()
        with lightspeed.zero.Init(seed=0):  # starts a world of one where a launcher's environment says so
            model = TinyMLP()
        if not initialized and torch.distributed.is_initialized():  # later tests expect no process group
            torch.distributed.destroy_process_group()
    else:
        model = TinyMLP()
    numel = sum(p.numel() for p in TinyMLP().parameters())
    lightspeed.initialize(model=model, config=STAGE3, dist_init_required=False)
    (bar,) = bars
    assert bar.total == bar.n == numel and bar.closed
    # under zero.Init the model was materialized and partitioned as the block ended: initialize() only
    # takes its groups over
    assert bar.desc == "ZeRO-3: partitioning parameters"


def test_engine_checkpoint_loading_bar_counts_the_files_bytes(bars, tmp_path):
    engine, *_ = lightspeed.initialize(model=TinyMLP(), config=STAGE3, dist_init_required=False)
    engine.save_checkpoint(tmp_path, tag="t")
    bars.clear()
    engine.load_checkpoint(tmp_path, tag="t")
    (bar,) = bars
    files = sum(f.stat().st_size for f in (tmp_path / "t").iterdir() if f.name.startswith("optim_states"))
    assert bar.total == bar.n == files and bar.closed and bar.desc == "loading checkpoint t"


def _train(engine, steps: int) -> None:
    x, y = regression_data(4)
    for _ in range(steps):
        engine.backward(engine(x, y))
        engine.step()


def _step_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]


def test_step_log_line_has_an_eta_when_the_number_of_steps_is_known(ls_caplog):
    ls_caplog.set_level(logging.INFO, logger="lightspeed")
    cosine = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 5,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
              "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 20, "warmup_num_steps": 2}}}
    engine, *_ = lightspeed.initialize(model=TinyMLP(), config=cosine, dist_init_required=False)
    assert engine.total_steps == 20
    _train(engine, 20)
    lines = _step_lines(ls_caplog)
    assert [line.split(":")[0] for line in lines] == ["step 5", "step 10", "step 15", "step 20"]
    assert all(" eta " in line for line in lines[:3]) and " eta " not in lines[3]  # nothing left at the end

    ls_caplog.clear()
    warmup = {**cosine, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 2}}}
    engine, *_ = lightspeed.initialize(model=TinyMLP(), config=warmup, dist_init_required=False)
    assert engine.total_steps is None  # WarmupLR has no end
    _train(engine, 5)
    engine.set_total_steps(100)
    assert engine.total_steps == 100
    _train(engine, 5)
    lines = _step_lines(ls_caplog)
    assert " eta " not in lines[0] and " eta " in lines[1]
    with pytest.raises(ValueError, match="num_steps must be a positive integer or None"):
        engine.set_total_steps(0)


def test_init_inference_bars_cover_the_checkpoint_bytes_and_each_quantized_layer(bars, tmp_path):
    transformers = pytest.importorskip("transformers")
    from lightspeed.inference import init_inference

    # Llama: tied parameters counted once, a non-persistent buffer (rotary inv_freq) not at all
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=160, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=96, max_position_embeddings=64,
                                   tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path, max_shard_size="40KB")
    with lightspeed.OnDevice(dtype=torch.float16, device="meta"):
        meta = transformers.LlamaForCausalLM(cfg)
    expected = 2 * sum(t.numel() for t in meta.state_dict().values() if t.is_floating_point()) \
        - 2 * meta.lm_head.weight.numel()  # the tied head is the embedding
    init_inference(meta, dtype=torch.float16, device="cpu", quant={"weight": "int8"}, checkpoint=str(tmp_path))
    (bar,) = bars
    assert bar.desc == "loading and quantizing the checkpoint" and bar.total == bar.n == expected and bar.closed

    bars.clear()
    torch.manual_seed(0)
    init_inference(transformers.LlamaForCausalLM(cfg), dtype=torch.float16, device="cpu", quant={"weight": "int8"})
    (bar,) = bars
    assert bar.desc == "quantizing to int8" and bar.n == bar.total == 14  # 7 linear layers per block
