"""Pipeline parallelism: the bubble of each of lightspeed's schedules against its theory, and lightspeed's
samples/s against DeepSpeed 0.19.8's PipelineEngine on the same model and world, in the same run.

    python benchmarks/pipeline.py [--pp 2 4] [--micro-batches 4 8 16] [--deepspeed-python PY]
        [--schedules 1f1b gpipe ...] [--width 512] [--layers 16] [--rows 64] [--no-bubble] [--no-deepspeed]

CPU, gloo, one process per pipeline stage (`--pp` of them), one thread each (OMP_NUM_THREADS=1,
`torch.set_num_threads(1)`). On a machine with fewer cores than `--pp`, stages share cores: the timings
are contended (the bubble's busy time then counts time a stage waited for a core).

Model: `--layers` blocks of `relu(Linear(width, width))` (LayerSpec each, partition "uniform"), inputs
and targets `randn(rows, width)`, MSE loss: a sleep-free matmul stack whose three GEMMs per layer and
micro-batch (forward, input gradient, weight gradient) are of equal size, so T_F = T_B = T_W, the
zero-bubble papers' assumption. At the defaults one micro-batch through one stage of pp=2 takes 12-25 ms
on one core of the 2-core machine the figures in BENCHMARKS.md come from (forward + backward), against
well under 1 ms of gloo send/recv of its 128 KiB activation; `--width`, `--layers`, `--rows` scale it.

Part 1, the bubble (lightspeed only). In each rank, the compute of every schedule action is timed
(`forward_one_chunk`, `backward_one_chunk`, `backward_weight_one_chunk` of torch's pipeline stage,
wrapped in this process) and the schedule's run of one batch (`PipelineDriver.run`: the schedule from
its first action to its last, without the optimizer step, the loss broadcast or the data pull). A
rank's bubble is 1 - busy / run: the part of the schedule's span it computed nothing (idle, waiting on
a peer, or sending). Reported: the mean over ranks, per step the median of `--repeats` x `--steps`
timed steps after `--warmup`. Theory, for equal stages and T_F = T_B = T_W, as the idle part of the span:
- 1F1B and GPipe: (p-1) / (m+p-1).
- interleaved 1F1B, v stages per rank: ((p-1)/v) / (m + (p-1)/v).
- zero bubble (Qi et al. 2024, arXiv 2401.10241): ZB-H1 / ZB1P idles (p-1)(T_F+T_B-T_W), a third of
  1F1B's at equal times: (p-1) / (3m+p-1). torch's interleaved zero bubble is ZB1P over v stages per
  rank; its line here, ((p-1)/v) / (3m + (p-1)/v), takes interleaving's 1/v onto ZB1P's (our
  extrapolation, not the paper's figure). ZB-V (two stages per rank in a V) is bubble-free at
  T_F = T_B = T_W: 0.
Gloo's p2p time counts as bubble; at these sizes it is under 1% of a step.

Part 2, samples/s: `train_batch` (the whole step: data, schedule, loss broadcast, optimizer step) with
the same model, initial weights, data, micro-batch size and count, `torch.optim.SGD` built by both engines
from the same callable, ZeRO-0, fp32. DeepSpeed runs in its own environment (an interpreter
where `import deepspeed` works: `--deepspeed-python`, default the venv of
lightspeed.testing.deepspeed_env; or this interpreter with `--deepspeed-path` on its PYTHONPATH) in a
subprocess with DS_ACCELERATOR=cpu; lightspeed never imports it. samples/s = m x rows / (ms per step),
the median of `--repeats` windows of `--steps` steps on rank 0. `--rounds` rounds alternate a lightspeed
world and a DeepSpeed world (on a shared machine a neighbour's load then falls on both); the table gives
the median over rounds of each ms/step and of each round's ratio, with the ratios' range.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from torch import nn  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MARK = "@@PIPE@@"
SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b", "interleaved_zero_bubble", "zbv_zero_bubble")
MULTI = ("interleaved_1f1b", "interleaved_zero_bubble", "zbv_zero_bubble")


# ---------------------------------------------------------------- the model and data (both environments)
class Block(nn.Module):
    """relu(Linear(width, width)): one matmul layer of the stack."""

    def __init__(self, width: int):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return torch.relu(self.fc(x))


def mse(output, target):
    return torch.nn.functional.mse_loss(output, target)


def make_sgd(params):
    """The optimizer both engines build (a callable: lightspeed repartitions the interleaved schedules'
    module before building it)."""
    return torch.optim.SGD(params, lr=1e-3)


def seed_layer(seed) -> None:
    torch.manual_seed(int(seed))


def build(LayerSpec, PipelineModule, args, pp: int):
    return PipelineModule([LayerSpec(Block, args.width) for _ in range(args.layers)], num_stages=pp, loss_fn=mse,
                          partition_method="uniform", seed_layers=True, seed_fn=seed_layer, base_seed=1234)


def batches(args, n: int):
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(args.rows, args.width, generator=g), torch.randn(args.rows, args.width, generator=g))
            for _ in range(n)]


def config(args, m: int, schedule: str | None, virtual: int | None) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": args.rows, "gradient_accumulation_steps": m, "steps_per_print": 10**9,
           "zero_optimization": {"stage": 0}}
    if schedule is not None:
        cfg["pipeline"] = {"schedule": schedule, **({"virtual_stages": virtual} if virtual else {})}
    return cfg


def time_windows(step, args) -> float:
    """ms per step: the median over `repeats` windows of `steps` steps, after `warmup` steps."""
    for _ in range(args.warmup):
        step()
    windows = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step()
        windows.append((time.perf_counter() - t0) * 1e3 / args.steps)
    return sorted(windows)[len(windows) // 2]


# ---------------------------------------------------------------- lightspeed (run_world children)
def _instrument() -> dict:
    """Wrap torch's stage actions and the driver's run with timers (this process only)."""
    from torch.distributed.pipelining import stage as torch_stage

    from lightspeed.parallel.pipeline import schedule as ls_schedule

    clock = {"busy": 0.0, "run": 0.0}
    base = torch_stage._PipelineStageBase
    if getattr(base, "_bench_wrapped", False):
        return base._bench_clock

    def timed(fn, key):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                clock[key] += time.perf_counter() - t0
        return wrapper

    for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
        setattr(base, name, timed(getattr(base, name), "busy"))
    ls_schedule.PipelineDriver.run = timed(ls_schedule.PipelineDriver.run, "run")
    base._bench_wrapped, base._bench_clock = True, clock
    return clock


def _lightspeed_world(args_dict: dict, cases: list, pp: int) -> list[dict]:
    """Every (schedule, m, measure) of `cases` in this world; each rank's figures."""
    import torch.distributed as dist

    import lightspeed
    from lightspeed.parallel.pipeline import LayerSpec, PipelineModule

    args = argparse.Namespace(**args_dict)
    torch.set_num_threads(1)
    clock = _instrument()
    out = []
    for schedule, m, measure in cases:
        virtual = 2 if schedule in MULTI else None
        torch.manual_seed(0)
        net = build(LayerSpec, PipelineModule, args, pp)
        engine, *_ = lightspeed.initialize(model=net, optimizer=make_sgd, config=config(args, m, schedule, virtual),
                                           model_parameters=[p for p in net.parameters() if p.requires_grad])
        data = batches(args, m)
        losses, runs, busies = [], [], []

        def step(engine=engine, data=data):
            clock["busy"] = clock["run"] = 0.0
            losses.append(float(engine.train_batch(iter(data))))
            runs.append(clock["run"])
            busies.append(clock["busy"])

        ms = time_windows(step, args)
        timed = list(zip(runs, busies))[args.warmup:]
        bubbles = sorted(1 - b / r for r, b in timed)
        out.append({"schedule": schedule, "m": m, "measure": measure, "ms_per_step": ms,
                    "bubble": bubbles[len(bubbles) // 2], "run_ms": sorted(r for r, _ in timed)[len(timed) // 2] * 1e3,
                    "busy_ms": sorted(b for _, b in timed)[len(timed) // 2] * 1e3, "loss_first": losses[0],
                    "loss_last": losses[-1]})
        del engine, net
        dist.barrier()
    return out


def run_lightspeed(args, pp: int, cases: list) -> list[list[dict]]:
    from lightspeed.testing.run_world import run_world

    per_rank = run_world(_lightspeed_world, pp, vars(args), cases, pp, timeout=args.timeout)
    return [[per_rank[r][i] for r in range(pp)] for i in range(len(cases))]


# ---------------------------------------------------------------- DeepSpeed (its own interpreter)
def _ds_worker(rank: int, world: int, port: int, args_dict: dict, m: int, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), DS_ACCELERATOR="cpu")
    torch.set_num_threads(1)
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule

    args = argparse.Namespace(**args_dict)
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    net = build(LayerSpec, PipelineModule, args, world)
    engine, *_ = deepspeed.initialize(model=net, optimizer=make_sgd, config=config(args, m, None, None),
                                      model_parameters=[p for p in net.parameters() if p.requires_grad])
    data = batches(args, m)
    losses = []
    ms = time_windows(lambda: losses.append(float(engine.train_batch(iter(data)))), args)
    if rank == 0:
        Path(out_path).write_text(json.dumps({"ms_per_step": ms, "loss_first": losses[0], "loss_last": losses[-1],
                                              "version": deepspeed.__version__}))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _ds_child(args) -> None:
    """In DeepSpeed's interpreter: one spawned world per m; prints each result after MARK."""
    import socket

    import torch.multiprocessing as mp

    for m in args.micro_batches:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            path = f.name
        mp.start_processes(_ds_worker, args=(args.ds_child, port, vars(args), m, path), nprocs=args.ds_child,
                           start_method="spawn")
        print(MARK + json.dumps({"m": m, **json.loads(Path(path).read_text())}), flush=True)
        os.unlink(path)


def run_deepspeed(args, pp: int) -> dict[int, dict]:
    python = args.deepspeed_python
    if python is None and args.deepspeed_path:
        python = sys.executable
    if python is None:
        sys.path.insert(0, str(REPO))
        from lightspeed.testing import deepspeed_env

        found = deepspeed_env.python()
        if found is None:
            print(f"DeepSpeed not measured: {deepspeed_env.missing_reason()}")
            return {}
        python = str(found)
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=args.deepspeed_path)
    passthrough = ["--width", args.width, "--layers", args.layers, "--rows", args.rows, "--warmup", args.warmup,
                   "--steps", args.steps, "--repeats", args.repeats, "--micro-batches", *args.micro_batches]
    proc = subprocess.run([python, __file__, "--ds-child", str(pp), *map(str, passthrough)], env=env,
                          capture_output=True, text=True, cwd=tempfile.gettempdir(), timeout=args.timeout)
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith(MARK):
            r = json.loads(line[len(MARK):])
            results[r["m"]] = r
    if proc.returncode != 0 or not results:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        print(f"DeepSpeed run failed (exit {proc.returncode}): {' | '.join(tail)}")
    return results


# ---------------------------------------------------------------- theory and tables
def theory(schedule: str, p: int, m: int, v: int = 2) -> float:
    if schedule in ("1f1b", "gpipe"):
        return (p - 1) / (m + p - 1)
    if schedule == "interleaved_1f1b":
        return ((p - 1) / v) / (m + (p - 1) / v)
    if schedule == "interleaved_zero_bubble":
        return ((p - 1) / v) / (3 * m + (p - 1) / v)
    if schedule == "zbv_zero_bubble":
        return 0.0
    raise ValueError(schedule)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, nargs="+", default=[2])
    ap.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--rows", type=int, default=64, help="micro-batch size")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2, help="steps per timed window")
    ap.add_argument("--repeats", type=int, default=3, help="timed windows (the median is reported)")
    ap.add_argument("--throughput-m", type=int, nargs="+", default=None,
                    help="m of the samples/s table (default: every --micro-batches)")
    ap.add_argument("--deepspeed-python", default=None, help="an interpreter that imports deepspeed")
    ap.add_argument("--no-deepspeed", action="store_true")
    ap.add_argument("--no-bubble", action="store_true", help="only the samples/s table")
    ap.add_argument("--no-throughput", action="store_true", help="only the bubble table")
    ap.add_argument("--rounds", type=int, default=3, help="samples/s: alternating lightspeed/DeepSpeed rounds")
    ap.add_argument("--deepspeed-path", default="", help="PYTHONPATH of the DeepSpeed child (default: none)")
    ap.add_argument("--timeout", type=float, default=3000)
    ap.add_argument("--ds-child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.ds_child:
        _ds_child(args)
        return
    sys.path.insert(0, str(REPO))
    tput_m = args.throughput_m or args.micro_batches
    print(f"model: {args.layers} x relu(Linear({args.width}, {args.width})), micro-batch {args.rows} rows, fp32, "
          f"SGD, ZeRO-0; CPU gloo, 1 thread per rank, {os.cpu_count()} cores; torch {torch.__version__}; "
          f"load average at start {os.getloadavg()[0]:.2f}")
    for pp in args.pp:
        contended = " (contended: more ranks than cores)" if pp > (os.cpu_count() or 1) else ""
        if not args.no_bubble:
            cases = [(s, m, "bubble") for s in args.schedules for m in args.micro_batches]
            by = {(r[0]["schedule"], r[0]["m"]): r for r in run_lightspeed(args, pp, cases)}
            print(f"\n== bubble, pp={pp}{contended}: 1 - busy/run per rank, mean over ranks (max), median step")
            print(f"{'schedule':<25}{'m':>4}{'measured':>10}{'(max)':>8}{'theory':>9}{'meas-theory':>12}"
                  f"{'run ms':>9}{'busy ms':>9}{'step ms':>9}")
            for s in args.schedules:
                for m in args.micro_batches:
                    r = by[(s, m)]
                    mean = sum(x["bubble"] for x in r) / len(r)
                    th = theory(s, pp, m)
                    worst = max(x["bubble"] for x in r)
                    print(f"{s:<25}{m:>4}{mean:>10.3f}{worst:>8.3f}{th:>9.3f}{mean - th:>+12.3f}"
                          f"{r[0]['run_ms']:>9.1f}{r[0]['busy_ms']:>9.1f}{r[0]['ms_per_step']:>9.1f}")
        if args.no_throughput:
            continue
        # samples/s: rounds alternate lightspeed's world and DeepSpeed's, so a neighbour's load on a shared
        # machine lands on both; per m, the median over rounds of each ms/step and of each round's ratio
        ls_tput = ("1f1b", "zbv_zero_bubble")
        ds_args = argparse.Namespace(**{**vars(args), "micro_batches": tput_m})
        rounds = []
        for _ in range(args.rounds):
            rows = run_lightspeed(args, pp, [(s, m, "tput") for s in ls_tput for m in tput_m])
            ls = {(r[0]["schedule"], r[0]["m"]): r[0] for r in rows}
            ds = {} if args.no_deepspeed else run_deepspeed(ds_args, pp)
            rounds.append((ls, ds))

        def med(xs):
            xs = sorted(xs)
            return xs[len(xs) // 2] if xs else float("nan")

        print(f"\n== samples/s, pp={pp}{contended}: train_batch, rank 0; median over {args.rounds} rounds "
              f"(each: the median of {args.repeats} windows of {args.steps} steps)")
        print(f"{'run':<34}{'m':>4}{'ms/step':>10}{'samples/s':>11}{'vs DeepSpeed':>14}{'(rounds)':>19}  loss")
        version = next((d[m]["version"] for _, d in rounds for m in d), None)
        for m in tput_m:
            ds_ms = [d[m]["ms_per_step"] for _, d in rounds if m in d]
            lines = [(f"DeepSpeed {version} PipelineEngine", ds_ms, None, [d[m] for _, d in rounds if m in d])]
            lines = lines if ds_ms else []
            for s in ls_tput:
                ms = [ls[(s, m)]["ms_per_step"] for ls, _ in rounds]
                ratios = [d[m]["ms_per_step"] / ls[(s, m)]["ms_per_step"] for ls, d in rounds if m in d]
                lines.append((f"lightspeed {s}", ms, ratios, [ls[(s, m)] for ls, _ in rounds]))
            for name, ms, ratios, rs in lines:
                sps = m * args.rows / (med(ms) / 1e3)
                if ratios is None:
                    ratio, spread = "1.00", ""
                elif ratios:
                    ratio, spread = f"{med(ratios):.2f}x", f"{min(ratios):.2f}-{max(ratios):.2f}x"
                else:
                    ratio, spread = "n/a", ""
                print(f"{name:<34}{m:>4}{med(ms):>10.1f}{sps:>11.1f}{ratio:>14}{spread:>19}  "
                      f"{rs[0]['loss_first']:.5f} -> {rs[0]['loss_last']:.5f}")
        print(f"load average after pp={pp}: {os.getloadavg()[0]:.2f} (1 min), {os.getloadavg()[1]:.2f} (5 min)")

if __name__ == "__main__":
    main()
