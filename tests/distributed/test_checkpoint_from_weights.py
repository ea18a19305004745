"""A Hugging Face model's safetensors, converted by `lightspeed convert from-hf`, start a run at any world
size and stage: the engine's parameters equal the saved weights, and the optimizer starts fresh."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import lightspeed
from lightspeed.testing.run_world import run_world

pytestmark = pytest.mark.dist


def _tiny_gpt2(seed: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(vocab_size=97, n_positions=16, n_embd=24, n_layer=2, n_head=2))


def _load_worker(save_dir: str, stage: int):
    model = _tiny_gpt2(seed=99)
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": stage}}
    engine, *_ = lightspeed.initialize(model=model, config=config)
    engine.load_checkpoint(save_dir)
    state = {k: v.clone() for k, v in engine.strategy.module_state_dict().items()}
    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(0))
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    return state, engine.global_steps


@pytest.mark.parametrize("world, stage", [(2, 3), (1, 0)])
def test_from_hf_checkpoint_starts_a_run(tmp_path, world, stage):
    model = _tiny_gpt2(seed=1)
    model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    out = subprocess.run([sys.executable, "-m", "lightspeed.launcher.cli", "convert", "from-hf", str(tmp_path / "hf"),
                          str(tmp_path / "ckpt")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    state, steps = run_world(_load_worker, world, str(tmp_path / "ckpt"), stage)[0]
    assert steps == 1
    want = model.state_dict()
    for name, value in state.items():
        assert torch.equal(value, want[name]), name


def test_from_hf_refuses_a_directory_without_weights(tmp_path):
    out = subprocess.run([sys.executable, "-m", "lightspeed.launcher.cli", "convert", "from-hf", str(tmp_path),
                          str(tmp_path / "ckpt")], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "no safetensors weights" in out.stderr and len(out.stderr.strip().splitlines()) == 1
