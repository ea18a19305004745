"""Fused training kernels (the ``kernels`` config section) on one GPU: tokens/s, MFU and peak memory with and
without them, through lightspeed's engine with engine.compile(), against plain torch.compile, Liger-Kernel
(when importable) and DeepSpeed (when importable).

    python benchmarks/hf_kernels.py [--models llama-1b llama-8b-8l gpt-1.3b] [--stage 2] [--micro 1]
        [--seq 4096] [--steps 10] [--warmup 3] [--systems ...] [--smoke]
    python benchmarks/hf_kernels.py --ops [--seq 4096] [--ce-chunks 128 1024] [--smoke]  # each kernel alone
    python benchmarks/hf_kernels.py --largest-micro 64 [--models ...]  # each system's largest micro batch

Models: "llama-1b" is HF Llama-3.2-1B's shape (hidden 2048, 16 layers, 32 / 8 heads, MLP 8192, vocab
128256, tied embeddings), "llama-8b-8l" Llama-3-8B's shape cut to 8 layers (hidden 4096, MLP 14336, vocab
128256, untied), both random, bf16, SDPA attention; "gpt-1.3b" the examples' GPT 1.3B (benchmarks/zero_step.py's
model; the fused linear cross-entropy is its only kernel). Batch: --micro sequences of --seq tokens
(the GPT defaults to zero_step.py's 8 x 1024 unless --gpt-micro / --gpt-seq say otherwise).

Systems (each in a fresh process, world size 1):
- "torch.compile": plain PyTorch, fp32 params under bf16 autocast, torch.compile(model), fused AdamW;
- "lightspeed": lightspeed.initialize (bf16, ZeRO --stage, AdamW) + engine.compile(), kernels off;
- "lightspeed+kernels": the same with {"kernels": {"enabled": true}} (every kernel the model has a place for);
- "lightspeed+ce": the same with the fused linear cross-entropy only (RMSNorm, RoPE, SwiGLU left to the compiler);
- "lightspeed+liger": the same engine, kernels off, Liger-Kernel's apply_liger_kernel_to_llama(model=...)
  applied before initialize (HF Llama only; n/a unless `import liger_kernel` works: its wheel is pure
  Python and needs no other torch, `pip install --no-deps liger-kernel`, or LIGER_KERNEL_PATH=<unpacked wheel>);
- "deepspeed": DeepSpeed's engine (bf16, ZeRO --stage) + engine.compile(), when `import deepspeed` works.
MFU: 6 N + 12 L H T FLOPs per token (N: the parameters taking part in matmuls, the LM head included, the
input embedding excluded unless tied; the attention term ignores causal masking, as PaLM's does) over the
H200's dense bf16 peak. --largest-micro M: per model and system, micro batches 1, 2, 4, ... up to M (each
a fresh process running --warmup + 2 steps) until one fails (out of memory); the table gives the largest
that ran, its tokens/s and peak. --smoke: tiny models on CPU (Triton not used: the kernels' reference path),
the aot_eager backend, two steps; keeps the script alive without a GPU. --chunk-size N: the fused
linear cross-entropy's tokens per chunk in the lightspeed+kernels / +ce rows (default: its rule).
--ops: each kernel alone (forward + backward) against the reference eager and compiled, and Liger-Kernel's
kernel for the same op when importable; --ce-chunks adds one linear + cross-entropy row per chunk size.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import lightspeed  # noqa: E402
from benchmarks.harness import H200_BF16_PEAK_FLOPS, Result, peak_gib, print_table, reset_memory, time_steps  # noqa: E402
from examples.gpt import GPT, GPTConfig  # noqa: E402

LR = 1e-4
SYSTEMS = ("torch.compile", "lightspeed", "lightspeed+kernels", "lightspeed+ce", "lightspeed+liger", "deepspeed")
KERNELS = {"lightspeed+kernels": {"enabled": True},
           "lightspeed+ce": {"enabled": True, "rms_norm": False, "rope": False, "swiglu": False}}
LLAMA_SHAPES = {
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True, head_dim=64),
    "llama-8b-8l": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=8, num_attention_heads=32,
                        num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False, head_dim=128),
    "llama-smoke": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=256, tie_word_embeddings=True, head_dim=16),
}


def build(name: str, seq: int):
    """(model, flops per token, kind) for `name`, built on the current default device."""
    if name.startswith("gpt"):
        model = GPT(GPTConfig.preset("demo" if name == "gpt-smoke" else "1.3b", block_size=seq))
        return model, model.flops_per_token(seq), "gpt"
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = LLAMA_SHAPES[name]
    cfg = LlamaConfig(**shape, max_position_embeddings=max(seq, 128), rope_theta=500000.0)
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg)
    model.loss_type = "ForCausalLM"
    n = sum(p.numel() for p in model.parameters())
    if not shape["tie_word_embeddings"]:
        n -= model.model.embed_tokens.weight.numel()  # a lookup, no matmul
    flops = 6 * n + 12 * shape["num_hidden_layers"] * shape["hidden_size"] * seq
    return model, flops, "llama"


def ds_config(args, kernels: dict | None) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": args.micro, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
           "gradient_clipping": 1.0, "zero_optimization": {"stage": args.stage},
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.1}}}
    if not args.smoke:
        cfg["bf16"] = {"enabled": True}
    if kernels:
        cfg["kernels"] = dict(kernels, chunk_size=args.chunk_size) if args.chunk_size else kernels
    return cfg


def batches(vocab: int, args, device, n: int = 4):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (args.micro, args.seq + 1), generator=g).to(device) for _ in range(n)]


def loss_of(fwd, kind: str, b: torch.Tensor, device) -> torch.Tensor:
    b = b.to(device)
    if kind == "gpt":
        return fwd(b[:, :-1], b[:, 1:])
    return fwd(input_ids=b[:, :-1], labels=b[:, :-1]).loss


def _liger_path() -> None:
    path = os.environ.get("LIGER_KERNEL_PATH")
    if path and path not in sys.path:
        sys.path.insert(0, path)


def _liger(model) -> None:
    _liger_path()
    from liger_kernel.transformers import apply_liger_kernel_to_llama

    apply_liger_kernel_to_llama(model=model)


def run_one(args, name: str, system: str) -> Result:
    lightspeed.init_distributed(verbose=False)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    torch.manual_seed(0)
    with device:
        model, flops, kind = build(name, args.seq)
    data = batches(model.config.vocab_size, args, device)
    it = iter(range(10**9))
    reset_memory()
    if system == "torch.compile":
        fwd = torch.compile(model, backend=args.backend)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, fused=device.type == "cuda")

        def step():
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                loss = loss_of(fwd, kind, data[next(it) % len(data)], device)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()
    else:
        if system == "deepspeed":
            import deepspeed

            initialize = deepspeed.initialize
        else:
            initialize = lightspeed.initialize
        if system == "lightspeed+liger":
            if kind != "llama":
                return Result(f"{system}", note="n/a: Liger patches HF models only")
            try:
                _liger(model)
            except ImportError as err:
                return Result(system, note=f"n/a: {err}")
        engine, *_ = initialize(model=model, model_parameters=model.parameters(),
                                config=ds_config(args, KERNELS.get(system)))
        engine.compile(backend=args.backend)

        def step():
            loss = loss_of(engine, kind, data[next(it) % len(data)], engine.device)
            engine.backward(loss)
            engine.step()
            return loss.detach()

    ms, losses = time_steps(step, args.steps, args.warmup)
    r = Result(system, ms_per_step=ms, losses=losses)
    r.tokens_per_s = args.micro * args.seq / (ms / 1e3)
    r.mfu = flops * r.tokens_per_s / H200_BF16_PEAK_FLOPS
    r.peak_gib = peak_gib()
    r.note = f"loss {losses[0]:.3f} -> {losses[-1]:.3f}"
    return r


def bench_ops(args) -> None:
    """Each kernel alone, forward + backward: the Triton path against the reference eager and compiled
    (Llama-3.2-1B's shapes at --seq tokens; the CE head at vocab 128256)."""
    from lightspeed.ops import fused
    from lightspeed.ops.fused import reference

    device = torch.device("cpu" if args.smoke else "cuda")
    backend = "reference" if args.smoke else "triton"
    dt = torch.float32 if args.smoke else torch.bfloat16
    t, h, inter, heads, kv, hd, vocab = (32, 64, 96, 4, 2, 16, 256) if args.smoke else \
        (args.seq, 2048, 8192, 32, 8, 64, 128256)

    def leaf(*shape, scale=1.0):
        return (torch.randn(*shape, device=device) * scale).to(dt).requires_grad_()

    x, w = leaf(t, h), leaf(h)
    q, k = leaf(1, heads, t, hd), leaf(1, kv, t, hd)
    cos, sin = torch.randn(1, t, hd, device=device, dtype=dt), torch.randn(1, t, hd, device=device, dtype=dt)
    g, u = leaf(t, inter), leaf(t, inter)
    head, target = leaf(vocab, h, scale=0.02), torch.randint(0, vocab, (t,), device=device)
    cases = {
        "rms_norm": (lambda f: f(x, w, 1e-5), fused.rms_norm, reference.rms_norm),
        "rope": (lambda f: sum(o.float().sum() for o in f(q, k, cos, sin)), fused.apply_rope, reference.apply_rope),
        "swiglu": (lambda f: f(g, u), fused.swiglu, reference.swiglu),
        "linear_cross_entropy": (lambda f: f(x, head, target), fused.fused_linear_cross_entropy,
                                 reference.linear_cross_entropy),
    }
    liger = _liger_ops()
    print(f"\n== kernels alone, forward + backward, {t} tokens, {dt}, {device}"
          f"{'' if liger else ' (Liger-Kernel not importable)'}")
    print(f"{'op':<22}{'path':<20}{'ms':>9}{'peak GiB':>10}")
    for name, (call, fast, ref) in cases.items():
        kw = {"backend": backend}
        paths = [("fused " + backend, lambda *a, _f=fast, **k: _f(*a, **k, **kw)), ("reference eager", ref),
                 ("reference compiled", torch.compile(ref, backend=args.backend))]
        if name == "linear_cross_entropy":
            paths += [(f"fused chunk {c}", lambda *a, _c=c: fast(*a, chunk_size=_c, **kw)) for c in args.ce_chunks]
        if liger and not args.smoke:
            paths.append(("liger", liger[name]))
        for label, fn in paths:
            def step(fn=fn):
                out = call(fn)
                out.float().sum().backward()
                return out.detach().float().sum()

            reset_memory()
            try:
                ms, _ = time_steps(step, args.steps, args.warmup)
                print(f"{name:<22}{label:<20}{ms:>9.3f}{peak_gib():>10.2f}")
            except Exception as err:  # one failing path must not hide the others' figures
                print(f"{name:<22}{label:<20}  failed: {type(err).__name__}: {str(err)[:100]}")
            for p in (x, w, q, k, g, u, head):
                p.grad = None


def _liger_ops() -> dict | None:
    """Liger-Kernel's functional ops under the names of bench_ops' cases (None when not importable)."""
    _liger_path()
    try:
        from liger_kernel.transformers import functional as lf
    except ImportError:
        return None
    return {"rms_norm": lambda x, w, eps: lf.liger_rms_norm(x, w, eps, in_place=False),
            "rope": lambda q, k, cos, sin: lf.liger_rope(q, k, cos, sin),
            "swiglu": lf.liger_swiglu,
            "linear_cross_entropy": lambda x, w, t: lf.liger_fused_linear_cross_entropy(x, w, t)}


def _child(args, name: str, system: str, extra: list[str]) -> Result:
    """One run of `system` on `name` in a fresh process (this script with --one), its Result."""
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(29600 + SYSTEMS.index(system)))
    proc = subprocess.run([sys.executable, __file__, *sys.argv[1:], *extra, "--one", f"{name}:{system}"], env=env,
                          capture_output=True, text=True)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is not None:
        return Result(**json.loads(line[len("RESULT "):]))
    err = proc.stderr.strip()
    tail = (err.splitlines() or ["no output"])[-1]
    if "out of memory" in err.lower() or "OutOfMemoryError" in err:
        return Result(system, note="failed: out of memory")
    return Result(system, note="n/a: not importable" if "No module named" in tail else f"failed: {tail[:160]}")


def largest_micro(args, name: str) -> None:
    """Per system, the largest micro batch (1, 2, 4, ... <= --largest-micro) whose steps run."""
    seq = args.gpt_seq if name.startswith("gpt") else args.seq
    flag = "--gpt-micro" if name.startswith("gpt") else "--micro"
    print(f"{'run':<22}{'largest micro':>14}{'tokens/s':>11}{'peak GiB':>10}  the next size", flush=True)
    for system in args.systems:
        if system == "lightspeed+ce" and name.startswith("gpt"):
            continue
        best, why, micro = None, "", 1
        while micro <= args.largest_micro:
            r = _child(args, name, system, [flag, str(micro), "--steps", "2"])
            if r.ms_per_step != r.ms_per_step:  # nan: it did not run
                why = r.note
                break
            best, micro = r, micro * 2
        if best is None:
            print(f"{system:<22}{'none':>14}{'':>11}{'':>10}  {why}", flush=True)
        else:
            print(f"{system:<22}{micro // 2:>14}{best.tokens_per_s:>11.0f}{best.peak_gib:>10.2f}  "
                  f"{why or f'not tried (limit {args.largest_micro})'}; seq {seq}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["llama-1b", "llama-8b-8l", "gpt-1.3b"])
    ap.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--micro", type=int, default=1)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--gpt-micro", type=int, default=8)
    ap.add_argument("--gpt-seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--backend", default="inductor", help="torch.compile backend")
    ap.add_argument("--smoke", action="store_true", help="tiny models on CPU (keeps the script alive in CI)")
    ap.add_argument("--ops", action="store_true", help="only each kernel alone against its reference")
    ap.add_argument("--largest-micro", type=int, default=0, metavar="M",
                    help="find each system's largest micro batch up to M (doubling from 1) instead of timing")
    ap.add_argument("--chunk-size", type=int, default=None, help="the fused linear CE's tokens per chunk")
    ap.add_argument("--ce-chunks", type=int, nargs="*", default=[], help="--ops: CE rows at these chunk sizes")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # model:system, run in a child
    args = ap.parse_args()
    if args.smoke:
        os.environ["LIGHTSPEED_ACCELERATOR"] = "cpu"
        args.models = [{"llama-1b": "llama-smoke", "llama-8b-8l": "llama-smoke", "gpt-1.3b": "gpt-smoke"}.get(m, m)
                       for m in dict.fromkeys(args.models)]
        args.models = list(dict.fromkeys(args.models))
        args.seq, args.gpt_seq, args.steps, args.warmup = 32, 32, min(args.steps, 2), 1
        if "--micro" not in sys.argv:  # a child of --largest-micro keeps the size it was given
            args.micro = 2
        if "--gpt-micro" not in sys.argv:
            args.gpt_micro = 2
        args.backend = "aot_eager"
    if args.ops:
        bench_ops(args)
        return
    if args.one:
        name, system = args.one.split(":")
        if name.startswith("gpt"):
            args.micro, args.seq = args.gpt_micro, args.gpt_seq
        print("RESULT " + json.dumps(asdict(run_one(args, name, system))), flush=True)
        return
    hw = torch.cuda.get_device_name() if torch.cuda.is_available() and not args.smoke else "cpu"
    for name in args.models:
        micro, seq = (args.gpt_micro, args.gpt_seq) if name.startswith("gpt") else (args.micro, args.seq)
        print(f"\n== {name}: micro batch {micro} x seq {seq}, ZeRO-{args.stage}, {hw}, torch {torch.__version__}, "
              f"compile backend {args.backend}, each run in a fresh process", flush=True)
        if args.largest_micro:
            largest_micro(args, name)
            continue
        results = []
        for system in args.systems:
            if system == "lightspeed+ce" and name.startswith("gpt"):
                continue  # the fused loss is the GPT's only kernel: "lightspeed+kernels" is this row
            results.append(_child(args, name, system, []))
        print_table(results, "torch.compile")


if __name__ == "__main__":
    main()
