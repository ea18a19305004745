"""DeepSpeed-Chat's RLHF step 3 (training/step3_rlhf_finetuning/main.py and the `dschat` package,
vendored in tests/fixtures/deepspeed_chat/, see its README.md for what was changed) run unchanged under
`lightspeed --as_deepspeed` on 2 gloo processes: actor and critic at ZeRO-3, the hybrid engine on,
tiny OPT-style models and a prompt set written offline (tests/fixtures/deepspeed_chat/make_inputs.py).

What it exercises of DeepSpeed: `deepspeed.initialize` four times (actor with `hybrid_engine` and an
optimizer and LR scheduler from outside, reference, critic, reward), `FusedAdam`,
`HfDeepSpeedConfig` (ZeRO-3 `from_pretrained` / `from_config`), `GatheredParameters(modifier_rank=0)`
loading the critic's checkpoint, `actor.module.generate(..., synced_gpus=True)` through the hybrid
engine, `eval()` / `train()`, `engine.forward_value(...)` on the ZeRO-3 critic and reward models
(module_passthrough.py's Note: [forward methods]), backward / step, `add_config_arguments`,
`get_accelerator()` as the CPU, and at the end `save_zero_three_model` (param_group.py's Note: values
taken inside GatheredParameters), whose saved weights are checked here against the models' shapes.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.no_real_deepspeed, pytest.mark.dist, pytest.mark.slow, pytest.mark.timeout(300)]

pytest.importorskip("transformers")
pytest.importorskip("datasets")
pytest.importorskip("tokenizers")

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "tests" / "fixtures" / "deepspeed_chat"
STEPS = 2


def _make_inputs(root: Path) -> dict[str, str]:
    sys.path.insert(0, str(FIXTURE))
    try:
        from make_inputs import make_inputs
    finally:
        sys.path.remove(str(FIXTURE))
    return make_inputs(str(root))


def test_step3_rlhf_runs_unchanged_at_zero3_with_the_hybrid_engine(tmp_path):
    from tests.launcher.conftest import clean_env

    paths = _make_inputs(tmp_path / "inputs")
    home, out, logs = tmp_path / "home", tmp_path / "out", tmp_path / "logs"
    home.mkdir()
    args = ["--as_deepspeed", "--num_procs", "2", "--enable_each_rank_log", logs,
            FIXTURE / "training" / "step3_rlhf_finetuning" / "main.py",
            "--data_path", paths["data"], "--data_split", "2,4,4", "--data_output_path", tmp_path / "data_cache",
            "--actor_model_name_or_path", paths["actor"], "--critic_model_name_or_path", paths["critic"],
            "--num_padding_at_beginning", "1", "--per_device_generation_batch_size", "2",
            "--per_device_training_batch_size", "2", "--generation_batches", "1", "--ppo_epochs", "1",
            "--max_prompt_seq_len", "16", "--max_answer_seq_len", "8",
            "--actor_zero_stage", "3", "--critic_zero_stage", "3", "--enable_hybrid_engine", "--dtype", "bf16",
            "--num_warmup_steps", "0", "--seed", "1234", "--enable_test_mode", "--test_stop_step", str(STEPS),
            "--output_dir", out]
    # PYTHONPATH: this checkout and the fixture's root, where `pip install -e .` of DeepSpeed-Chat puts dschat
    env = clean_env(home, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = f"{REPO}:{FIXTURE}"
    proc = subprocess.run([sys.executable, "-m", "lightspeed.launcher.cli", *map(str, args)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=240)
    text = proc.stdout + proc.stderr + "".join(f"\n== {p.name}\n{p.read_text()}" for p in sorted(logs.glob("*.log")))
    assert proc.returncode == 0, text[-6000:]

    assert "registered lightspeed as deepspeed" in text
    assert "hybrid engine: ZeRO stage 3" in text
    assert text.count("engine ready: ZeRO stage 3") >= 4  # actor, reference, critic, reward (rank 0's lines)
    losses = re.findall(r"Epoch: 0 \| Step: (\d+) \| PPO Epoch: 1 \| Actor Loss: (\S+) \| Critic Loss: (\S+) \|", text)
    rewards = re.findall(r"Average reward score: (\S+) \| EMA reward score: (\S+)", text)
    assert [int(step) for step, *_ in losses] == list(range(STEPS)), text[-3000:]
    assert len(rewards) == STEPS
    for _, actor, critic in losses:
        assert math.isfinite(float(actor)) and math.isfinite(float(critic)) and float(critic) > 0
    assert all(math.isfinite(float(r)) for pair in rewards for r in pair)

    # save_zero_three_model: the whole (gathered) weights, every parameter of each model
    for name in ("actor", "critic"):
        state = torch.load(out / name / "pytorch_model.bin", map_location="cpu")
        prefix = "model." if name == "actor" else "rwtransformer."
        embed = state[f"{prefix}decoder.embed_tokens.weight"]
        assert embed.shape[1] == 32 and embed.shape[0] % 8 == 0
        assert all(t.numel() > 0 and torch.isfinite(t.float()).all() for t in state.values())
    assert state["v_head.weight"].shape == (1, 32)
