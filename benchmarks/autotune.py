"""The autotuner against an exhaustive grid: its wall time, and the throughput of its pick next to the
best of every grid point run, on the same space; and DeepSpeed's autotuner when a DeepSpeed is given.

    python benchmarks/autotune.py [--preset gpt2-medium] [--seq 1024] [--stages 0 1 2 3] [--offload]
        [--compile] [--max-micro 64] [--num-micro 3] [--budget-gib 0] [--deepspeed-python PATH] [--smoke]

Every run is a fresh `lightspeed` launch of benchmarks/autotune_worker.py (one GPU, or 2 CPU processes
with --smoke). The autotuner: `lightspeed --autotuning tune` (one calibration run, memory pruning, the
`num_tuning_micro_batch_sizes` largest micro batches that fit per family). The grid: every (family,
micro batch) point of the same space run as an experiment, no pruning; a point that runs out of memory
counts as tried. Both measure with the same profile window (steps 3..5, DeepSpeed's default), so their
throughputs compare. `--deepspeed-python` (a Python with DeepSpeed installed, e.g. the venv of
`python -m lightspeed.testing.deepspeed_env`) also runs `deepspeed --autotuning tune` with the same
`autotuning` section on the worker under real DeepSpeed and reports its wall time and its pick's
throughput (its own metric file). `--smoke`: a tiny GPT on CPU, seconds per run.

On one H200 (each run is a fresh launch, ~20 s), within a 10-minute command:

    python benchmarks/autotune.py --preset gpt2 --stages 0 2 3 --max-micro 32 --num-micro 2

`--only tuner` / `--only grid` run one side (the grid's best is then not known / the tuner not run), to
split a larger space over two commands; the grid's per-point lines are printed as they finish.
`--only deepspeed --grid-best TPS` runs DeepSpeed's autotuner alone (its ratio against a grid measured
before).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lightspeed.autotuning.driver import Autotuner  # noqa: E402
from lightspeed.autotuning.space import Candidate  # noqa: E402

WORKER = Path(__file__).resolve().parent / "autotune_worker.py"
REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="gpt2-medium")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    p.add_argument("--offload", action="store_true", help="tune offload_optimizer (none, cpu) too")
    p.add_argument("--compile", action="store_true", help="tune compile.enabled (false, true) too")
    p.add_argument("--max-micro", type=int, default=64)
    p.add_argument("--num-micro", type=int, default=3)
    p.add_argument("--budget-gib", type=float, default=0, help="memory budget per rank (0: the device's)")
    p.add_argument("--deepspeed-python", default=None)
    p.add_argument("--workdir", default="autotune_bench")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--only", choices=("tuner", "grid", "deepspeed"), default=None)
    p.add_argument("--grid-best", type=float, default=float("nan"),
                   help="with --only deepspeed: the grid's best tokens/s from an earlier run, for the ratio")
    a = p.parse_args()
    if a.smoke:
        a.preset, a.seq, a.stages, a.max_micro, a.num_micro, a.device = "demo", 32, [0, 1], 8, 2, "cpu"
    work = Path(a.workdir).resolve()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    start, end = (1, 2) if a.smoke else (3, 5)
    config = {
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": a.stages},
        "autotuning": {"enabled": True, "start_profile_step": start, "end_profile_step": end,
                       "max_train_micro_batch_size_per_gpu": a.max_micro, "num_tuning_micro_batch_sizes": a.num_micro,
                       "results_dir": str(work / "results"), "exps_dir": str(work / "exps")},
    }
    if a.device == "cuda":
        config["bf16"] = {"enabled": True}
    if a.offload:
        config["zero_optimization"]["offload_optimizer"] = {"device": ["none", "cpu"], "pin_memory": True}
    if a.compile:
        config["compile"] = {"enabled": [False, True]}
    cfg_path = work / "ds_config.json"
    cfg_path.write_text(json.dumps(config, indent=2))
    launcher = ["--num_procs", "2"] if a.device == "cpu" else ["--num_gpus", "1"]
    script_args = ["--deepspeed_config", str(cfg_path), "--preset", a.preset, "--seq", str(a.seq),
                   "--steps", str(end + 2)]
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    budget = ["--autotuning_memory_budget", str(int(a.budget_gib * 2**30))] if a.budget_gib else []

    t0 = time.perf_counter()
    code = 0
    if a.only == "deepspeed":
        _deepspeed(a, work, config, launcher, script_args, a.grid_best)
        return
    if a.only != "grid":
        code = subprocess.run([sys.executable, "-m", "lightspeed.launcher", *launcher, "--autotuning", "tune", *budget,
                               str(WORKER), *script_args], env=env).returncode
    tuned_s = time.perf_counter() - t0
    trials = json.loads((work / "results" / "trials.json").read_text()) if code == 0 and a.only != "grid" else []
    ran = [t for t in trials if t["status"] == "ok"]
    pick = max(ran, key=lambda t: t["metrics"]["throughput"]) if ran else None

    # the exhaustive grid over the same space: every point run, nothing pruned
    grid_cfg = {**config, "autotuning": {**config["autotuning"], "exps_dir": str(work / "grid")}}
    os.environ["PYTHONPATH"] = env["PYTHONPATH"]
    dp = 2 if a.device == "cpu" else 1
    tuner = Autotuner(grid_cfg, launcher, str(WORKER), script_args, dp, memory_budget=1 << 62, device_type=a.device)
    t0 = time.perf_counter()
    grid = []
    for family in tuner.space.families if a.only != "tuner" else []:
        for cand in tuner.space.candidates(family, tuner.space.micro_grid):
            metrics, why = tuner._experiment(cand.name, tuner.space.ds_config(cand, True, start, end),
                                             tuner.space.script_args(cand))
            grid.append((cand, metrics, why))
            print(f"grid {cand.name}: " + (f"{metrics['tokens_per_s']:.0f} tokens/s" if metrics else why), flush=True)
    grid_s = time.perf_counter() - t0
    best_grid = max(((c, m) for c, m, _ in grid if m), key=lambda cm: cm[1]["throughput"], default=None)

    print(f"\nmodel {a.preset}, seq {a.seq}, device {a.device}; space: {len(tuner.space.families)} families x "
          f"micro {tuner.space.micro_grid}")
    print(f"{'search':<22}{'wall s':>9}{'runs':>6}  {'pick':<28}{'tokens/s':>12}{'vs grid best':>14}")
    best_tps = best_grid[1]["tokens_per_s"] if best_grid else float("nan")
    if a.only == "grid":
        pass
    elif pick:
        n = len(list((work / "exps").iterdir()))
        print(f"{'lightspeed autotuner':<22}{tuned_s:>9.1f}{n:>6}  {pick['name']:<28}"
              f"{pick['metrics']['tokens_per_s']:>12.0f}{pick['metrics']['tokens_per_s'] / best_tps:>14.3f}")
    else:
        print(f"lightspeed autotuner failed (exit {code}); see {work / 'results'}")
    if best_grid:
        c: Candidate = best_grid[0]
        print(f"{'exhaustive grid':<22}{grid_s:>9.1f}{len(grid):>6}  {c.name:<28}{best_tps:>12.0f}{1.0:>14.3f}")
    if a.deepspeed_python:
        _deepspeed(a, work, config, launcher, script_args, best_tps)


def _deepspeed(a, work: Path, config: dict, launcher: list[str], script_args: list[str], best_tps: float) -> None:
    """DeepSpeed's autotuner on the same section: `deepspeed --autotuning tune` with the worker on DeepSpeed."""
    ds_dir = work / "deepspeed"
    ds_dir.mkdir()
    ds_cfg = json.loads(json.dumps(config))
    ds_cfg["autotuning"].update(results_dir=str(ds_dir / "results"), exps_dir=str(ds_dir / "exps"))
    stages = ds_cfg["zero_optimization"]["stage"]
    ds_cfg["zero_optimization"]["stage"] = "all" if sorted(stages) == [0, 1, 2, 3] else stages
    ds_cfg["zero_optimization"].pop("offload_optimizer", None)  # DeepSpeed tunes no offload
    ds_cfg.pop("compile", None)
    path = ds_dir / "ds_config.json"
    path.write_text(json.dumps(ds_cfg, indent=2))
    args = list(script_args)
    args[args.index("--deepspeed_config") + 1] = str(path)
    ds_launcher = ["--num_gpus", "1"] if a.device == "cuda" else ["--num_nodes", "1"]
    t0 = time.perf_counter()
    # its scheduler launches every experiment as `deepspeed ...`: the launcher script beside that Python
    env = {**os.environ, "PATH": f"{Path(a.deepspeed_python).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    code = subprocess.run([a.deepspeed_python, "-m", "deepspeed.launcher.runner", *ds_launcher, "--autotuning", "tune",
                           str(WORKER), *args, "--deepspeed"], cwd=ds_dir, env=env).returncode
    wall = time.perf_counter() - t0
    best = None
    for metric_file in (ds_dir / "results").glob("*/metrics.json"):  # DeepSpeed's per-experiment result dirs
        m = json.loads(metric_file.read_text())
        if best is None or m.get("throughput", 0) > best[1].get("throughput", 0):
            best = (metric_file.parent.name, m)
    if best is None:
        print(f"{'DeepSpeed autotuner':<22}{wall:>9.1f}  no experiment finished (exit {code}); see {ds_dir}")
        return
    tps = best[1]["throughput"] * a.seq  # DeepSpeed's throughput is samples/s
    print(f"{'DeepSpeed autotuner':<22}{wall:>9.1f}{len(list((ds_dir / 'results').glob('*/metrics.json'))):>6}  {best[0]:<28}"
          f"{tps:>12.0f}{tps / best_tps:>14.3f}")


if __name__ == "__main__":
    main()
