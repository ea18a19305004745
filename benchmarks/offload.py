"""ZeRO-Offload on one GPU: tokens/s and peak GPU memory of ZeRO-2 and ZeRO-3 with the optimizer
offloaded to CPU, next to the same run without offload, and DeepSpeed's engine with the same config
when it is importable.

    python benchmarks/offload.py [--sizes gpt2-medium 1.3b] [--stages 2 3] [--micro 8] [--seq 1024]
        [--steps 10] [--overlap-step] [--param] [--deepspeed] [--smoke]

Each configuration runs in a fresh process (world size 1, NCCL on GPU). Model and batches are
benchmarks/zero_step.py's (examples/gpt.py, bf16 with fp32 master weights, AdamW, clipping 1.0); the
offloaded runs use DeepSpeed's offload block (`device: cpu, pin_memory: true`), so the config's AdamW
becomes CPUAdam in both engines. `--overlap-step` adds lightspeed's one-step-delayed CPU step;
`--param` adds ZeRO-3 with the parameters offloaded too.
`--zenflow` adds ZenFlow (topk 0.05, update_interval 4, sequential and overlapped; stage 2), and
`--speculative` the speculative CPU step (`super_offload`; its rows say how many steps rolled back),
with its two rollbacks (`cpu-super`: the Adam step inverted; `cpu-super-copy`: pre-step copies restored,
lightspeed only). `--variants` runs exactly the variants named,
for both systems; `cpu-bf16` is the optimizer on the CPU with bf16 masters and bf16 Adam state there
(`bf16.bf16_master_weights_and_grads` and `bf16_optimizer_states`: 8 host bytes a parameter, not 16);
`--meta` builds lightspeed's ZeRO-3 model on the meta device, for models whose fp32 copy does not fit
the GPU (the 13B-shaped run: `--sizes 5120x40 --stages 3 --variants cpu-bf16 --meta --micro 1`). The
size sweep of the largest GPT that trains with optimizer and parameters on the CPU (a run that does
not fit reports "out of memory" or its error):

    python benchmarks/offload.py --sizes 2.7b 4096x24 6.7b --stages 3 --variants cpu-param --deepspeed
        --micro 4 --steps 2 --warmup 1 --run-timeout 280

A size is a preset of examples/gpt.py or WIDTHxLAYERS (GPT-2's vocabulary, 128-wide heads): 4096x24 is
5.0B parameters. The host is what bounds the sweep (every byte of optimizer state and the parameters
live there), so each row also gives the run's peak host memory (RSS) and its wall time. `--smoke` runs a
tiny model on CPU/gloo in seconds (peak GPU memory is then n/a).

`--bound` first measures what bounds an offloaded step on this machine: a pinned 1 GiB copy each way
between host and device, and one CPUAdam step over the model's parameter count in fp32 (its memory
traffic: parameter, two moments and gradient read, three written). The floor it prints for one step
is the gradient copy to the host (bf16), the parameter copy back (bf16) and that CPU step, in series:
what an offloaded step costs beyond the GPU's forward and backward unless the pieces overlap.
`--host-step M` only times CPUAdam's offloaded ZeRO step over M million parameters on this CPU (fp32
masters with and without a coefficient; bf16 masters with fp32 and with bf16 state) and prints the
host bytes per parameter each keeps (CPU time too: on a shared host it varies less than wall time).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import lightspeed  # noqa: E402
from benchmarks.harness import Result, engine_step, print_table, reset_memory, time_steps  # noqa: E402
from benchmarks.zero_step import LR, finish, make_batches  # noqa: E402
from examples.gpt import GPT, GPTConfig  # noqa: E402

VARIANTS = {  # name -> the zero_optimization keys added to {"stage": s}
    "none": {},
    "cpu": {"offload_optimizer": {"device": "cpu", "pin_memory": True}},
    "cpu-overlap": {"offload_optimizer": {"device": "cpu", "pin_memory": True, "overlap_step": True}},
    "cpu-param": {"offload_optimizer": {"device": "cpu", "pin_memory": True},
                  "offload_param": {"device": "cpu", "pin_memory": True}},
    # ZenFlow as DeepSpeed's tutorial sets it (select once: no dataloader, so no epoch), stages 1-2
    "cpu-zenflow": {"offload_optimizer": {"device": "cpu", "pin_memory": True},
                    "zenflow": {"topk_ratio": 0.05, "update_interval": 4, "full_warm_up_rounds": 0}},
    "cpu-zenflow-overlap": {"offload_optimizer": {"device": "cpu", "pin_memory": True},
                            "zenflow": {"topk_ratio": 0.05, "update_interval": 4, "full_warm_up_rounds": 0,
                                        "overlap_step": True}},
    # the speculative CPU step during backward, rolled back when the clip (1.0) acts: by inverting the
    # Adam step (the default for AdamW), or (lightspeed's "copy" rollback) from pre-step copies
    "cpu-super": {"offload_optimizer": {"device": "cpu", "pin_memory": True, "super_offload": True}},
    "cpu-super-copy": {"offload_optimizer": {"device": "cpu", "pin_memory": True, "super_offload": True,
                                             "super_offload_rollback": "copy"}},
    # optimizer on the CPU with bf16 masters and bf16 Adam state there (BF16_STATE: 8 host bytes a parameter)
    "cpu-bf16": {"offload_optimizer": {"device": "cpu", "pin_memory": True}},
}
BF16_STATE = {"cpu-bf16"}  # variants that also set bf16.bf16_master_weights_and_grads and bf16_optimizer_states
ZENFLOW = ("cpu-zenflow", "cpu-zenflow-overlap")


def config(stage: int, variant: str, micro: int, bf16: bool) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
           "gradient_clipping": 1.0, "zero_optimization": {"stage": stage, **copy.deepcopy(VARIANTS[variant])},
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.1}}}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    if variant in BF16_STATE:
        cfg["bf16"] = {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
    return cfg


def host_peak_gib() -> float:
    """This process's peak resident host memory (pinned buffers included)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def run_one(args, size: str, system: str, stage: int, variant: str) -> Result:
    lightspeed.init_distributed(verbose=False)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    torch.manual_seed(0)
    cfg = GPTConfig.preset(size, block_size=args.seq)
    meta = args.meta and system == "lightspeed" and stage == 3
    with torch.device("meta") if meta else device:  # --meta: ZeRO-3 materializes it one unit at a time
        base = GPT(cfg)
    batches = make_batches(cfg.vocab_size, args.micro, args.seq, device)
    if system == "deepspeed":
        import deepspeed

        initialize = deepspeed.initialize
    else:
        initialize = lightspeed.initialize
    name = f"{system} ZeRO-{stage} {variant}"
    reset_memory()
    model = base if meta else copy.deepcopy(base)  # (the copy: the same as DeepSpeed's runs)
    del base
    try:
        engine, *_ = initialize(model=model, model_parameters=model.parameters(),
                                config=config(stage, variant, args.micro, device.type == "cuda"))
    except NotImplementedError as err:
        return Result(name, note=f"n/a: {err}")
    step = engine_step(engine, batches)

    ms, losses = time_steps(step, args.steps, args.warmup)
    with torch.device("meta"):
        meta = GPT(cfg)
    result = finish(Result(name), ms, losses, meta, args)
    result.note += f"; host peak {host_peak_gib():.1f} GiB"
    runner = getattr(getattr(engine, "strategy", None), "_runner", None)
    if runner is not None and variant.startswith("cpu-super"):
        result.note += (f"; {runner.rollbacks} rolled back ({runner._rollback.mode}), {runner.early_ranges} ranges "
                        "during backward")
    if runner is not None and runner.zenflow is not None:
        result.note += f"; {runner.zenflow.updates} CPU updates"
    if args.phases:
        result.note = (result.note + "; " if result.note else "") + phases(engine, batches, name)
    dist.destroy_process_group()
    return result


def phases(engine, batches, name: str) -> str:
    """Forward + backward and `engine.step()` timed apart (synchronized between them, median of 3), and
    the Python functions one `engine.step()` spends its time in (cProfile, printed)."""
    import cProfile
    import pstats
    import time

    from benchmarks.harness import sync

    fb, st = [], []
    for i in range(3):
        b = batches[i % len(batches)]
        sync()
        t0 = time.perf_counter()
        engine.backward(engine(b[:, :-1].to(engine.device), b[:, 1:].to(engine.device)))
        sync()
        t1 = time.perf_counter()
        if i == 2:
            prof = cProfile.Profile()
            prof.enable()
        engine.step()
        sync()
        if i == 2:
            prof.disable()
        st.append(time.perf_counter() - t1)
        fb.append(t1 - t0)
    print(f"-- {name}: where engine.step() spends its time (cumulative, top 8)")
    pstats.Stats(prof).sort_stats("cumulative").print_stats(8)
    return f"fwd+bwd {sorted(fb)[1] * 1e3:.1f} ms, step {sorted(st)[1] * 1e3:.1f} ms"


def measure_bound(num_params: int) -> None:
    """Host-device bandwidth (pinned, 1 GiB each way) and one CPUAdam step over `num_params` fp32."""
    import time

    from lightspeed.ops.adam import CPUAdam

    if torch.cuda.is_available():
        n = 1 << 30
        host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(n, dtype=torch.uint8, device="cuda")
        rates = {}
        for name, (dst, src) in {"host->device": (dev, host), "device->host": (host, dev)}.items():
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(5):
                dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            rates[name] = 5 * n / (time.perf_counter() - t0) / 1e9
            print(f"  pinned 1 GiB {name}: {rates[name]:.1f} GB/s", flush=True)
        del host, dev
    else:
        rates = {"host->device": float("nan"), "device->host": float("nan")}
    p = torch.nn.Parameter(torch.zeros(num_params))
    p.grad = torch.randn(num_params) * 1e-3
    opt = CPUAdam([p], lr=1e-4, weight_decay=0.1, adamw_mode=True)
    opt.step()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    adam_s = min(times)
    traffic = num_params * 4 * 7  # read p, m, v, g; write p, m, v
    print(f"  CPUAdam over {num_params / 1e6:.0f}M fp32 params, {torch.get_num_threads()} threads: "
          f"{adam_s * 1e3:.1f} ms ({traffic / adam_s / 1e9:.1f} GB/s of its memory traffic)", flush=True)
    copies = num_params * 2 / (rates["device->host"] * 1e9) + num_params * 2 / (rates["host->device"] * 1e9)
    print(f"  floor of the offloaded part of a step (bf16 gradients out, bf16 parameters in, CPU step, "
          f"in series): {(copies + adam_s) * 1e3:.1f} ms", flush=True)
    del p, opt


def measure_host_step(num_params: int, threads: int | None = None) -> None:
    """The offloaded ZeRO step of CPUAdam alone (`begin_zero_step` / `zero_step_range`, no device):
    fp32 masters and state with and without a coefficient (clipping / loss scaling), bf16 masters
    with fp32 state and with bf16 state (`bf16.bf16_optimizer_states`). Prints the host bytes each
    parameter holds (master, gradient, moments) and ms per step. The coefficient is 1.0, which takes
    the coefficient path while leaving the gradient's values unchanged from step to step."""
    import time

    from lightspeed.ops.adam import CPUAdam

    if threads:
        torch.set_num_threads(threads)
    cases = (("fp32 masters+state, no coefficient", torch.float32, True, None),
             ("fp32 masters+state, coefficient", torch.float32, True, 1.0),
             ("bf16 masters, fp32 state, coefficient", torch.bfloat16, True, 1.0),
             ("bf16 masters, bf16 state, coefficient", torch.bfloat16, False, 1.0))
    for name, dtype, fp32_state, coef in cases:
        gen = torch.Generator().manual_seed(0)
        p = torch.randn(num_params, generator=gen).to(dtype)
        g = (torch.randn(num_params, generator=gen) * 1e-3).to(dtype)
        opt = CPUAdam([p], lr=1e-4, weight_decay=0.1, fp32_optimizer_states=fp32_state)
        scale = None if coef is None else torch.tensor(coef)
        times, cpu = [], []
        for _ in range(8):
            t0, c0 = time.perf_counter(), time.process_time()
            for q in opt.begin_zero_step({p: g}, scale):
                opt.zero_step_range(q, 0, q.numel())
            opt.end_zero_step()
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        held = p.element_size() + g.element_size() + sum(
            t.element_size() for t in opt.state[p].values() if torch.is_tensor(t) and t.dim() > 0)
        print(f"  CPUAdam ZeRO step, {name}, {num_params / 1e6:.0f}M params, {torch.get_num_threads()} threads: "
              f"{sorted(times[1:])[3] * 1e3:.1f} ms wall, {sorted(cpu[1:])[3] * 1e3:.1f} ms CPU (medians of 7); "
              f"host bytes/param held {held}", flush=True)
        del p, g, opt


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--host-step", type=float, default=None, metavar="MPARAMS",
                    help="only time CPUAdam's offloaded ZeRO step over this many million parameters, and exit")
    ap.add_argument("--bound", action="store_true", help="also measure the host-device and CPU-step bound")
    ap.add_argument("--sizes", nargs="+", default=["gpt2-medium", "1.3b"])
    ap.add_argument("--stages", nargs="+", type=int, default=[2, 3])
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--overlap-step", action="store_true", help="also lightspeed's one-step-delayed CPU step")
    ap.add_argument("--param", action="store_true", help="also ZeRO-3 with the parameters offloaded")
    ap.add_argument("--zenflow", action="store_true", help="also ZenFlow, sequential and overlapped (stages 1-2)")
    ap.add_argument("--speculative", action="store_true", help="also the speculative CPU step (super_offload)")
    ap.add_argument("--deepspeed", action="store_true", help="also DeepSpeed's engine (must be importable)")
    ap.add_argument("--variants", nargs="+", default=None, choices=sorted(VARIANTS),
                    help="exactly these variants, for both systems (the size sweep: --variants cpu-param)")
    ap.add_argument("--phases", action="store_true", help="also time forward+backward and the step apart")
    ap.add_argument("--run-timeout", type=float, default=None,
                    help="seconds one configuration may take (the sweep: a run past it is reported and killed)")
    ap.add_argument("--meta", action="store_true",
                    help="lightspeed at ZeRO-3: build the model on the meta device (the strategy materializes it "
                         "unit by unit, never whole): for models whose fp32 copy does not fit the GPU")
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU, in seconds")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # size:system:stage:variant, in a child
    args = ap.parse_args()
    if args.host_step:
        measure_host_step(int(args.host_step * 1e6))
        return
    if args.smoke:
        os.environ["LIGHTSPEED_ACCELERATOR"] = "cpu"
        args.sizes, args.micro, args.seq, args.steps, args.warmup = ["demo"], 2, 32, 2, 1
    if args.one:
        size, system, stage, variant = args.one.split(":")
        print("RESULT " + json.dumps(asdict(run_one(args, size, system, int(stage), variant))), flush=True)
        return
    flags = ("--deepspeed", "--overlap-step", "--param", "--bound", "--zenflow", "--speculative")
    passthrough, skip = [], False
    for a in sys.argv[1:]:  # the child runs one configuration: drop the flags that choose them
        if a in ("--variants", "--run-timeout"):
            skip = True
        elif a.startswith("--"):
            skip = False
        if not skip and a not in flags:
            passthrough.append(a)
    for size in args.sizes:
        cfg = GPTConfig.preset(size, block_size=args.seq)
        with torch.device("meta"):
            num_params = GPT(cfg).num_params()
        hw = torch.cuda.get_device_name() if torch.cuda.is_available() and not args.smoke else "cpu"
        print(f"\n== {size}: {num_params / 1e6:.0f}M params, micro batch {args.micro} x seq {args.seq}, {hw}, "
              f"torch {torch.__version__}, world size 1, each run in a fresh process", flush=True)
        if args.bound:
            measure_bound(num_params)
        runs = []
        for stage in args.stages:
            variants = ["none", "cpu"] + (["cpu-overlap"] if args.overlap_step else [])
            variants += ["cpu-param"] if args.param and stage == 3 else []
            ds_variants = ["none", "cpu"]
            if args.zenflow and stage in (1, 2):
                variants += list(ZENFLOW)
                ds_variants += list(ZENFLOW)
            if args.speculative:
                variants += ["cpu-super", "cpu-super-copy"]
                ds_variants.append("cpu-super")  # DeepSpeed's SuperOffload: stage 3 on Grace Hopper only
            if args.variants:
                variants = ds_variants = [v for v in args.variants if stage == 3 or v != "cpu-param"]
            runs += [("lightspeed", stage, v) for v in variants]
            runs += [("deepspeed", stage, v) for v in ds_variants if v != "cpu-overlap"] if args.deepspeed else []
        results = []
        for system, stage, variant in runs:
            env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(29600 + len(results)))
            start = time.perf_counter()
            try:
                proc = subprocess.run([sys.executable, __file__, *passthrough, "--one",
                                       f"{size}:{system}:{stage}:{variant}"], env=env, capture_output=True,
                                      text=True, timeout=args.run_timeout)
                stdout, stderr, code = proc.stdout, proc.stderr, proc.returncode
            except subprocess.TimeoutExpired as err:
                stdout = err.stdout.decode(errors="replace") if isinstance(err.stdout, bytes) else (err.stdout or "")
                stderr = f"killed after {args.run_timeout:.0f} s"
                code = None
            wall = time.perf_counter() - start
            line = next((ln for ln in stdout.splitlines() if ln.startswith("RESULT ")), None)
            if args.phases:
                print("\n".join(ln for ln in stdout.splitlines() if not ln.startswith("RESULT ")), flush=True)
            if line is None:
                tail = (stderr.strip().splitlines() or ["no output"])[-1]
                why = f"exit code {code}: " if code not in (None, 1) else ""  # -9: killed (host memory)
                results.append(Result(f"{system} ZeRO-{stage} {variant}", note=f"failed: {why}{tail[:120]}"))
            else:
                results.append(Result(**json.loads(line[len("RESULT "):])))
            results[-1].note += f"; {wall:.0f} s wall"
            r = results[-1]  # each row as it comes: a run cut short by a time limit still reports
            print(f"  {r.name}: {r.ms_per_step:.1f} ms/step, {r.peak_gib:.2f} GiB  {r.note}", flush=True)
        print_table(results, f"lightspeed ZeRO-{args.stages[0]} {runs[0][2] if args.variants else 'none'}")


if __name__ == "__main__":
    main()
