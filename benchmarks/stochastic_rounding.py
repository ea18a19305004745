"""Stochastic rounding of bf16 master weights and optimizer state (``bf16.stochastic_rounding``): its
effect on convergence against round-to-nearest bf16 masters and fp32 masters.

    python benchmarks/stochastic_rounding.py [--device cpu|cuda] [--task mlp|gpt] [--steps N] [--lr LR]
        [--offload] [--smoke]

Trains one model through the engine (ZeRO stage 1, one process, bf16 compute, AdamW) three times with
the same initialisation, data and seed: fp32 masters and state (bf16's default), bf16 masters and
state rounded to nearest (``bf16_master_weights_and_grads`` + ``bf16_optimizer_states``), and the same
with ``stochastic_rounding``. With --offload the bf16 runs keep their masters on the host (the CPU Adam,
``offload_optimizer.device "cpu"``, bf16 state). Reported per run: the mean training loss of the last
tenth of the steps ("final"), the mean over all steps ("average"), the held-out loss after training,
each also as a ratio to the fp32-master run, and the mean step time.

Tasks: "mlp" (default) is a teacher-student regression (an MLP 64-256-256-1 fits a fixed random
teacher of the same shape), where an Adam update of about `lr` per element is below half a bf16 gap
of most weights at a small learning rate (1e-4 against weights of 0.03-0.2, gaps of 2**-12 to
2**-10): round-to-nearest drops most updates, stochastic rounding applies them on average. "gpt" is
examples/gpt.py's byte-level demo GPT on its Shakespeare text (examples/data.py). On the GPU the
fused optimizer's Triton kernel rounds; on the CPU its reference path (torch.randint).
--kernel N also times the optimizer step alone: FusedAdam on one bf16 master of N elements with bf16
state (ZeRO's fused step, `grads=`), round-to-nearest against stochastic rounding (on the GPU the
Triton kernel, which adds a Philox draw per element; on the CPU the reference path).
--smoke runs a few steps of each (the script's own check).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import lightspeed  # noqa: E402

RUNS = ("fp32 masters", "bf16 masters, round-to-nearest", "bf16 masters, stochastic rounding")


def config(run: str, args) -> dict:
    bf16 = {"enabled": True}
    zero = {"stage": 1}
    if run != RUNS[0]:
        bf16.update(bf16_master_weights_and_grads=True, bf16_optimizer_states=True,
                    stochastic_rounding=run == RUNS[2])
        if args.offload:
            zero["offload_optimizer"] = {"device": "cpu"}
    return {"train_micro_batch_size_per_gpu": args.micro, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
            "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.0, "betas": [0.9, 0.999]}},
            "bf16": bf16, "zero_optimization": zero}


class MLPTask:
    """y = teacher(x) for a fixed random MLP teacher; the student starts from another random MLP."""

    def __init__(self, args):
        self.device, self.micro, self.seed = args.device, args.micro, args.seed
        torch.manual_seed(args.seed + 1)
        self.teacher = self._mlp().to(args.device)
        gen = torch.Generator().manual_seed(args.seed + 2)
        self.val_x = torch.randn(1024, 64, generator=gen).to(args.device)
        with torch.no_grad():
            self.val_y = self.teacher(self.val_x)

    @staticmethod
    def _mlp() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 256),
                                   torch.nn.GELU(), torch.nn.Linear(256, 1))

    def model(self) -> torch.nn.Module:
        return self._mlp()

    def batch(self, step: int):
        gen = torch.Generator().manual_seed(self.seed * 100003 + step)
        x = torch.randn(self.micro, 64, generator=gen).to(self.device)
        with torch.no_grad():
            y = self.teacher(x)
        return x, y

    @staticmethod
    def loss(engine, x, y) -> torch.Tensor:
        return torch.nn.functional.mse_loss(engine(x.bfloat16()).float(), y)

    def val_loss(self, engine) -> float:
        with torch.no_grad():
            return float(self.loss(engine, self.val_x, self.val_y))


class GPTTask:
    """examples/gpt.py's demo GPT on the Shakespeare bytes of examples/data.py."""

    def __init__(self, args):
        from data import train_val_datasets
        from gpt import GPTConfig

        self.device, self.micro, self.seed = args.device, args.micro, args.seed
        self.cfg = GPTConfig.preset("demo", n_layer=2, n_embd=64, block_size=64)
        self.train, self.val = train_val_datasets(self.cfg.block_size)

    def model(self) -> torch.nn.Module:
        from gpt import GPT

        return GPT(self.cfg)

    def _stack(self, data, idx):
        x, y = map(torch.stack, zip(*(data[int(i)] for i in idx)))
        return x.to(self.device), y.to(self.device)

    def batch(self, step: int):
        gen = torch.Generator().manual_seed(self.seed * 100003 + step)
        return self._stack(self.train, torch.randint(0, len(self.train), (self.micro,), generator=gen))

    @staticmethod
    def loss(engine, x, y) -> torch.Tensor:
        return engine(x, y).float()

    def val_loss(self, engine) -> float:
        gen = torch.Generator().manual_seed(self.seed + 7)
        total = 0.0
        with torch.no_grad():
            for _ in range(8):
                total += float(self.loss(engine, *self._stack(self.val, torch.randint(
                    0, len(self.val), (self.micro,), generator=gen))))
        return total / 8


def train(run: str, task, args) -> dict:
    torch.manual_seed(args.seed)  # the same initialisation for every run; also the rounding seed
    model = task.model().to(args.device)
    engine, *_ = lightspeed.initialize(model=model, model_parameters=model.parameters(), config=config(run, args),
                                       dist_init_required=False)
    losses, times = [], []
    for step in range(args.steps):
        x, y = task.batch(step)
        if args.device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        loss = task.loss(engine, x, y)
        engine.backward(loss)
        engine.step()
        if args.device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    tail = losses[-max(args.steps // 10, 1):]
    return {"final": sum(tail) / len(tail), "average": sum(losses) / len(losses), "val": task.val_loss(engine),
            "ms": 1e3 * sorted(times)[len(times) // 2], "first": losses[0]}


def time_kernel(n: int, device: str, repeats: int) -> dict:
    """Median ms of one FusedAdam step on a bf16 master of `n` elements with bf16 state, without and
    with stochastic rounding."""
    from lightspeed.ops.adam import FusedAdam

    out = {}
    for rounding in (False, True):
        gen = torch.Generator(device=device).manual_seed(0)
        p = torch.randn(n, generator=gen, device=device, dtype=torch.bfloat16)
        g = torch.randn(n, generator=gen, device=device, dtype=torch.bfloat16)
        opt = FusedAdam([p], lr=1e-4)
        opt.state_dtype = torch.bfloat16
        opt.stochastic_rounding, opt.rounding_seed = rounding, 1
        times = []
        for i in range(repeats + 3):
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            opt.step(grads={p: g})
            if device == "cuda":
                torch.cuda.synchronize()
            if i >= 3:
                times.append(time.perf_counter() - start)
        out[rounding] = 1e3 * sorted(times)[len(times) // 2]
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--task", default="mlp", choices=("mlp", "gpt"))
    p.add_argument("--steps", type=int, default=None, help="default: 600 (mlp), 300 (gpt)")
    p.add_argument("--lr", type=float, default=None, help="default: 1e-4 (mlp), 3e-4 (gpt)")
    p.add_argument("--micro", type=int, default=None, help="default: 64 (mlp), 16 (gpt)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--offload", action="store_true", help="bf16 runs: masters and state on the host (CPU Adam)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    p.add_argument("--kernel", type=int, default=0, metavar="N",
                   help="also time the optimizer step alone on a bf16 master of N elements")
    p.add_argument("--smoke", action="store_true", help="a few steps of each run (checks the script)")
    args = p.parse_args(argv)
    defaults = {"mlp": (600, 1e-4, 64), "gpt": (300, 3e-4, 16)}[args.task]
    args.steps = args.steps or (5 if args.smoke else defaults[0])
    args.lr = args.lr or defaults[1]
    args.micro = args.micro or defaults[2]
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device")
    task = MLPTask(args) if args.task == "mlp" else GPTTask(args)
    rows = {}
    for run in RUNS:
        rows[run] = train(run, task, args)
        r = rows[run]
        print(f"  {run}: first {r['first']:.5f}, final {r['final']:.5f}, average {r['average']:.5f}, "
              f"held-out {r['val']:.5f}, {r['ms']:.2f} ms/step", flush=True)
    base = rows[RUNS[0]]
    where = "host (CPU Adam)" if args.offload else args.device
    print(f"\ntask {args.task}, {args.steps} steps, lr {args.lr:g}, micro batch {args.micro}, device {args.device}, "
          f"bf16 masters on {where}, torch {torch.__version__}")
    print(f"{'run':<36} {'final':>9} {'x fp32':>7} {'average':>9} {'x fp32':>7} {'held-out':>9} {'x fp32':>7} "
          f"{'ms/step':>8}")
    for run, r in rows.items():
        print(f"{run:<36} {r['final']:>9.5f} {r['final'] / base['final']:>7.3f} {r['average']:>9.5f} "
              f"{r['average'] / base['average']:>7.3f} {r['val']:>9.5f} {r['val'] / base['val']:>7.3f} "
              f"{r['ms']:>8.2f}")
    if args.kernel:
        ms = time_kernel(args.kernel, args.device, 3 if args.smoke else 20)
        moved = args.kernel * 14  # bytes: read p, g, m, v; write p, m, v (bf16)
        print(f"\nFusedAdam step, {args.kernel:,} bf16 elements with bf16 state on {args.device}: round-to-nearest "
              f"{ms[False]:.3f} ms ({moved / ms[False] / 1e6:.1f} GB/s), stochastic rounding {ms[True]:.3f} ms "
              f"({moved / ms[True] / 1e6:.1f} GB/s), x{ms[True] / ms[False]:.2f}")
    if args.smoke:
        assert all(r["final"] == r["final"] for r in rows.values()), "a run's loss is nan"
        print("smoke: ok")


if __name__ == "__main__":
    main()
