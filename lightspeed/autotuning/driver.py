"""`lightspeed --autotuning tune|run`: calibrate, prune, run the experiments, report, and train with the best.

Owns `Autotuner` (the experiment loop), `run_autotuning` (the launcher's entry) and the files written.
Must not measure inside a training process (runtime/autotuning_probe.py does) nor parse launcher
options (launcher/cli.py does).

Note: [experiments]
    Every experiment is the user's command run again through the launcher with the same launcher
    options, in fresh processes: ``--deepspeed_config`` / ``--deepspeed`` (or the ``arg_mappings``
    flags of DeepSpeed's keys) point at the experiment's ds_config, which turns ``autotuning.enabled``
    on; the engine reports to ``LIGHTSPEED_AUTOTUNING_METRIC_PATH`` after ``end_profile_step`` and
    ends the process. Per family (autotuning/space.py) the smallest micro batch runs first, one
    profiled step only and without compile (its memory is taken as the compiled one's), to calibrate the
    memory model (autotuning/memory.py); grid points predicted
    over ``autotuning.memory_budget`` (lightspeed's key; default: the accelerator's memory) are
    pruned without running. A run that fails out of memory prunes that family's larger micro batches.

Note: [search order]
    ``gridsearch`` runs the candidates in order (families in the order of the space, micro batches
    largest first); ``random`` in a seeded random order; ``model_based`` fits, per family, step time =
    a + b x samples to the finished trials and runs next the candidate with the best predicted metric
    (an untried family first). At most ``tuner_num_trials`` experiments run; the search stops after
    ``tuner_early_stopping`` trials in a row without a new best. With ``overwrite`` false an experiment
    whose metric file exists is read, not run again (DeepSpeed's rule).

Note: [output]
    ``results_dir``: ``ds_config_optimal.json`` (the best trial's config, ``autotuning.enabled`` off),
    ``trials.json`` and ``trials.md`` (every grid point: config, tokens/s, samples/s, latency, peak
    memory measured and predicted, and why it was pruned or failed). ``exps_dir/<name>/``: each
    experiment's ds_config, metric file and log.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from lightspeed._utils.logging import get_logger
from lightspeed._utils.progress import progress
from lightspeed._utils.sizes import human_bytes
from lightspeed.autotuning.memory import Calibration, MemoryModel
from lightspeed.autotuning.space import Candidate, Family, Space, space_from_config
from lightspeed.config.errors import ConfigError

logger = get_logger(__name__)

METRIC_ENV = "LIGHTSPEED_AUTOTUNING_METRIC_PATH"
CONFIG_FLAGS = ("--deepspeed_config", "--deepspeed")
HIGHER_IS_BETTER = {"throughput": True, "latency": False, "flops": True}
METRIC_KEYS = {"throughput": "throughput", "latency": "latency", "flops": "FLOPS_per_gpu"}


@dataclass
class Trial:
    name: str
    config: str
    status: str  # "ok", "pruned", "failed", "skipped"
    reason: str = ""
    predicted_bytes: Optional[int] = None
    metrics: dict[str, Any] = field(default_factory=dict)


def user_config_path(user_args: list[str]) -> tuple[int, str]:
    """The index in `user_args` of the ds_config path given after ``--deepspeed_config``/``--deepspeed``."""
    for flag in CONFIG_FLAGS:
        for i, arg in enumerate(user_args):
            if arg == flag and i + 1 < len(user_args):
                return i + 1, user_args[i + 1]
            if arg.startswith(flag + "="):
                return i, arg.split("=", 1)[1]
    raise ConfigError("autotuning: the script's arguments must name its ds_config with --deepspeed_config FILE (or "
                      "--deepspeed FILE), which each experiment replaces")


def _with_config(user_args: list[str], path: str) -> list[str]:
    args = list(user_args)
    i, _ = user_config_path(args)
    args[i] = f"{args[i].split('=', 1)[0]}={path}" if "=" in args[i] and args[i].startswith("--") else path
    return args


class Autotuner:
    """One tuning session: `tune()` fills `trials` and returns the best; `write()` writes the results."""

    def __init__(self, user_config: dict, launcher_argv: list[str], script: str, user_args: list[str], world_size: int,
                 memory_budget: Optional[int] = None, device_type: Optional[str] = None):
        self.user_config = user_config
        self.tuning = dict(user_config.get("autotuning") or {})
        metric = self.tuning.get("metric", "throughput")
        if metric not in METRIC_KEYS:
            raise ConfigError(f"autotuning.metric: must be throughput, latency or flops (got {metric!r})")
        tuner = self.tuning.get("tuner_type", "gridsearch")
        if tuner not in ("gridsearch", "random", "model_based"):
            raise ConfigError(f"autotuning.tuner_type: must be gridsearch, random or model_based (got {tuner!r})")
        self.metric, self.tuner_type = metric, tuner
        if self.tuning.get("fast", True) is False:
            raise NotImplementedError("autotuning.fast=false (DeepSpeed then also tunes ZeRO's bucket sizes and overlap "
                                      "flags; lightspeed tunes stage, micro batch, accumulation, offload, compile and "
                                      "activation checkpointing, as with fast=true)")
        self.launcher_argv, self.script, self.user_args = list(launcher_argv), script, list(user_args)
        user_config_path(self.user_args)  # refused early when missing
        mp = int(self.tuning.get("mp_size", 1))
        if world_size % mp:
            raise ConfigError(f"autotuning.mp_size: must divide the world size {world_size} (got {mp})")
        self.space: Space = space_from_config(user_config, world_size // mp)
        self.start = int(self.tuning.get("start_profile_step", 3))
        self.end = int(self.tuning.get("end_profile_step", 5))
        self.results_dir = Path(self.tuning.get("results_dir", "autotuning_results"))
        self.exps_dir = Path(self.tuning.get("exps_dir", "autotuning_exps"))
        self.overwrite = bool(self.tuning.get("overwrite", True))
        self.num_trials = int(self.tuning.get("tuner_num_trials", 50))
        self.early_stopping = int(self.tuning.get("tuner_early_stopping", 5))
        self.num_micro = int(self.tuning.get("num_tuning_micro_batch_sizes", 3))
        if device_type is None or memory_budget is None:
            from lightspeed._utils.accelerator import get_accelerator

            acc = get_accelerator()
            device_type = device_type or acc.device_name().split(":")[0]
            if memory_budget is None:
                memory_budget = self.tuning.get("memory_budget") or acc.total_memory()
        self.budget = int(memory_budget)
        self.memory = MemoryModel(device_type)
        self.trials: list[Trial] = []
        self.best: Optional[tuple[Candidate, Trial]] = None

    # ------------------------------------------------------------------ one experiment
    def _experiment(self, name: str, ds_config: dict, extra_args: list[str]) -> tuple[Optional[dict], str]:
        """Run one experiment; (metrics, "") or (None, why it failed)."""
        exp_dir = self.exps_dir / name
        exp_dir.mkdir(parents=True, exist_ok=True)
        metric_file = exp_dir / "metric.json"
        if not self.overwrite and metric_file.is_file():
            return json.loads(metric_file.read_text()), ""
        metric_file.unlink(missing_ok=True)
        config_file = exp_dir / "ds_config.json"
        config_file.write_text(json.dumps(ds_config, indent=2))
        args = _with_config(self.user_args, str(config_file.resolve())) + extra_args
        for key, flag in (self.tuning.get("arg_mappings") or {}).items():
            if key in ds_config and flag:  # DeepSpeed's arg_mappings: a ds_config key's value as a script flag
                args = _set_flag(args, flag, str(ds_config[key]))
        cmd = [sys.executable, "-m", "lightspeed.launcher", *self.launcher_argv, self.script, *args]
        env = {**os.environ, METRIC_ENV: str(metric_file.resolve())}
        with open(exp_dir / "stdout.log", "w") as log:
            code = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
        if metric_file.is_file():
            return json.loads(metric_file.read_text()), ""
        text = (exp_dir / "stdout.log").read_text(errors="replace")
        oom = "out of memory" in text.lower() or "outofmemory" in text.lower()
        last = next((ln for ln in reversed(text.strip().splitlines()) if ln.strip()), "")
        if oom:
            return None, "out of memory"
        if code == 0:
            return None, (f"the script ended before step {ds_config['autotuning']['end_profile_step'] + 1} without "
                          f"reporting (run it for more steps)")
        return None, f"exit {code}: {last[-200:]}"

    def _calibrate(self, family: Family, micro: int) -> Optional[str]:
        """Fit the memory model with one profiled step of `family` at `micro`; why it failed, or None."""
        family = Family(family.stage, family.offload, False, family.ckpt)  # compiled graphs hide saved tensors
        cand = Candidate(family, micro, 1)
        metrics, why = self._experiment(f"calibrate_{family.name}_mb{micro}",
                                        self.space.ds_config(cand, True, 1, 1), self.space.script_args(cand))
        if metrics is None:
            return why
        self.memory.fit(Calibration(family.stage, micro, self.space.dp, metrics["memory_breakdown"],
                                    int(metrics.get("activation_bytes") or 0), int(metrics["peak_memory_bytes"])),
                        family.ckpt)
        return None

    # ------------------------------------------------------------------ the search
    def _grid(self) -> list[tuple[Candidate, Optional[int]]]:
        """Every candidate with its predicted bytes; records the pruned ones."""
        out = []
        for family in self.space.families:
            if not self.memory.ready(family.ckpt):
                why = self._calibrate(family, self.space.micro_grid[0])
                if why is not None:
                    for cand in self.space.candidates(family, self.space.micro_grid):
                        self.trials.append(Trial(cand.name, cand.describe(), "failed",
                                                 f"calibration at micro {self.space.micro_grid[0]}: {why}"))
                    continue
            fits = []
            for cand in self.space.candidates(family, sorted(self.space.micro_grid, reverse=True)):
                need = self.memory.predict(family.stage, family.offload, family.ckpt, cand.micro, self.space.dp)
                if need > self.budget:
                    self.trials.append(Trial(cand.name, cand.describe(), "pruned",
                                             f"predicted {human_bytes(need)} > budget {human_bytes(self.budget)}",
                                             need))
                else:
                    fits.append((cand, need))
            keep = sorted({c.micro for c, _ in fits}, reverse=True)[:self.num_micro]
            for cand, need in fits:
                if cand.micro in keep:
                    out.append((cand, need))
                else:
                    self.trials.append(Trial(cand.name, cand.describe(), "skipped",
                                             f"smaller than the {self.num_micro} largest micro batches that fit", need))
        return out

    def _score(self, metrics: dict) -> float:
        value = metrics.get(METRIC_KEYS[self.metric])
        if value is None:
            raise ConfigError(f"autotuning.metric: {self.metric} was not measured (the forward's FLOPs could not be "
                              f"counted)")
        return float(value) if HIGHER_IS_BETTER[self.metric] else -float(value)

    def _next(self, pending: list, done: list[tuple[Candidate, dict]], rng: random.Random):
        if self.tuner_type != "model_based" or not done:
            return pending.pop(0) if self.tuner_type != "random" else pending.pop(rng.randrange(len(pending)))
        fits: dict[Family, tuple[float, float]] = {}
        for family in {c.family for c, _ in done}:
            pts = [(c.micro * c.gas, m["latency"]) for c, m in done if c.family == family]
            fits[family] = _line(pts)

        def predicted(item):
            cand = item[0]
            if cand.family not in fits:
                return float("inf")  # explore an untried family first
            a, b = fits[cand.family]
            samples = cand.micro * cand.gas
            latency = max(a + b * samples, 1e-9)
            return (samples / latency) if self.metric != "latency" else -latency

        best = max(range(len(pending)), key=lambda i: predicted(pending[i]))
        return pending.pop(best)

    def tune(self) -> Optional[tuple[Candidate, Trial]]:
        t0 = time.perf_counter()
        pending = self._grid()
        rng = random.Random(0)
        done: list[tuple[Candidate, dict]] = []
        oom_at: dict[Family, int] = {}
        since_best = 0
        bar = progress(total=min(len(pending), self.num_trials), desc="autotuning", unit="trial")
        while pending and len(done) < self.num_trials and since_best < max(self.early_stopping, 1):
            cand, need = self._next(pending, done, rng)
            if cand.family in oom_at and cand.micro >= oom_at[cand.family]:
                self.trials.append(Trial(cand.name, cand.describe(), "pruned",
                                         f"micro {oom_at[cand.family]} ran out of memory", need))
                continue
            bar.set_postfix_str(cand.name)
            metrics, why = self._experiment(cand.name, self.space.ds_config(cand, True, self.start, self.end),
                                            self.space.script_args(cand))
            bar.update(1)
            if metrics is None:
                if why == "out of memory":
                    oom_at[cand.family] = min(cand.micro, oom_at.get(cand.family, cand.micro))
                self.trials.append(Trial(cand.name, cand.describe(), "failed", why, need))
                continue
            trial = Trial(cand.name, cand.describe(), "ok", "", need, metrics)
            self.trials.append(trial)
            done.append((cand, metrics))
            if self.best is None or self._score(metrics) > self._score(self.best[1].metrics):
                self.best, since_best = (cand, trial), 0
            else:
                since_best += 1
            logger.info("autotuning: %s: %.1f samples/s, %s tokens/s, %.1f ms/step", cand.name, metrics["throughput"],
                        _fmt(metrics.get("tokens_per_s")), metrics["latency"])
        bar.close()
        for cand, need in pending:
            self.trials.append(Trial(cand.name, cand.describe(), "skipped",
                                     "search stopped (tuner_num_trials or tuner_early_stopping)", need))
        logger.info("autotuning: %d experiments in %.1f s", len(done), time.perf_counter() - t0)
        return self.best

    # ------------------------------------------------------------------ results
    def optimal_config(self) -> dict:
        if self.best is None:
            raise RuntimeError("autotuning: no experiment finished; see the trials table for why")
        return self.space.ds_config(self.best[0], False, self.start, self.end)

    def write(self) -> Path:
        self.results_dir.mkdir(parents=True, exist_ok=True)
        (self.results_dir / "trials.json").write_text(json.dumps([asdict(t) for t in self.trials], indent=2))
        (self.results_dir / "trials.md").write_text(self.table())
        path = self.results_dir / "ds_config_optimal.json"
        if self.best is not None:
            path.write_text(json.dumps(self.optimal_config(), indent=2))
        return path

    def table(self) -> str:
        best = self.best[1].name if self.best else None
        lines = ["| trial | config | status | tokens/s | samples/s | ms/step | peak memory | predicted | note |",
                 "|---|---|---|---|---|---|---|---|---|"]
        for t in self.trials:
            m = t.metrics
            lines.append(
                f"| {t.name}{' (best)' if t.name == best else ''} | {t.config} | {t.status} | "
                f"{_fmt(m.get('tokens_per_s'))} | {_fmt(m.get('throughput'))} | {_fmt(m.get('latency'))} | "
                f"{human_bytes(m['peak_memory_bytes']) if 'peak_memory_bytes' in m else ''} | "
                f"{human_bytes(t.predicted_bytes) if t.predicted_bytes is not None else ''} | {t.reason} |")
        return "\n".join(lines) + "\n"


def _fmt(value) -> str:
    return "" if value is None else f"{value:.1f}"


def _line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares a + b x through `points` (a flat line through one point)."""
    if len({x for x, _ in points}) < 2:
        x, y = points[-1]
        return 0.0, y / x
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    b = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return my - b * mx, b


def _set_flag(args: list[str], flag: str, value: str) -> list[str]:
    args = list(args)
    if flag in args:
        i = args.index(flag)
        if i + 1 < len(args):
            args[i + 1] = value
            return args
    return args + [flag, value]


def run_autotuning(mode: str, launcher_argv: list[str], script: str, user_args: list[str], world_size: int,
                   memory_budget: Optional[int] = None) -> int:
    """The launcher's ``--autotuning tune|run``: tune, write the results, and with ``run`` start the
    training with the best config. Returns an exit status."""
    _, path = user_config_path(user_args)
    from lightspeed.config.parse import read_source

    user_config, _ = read_source(path)
    tuner = Autotuner(user_config, launcher_argv, script, user_args, world_size, memory_budget=memory_budget)
    tuner.tune()
    optimal = tuner.write()
    logger.info("autotuning: trials in %s\n%s", tuner.results_dir / "trials.md", tuner.table())
    if tuner.best is None:
        logger.error("autotuning: no experiment finished; see %s", tuner.results_dir / "trials.md")
        return 1
    logger.info("autotuning: best %s (%s); config written to %s", tuner.best[0].name, tuner.best[0].describe(),
                optimal)
    if mode != "run":
        return 0
    args = _with_config(user_args, str(optimal.resolve())) + tuner.space.script_args(tuner.best[0])
    cmd = [sys.executable, "-m", "lightspeed.launcher", *launcher_argv, script, *args]
    return subprocess.run(cmd).returncode
