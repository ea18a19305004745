"""`lightspeed --autotuning run` on a tiny GPT over 2 CPU processes: the memory model prunes a grid point
without running it, the trials run through the launcher, the fastest trial's config is written and the
training then runs with it. And the pieces without processes: the space, the memory model, the search."""

import json
import random

import pytest

from lightspeed.autotuning.driver import Autotuner, _line, _with_config, user_config_path
from lightspeed.autotuning.memory import Calibration, MemoryModel
from lightspeed.autotuning.space import Candidate, Family, space_from_config
from lightspeed.config.errors import ConfigError
from lightspeed.launcher.cli import _without_autotuning
from tests.launcher.conftest import SCRIPTS, run_cli

CONFIG = {
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "zero_optimization": {"stage": [0, 1]},
    "autotuning": {"enabled": True, "start_profile_step": 1, "end_profile_step": 2, "max_train_micro_batch_size_per_gpu": 16,
                   "num_tuning_micro_batch_sizes": 2},
}


@pytest.mark.dist
@pytest.mark.slow
def test_tune_then_run_a_tiny_gpt_on_two_processes(tmp_path, home):
    (tmp_path / "ds.json").write_text(json.dumps(CONFIG))
    out = tmp_path / "trained.json"
    # per rank: the model states ~0.44 MiB, activations ~0.19 MiB per sample: micro 16 cannot fit 2.5 MB
    proc = run_cli(["--num_procs", "2", "--autotuning", "run", "--autotuning_memory_budget", "2500000",
                    SCRIPTS / "autotune_gpt.py", "--deepspeed_config", "ds.json", "--steps", "3", "--out", out],
                   cwd=tmp_path, home=home, timeout=300, OMP_NUM_THREADS="1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    trials = json.loads((tmp_path / "autotuning_results" / "trials.json").read_text())
    by_name = {t["name"]: t for t in trials}
    for stage in (0, 1):
        pruned = by_name[f"z{stage}_mb16_gas1"]
        assert pruned["status"] == "pruned" and "budget" in pruned["reason"] and pruned["predicted_bytes"] > 2500000
        assert not (tmp_path / "autotuning_exps" / f"z{stage}_mb16_gas1").exists()  # never ran
    ran = [t for t in trials if t["status"] == "ok"]
    assert {t["name"] for t in ran} == {"z0_mb8_gas1", "z0_mb4_gas1", "z1_mb8_gas1", "z1_mb4_gas1"}
    assert all(t["metrics"]["tokens_per_s"] == pytest.approx(t["metrics"]["throughput"] * 16) for t in ran)
    best = max(ran, key=lambda t: t["metrics"]["throughput"])
    optimal = json.loads((tmp_path / "autotuning_results" / "ds_config_optimal.json").read_text())
    stage, micro = int(best["name"][1]), int(best["name"].split("_mb")[1].split("_")[0])
    assert (optimal["zero_optimization"]["stage"], optimal["train_micro_batch_size_per_gpu"]) == (stage, micro)
    assert optimal["autotuning"]["enabled"] is False
    table = (tmp_path / "autotuning_results" / "trials.md").read_text()
    assert f"| {best['name']} (best) |" in table and "pruned" in table
    trained = json.loads(out.read_text())  # `run`: the whole training with the best config
    assert (trained["stage"], trained["micro"], len(trained["losses"])) == (stage, micro, 3)


def test_space_reads_deepspeeds_lists_and_all():
    space = space_from_config({"zero_optimization": {"stage": "all", "offload_optimizer": {"device": ["none", "cpu"]}},
                               "compile": {"enabled": [False, True]}, "gradient_accumulation_steps": [1, 2],
                               "autotuning": {"min_train_micro_batch_size_per_gpu": 2,
                                              "max_train_micro_batch_size_per_gpu": 24, "max_train_batch_size": 64,
                                              "arg_mappings": {"activation_checkpointing": "--ckpt"}}}, dp=2)
    assert {f.stage for f in space.families} == {0, 1, 2, 3}
    assert not any(f.offload and f.stage == 0 for f in space.families)
    assert len(space.families) == (4 + 3) * 2 * 2  # stage x offload (not at 0) x compile x checkpointing
    assert space.micro_grid == [2, 4, 8, 16, 24]
    assert space.gas_for(16) == [1, 2] and space.gas_for(24) == [1]  # micro x gas x dp within 64
    cand = Candidate(Family(2, True, True, True), 8, 2)
    cfg = space.ds_config(cand, True, 3, 5)
    assert cfg["zero_optimization"] == {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    assert (cfg["train_batch_size"], cfg["compile"]["enabled"], cfg["autotuning"]["enabled"]) == (32, True, True)
    assert space.script_args(cand) == ["--ckpt"]
    fixed = space_from_config({"train_batch_size": 48, "autotuning": {"max_train_micro_batch_size_per_gpu": 8}}, dp=2)
    assert [m for m in fixed.micro_grid if fixed.gas_for(m)] == [1, 2, 4, 8] and fixed.gas_for(8) == [3]
    with pytest.raises(ConfigError, match="zero_optimization.stage"):
        space_from_config({"zero_optimization": {"stage": 5}}, dp=1)


def test_memory_model_reshards_a_calibration_for_every_stage():
    model = MemoryModel("cuda")
    # stage 1 at dp 4: master and optimizer state are quarters on the device
    model.fit(Calibration(stage=1, micro=2, dp=4, breakdown={"cuda": {"lp_params": 200, "master_params": 100,
                                                                       "grads": 200, "optimizer_state": 200}},
                          activation_bytes=60, peak_bytes=900), ckpt=False)
    assert model.totals == {"lp_params": 200, "master_params": 400, "grads": 200, "optimizer_state": 800}
    assert model.overhead == 900 - 700 - 60
    assert model.predict(0, False, False, 4, 4) == 1600 + 120 + 140
    assert model.predict(3, False, False, 1, 4) == (200 + 400 + 200 + 800) // 4 + 30 + 140
    assert model.predict(2, True, False, 1, 4) == 200 + 50 + 30 + 140  # offload: master, optimizer on the host
    assert not model.ready(True)


def test_search_order_and_helpers(tmp_path):
    assert _line([(1, 3.0), (3, 7.0)]) == pytest.approx((1.0, 2.0))
    assert _with_config(["--x", "1", "--deepspeed_config", "a.json"], "b.json") == ["--x", "1", "--deepspeed_config",
                                                                                     "b.json"]
    assert _with_config(["--deepspeed=a.json"], "b.json") == ["--deepspeed=b.json"]
    with pytest.raises(ConfigError, match="--deepspeed_config"):
        user_config_path(["--steps", "3"])
    assert _without_autotuning(["--num_procs", "2", "--autotuning", "run", "--autotuning_memory_budget=9"]) == \
        ["--num_procs", "2"]
    tuner = Autotuner({"autotuning": {"tuner_type": "model_based"}, "zero_optimization": {"stage": [0, 1]}}, [],
                      "s.py", ["--deepspeed_config", "x.json"], world_size=1, memory_budget=1 << 30, device_type="cpu")
    f0, f1 = tuner.space.families
    done = [(Candidate(f0, 1, 1), {"latency": 10.0}), (Candidate(f0, 2, 1), {"latency": 12.0})]
    pending = [(Candidate(f0, 4, 1), 0), (Candidate(f0, 8, 1), 0), (Candidate(f1, 8, 1), 0)]
    assert tuner._next(pending, done, random.Random(0))[0] == Candidate(f1, 8, 1)  # the untried family first
    assert tuner._next(pending, done, random.Random(0))[0] == Candidate(f0, 8, 1)  # 8 / 16 ms beats 4 / 12 ms
    with pytest.raises(ConfigError, match="autotuning.metric"):
        Autotuner({"autotuning": {"metric": "speed"}}, [], "s.py", ["--deepspeed", "x.json"], 1, 1, "cpu")
    with pytest.raises(NotImplementedError, match="autotuning.fast=false"):
        Autotuner({"autotuning": {"fast": False}}, [], "s.py", ["--deepspeed", "x.json"], 1, 1, "cpu")
    with pytest.raises(ConfigError, match="autotuning.mp_size"):
        Autotuner({"autotuning": {"mp_size": 2}}, [], "s.py", ["--deepspeed", "x.json"], 3, 1, "cpu")


def test_autotune_subcommand_is_autotuning_tune_and_needs_the_config_flag(cli):
    code, _, err = cli("autotune", "--num_procs", "2", SCRIPTS / "autotune_gpt.py", "--steps", "3")
    assert code == 2 and "--deepspeed_config FILE" in err
    code, _, err = cli("--autotuning", "tune", "--num_procs", "2", SCRIPTS / "autotune_gpt.py", "--deepspeed_config",
                       "missing.json")
    assert code == 2 and "missing.json" in err
