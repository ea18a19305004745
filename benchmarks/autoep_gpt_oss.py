"""GPT-OSS's experts in training under AutoEP, forward + backward, one GPU: the biased, clamped
interleaved-SwiGLU gated MLP on expert-sorted rows (lightspeed.parallel.experts.grouped_mlp, what
`EPExperts` runs for the `gpt_oss` preset), against its per-expert loop and against transformers'
own `GptOssExperts` (eager: its per-expert loop, from the tokens and routes). bf16 by default, 8192
tokens, on two shapes (the models' expert shapes, fewer experts than 120B's would change nothing per
row):
- `20b`: gpt-oss-20b, 32 experts of 2880 -> 2880 (x2, gate|up) -> 2880, top 4;
- `120b`: gpt-oss-120b, 128 experts of the same widths, top 4.
Routes come from random router logits with a per-expert bias (uneven loads). Weights in the model's
layout ([E, H, 2I] / [E, I, H]) with random biases; the SwiGLU limit 7.0 and alpha 1.702 of the
models' configs.

Rows ("path"), each the same products and FLOPs (18 R H I; R = tokens x top-k):
- `grouped`: grouped_mlp, automatic backend (CUDA: ops/grouped_gemm's grouped_mm per projection,
  torch._grouped_mm for bf16 on Hopper, each row's expert bias added, the activation by torch);
- `grouped-triton`: the same forced onto ops/grouped_gemm's Triton kernels (CUDA, or TRITON_INTERPRET=1);
- `loop`: grouped_mlp_reference (a per-expert loop; DeepSpeed's `use_grouped_mm: false`);
- `no bias, silu halves`: grouped_mlp on the same weights without biases and with Mixtral's gating:
  the cost of the biases and of GPT-OSS's activation is the difference to `grouped`;
- `hf GptOssExperts`: transformers' module itself (its eager loop), from tokens [S, H] with the routes,
  including its own gather and weighted combine (needs transformers).
ms is the median over `--repeats` windows of `--steps` steps (after `--warmup`). `--check` adds each
row's largest relative error (output and gradients of the rows, weights and biases, fp32 norms)
against `loop` (`no bias, silu halves` and `hf GptOssExperts` compute other things: no error).

    python benchmarks/autoep_gpt_oss.py --device cuda --check     # one GPU: both shapes
    python benchmarks/autoep_gpt_oss.py --tiny --check            # small shapes on the CPU (a functional check)
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.harness import median_ms, rel_err  # noqa: E402
from lightspeed.parallel.experts.grouped_mlp import (ClampedSwiGLU, grouped_kernel, grouped_mlp,  # noqa: E402
                                                     grouped_mlp_reference)

SHAPES = {"20b": (32, 2880, 2880, 4), "120b": (128, 2880, 2880, 4)}  # experts, hidden, intermediate, top-k
TINY = {"20b": (4, 32, 24, 2), "120b": (8, 40, 16, 4)}
ALPHA, LIMIT = 1.702, 7.0


def _problem(experts, hidden, inter, top_k, tokens, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=gen) + 0.5 * torch.randn(experts, generator=gen)
    top, idx = logits.topk(top_k, dim=-1)
    weights = torch.softmax(top, -1)
    x = torch.randn(tokens, hidden, generator=gen)

    def param(*shape, scale):
        return (torch.randn(*shape, generator=gen) * scale).to(device, dtype).requires_grad_()

    w1 = param(experts, hidden, 2 * inter, scale=hidden ** -0.5)  # the model's [E, H, 2I]
    b1 = param(experts, 2 * inter, scale=0.1)
    w2 = param(experts, inter, hidden, scale=inter ** -0.5)
    b2 = param(experts, hidden, scale=0.1)
    order = torch.argsort(idx.reshape(-1), stable=True)
    counts = torch.bincount(idx.reshape(-1), minlength=experts)
    sorted_x = x.index_select(0, order // top_k)
    return dict(x=x.to(device, dtype), idx=idx.to(device), weights=weights.to(device, dtype),
                sorted_x=sorted_x.to(device, dtype), counts=counts.to(device), params=[w1, b1, w2, b2],
                experts=experts, hidden=hidden, inter=inter)


def _hf_experts(p):
    from types import SimpleNamespace

    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    cfg = SimpleNamespace(intermediate_size=p["inter"], num_local_experts=p["experts"], hidden_size=p["hidden"],
                          swiglu_alpha=ALPHA, swiglu_limit=LIMIT, _experts_implementation="eager")
    module = GptOssExperts(cfg).to(p["x"].device, p["x"].dtype)
    with torch.no_grad():
        for name, value in zip(("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"), p["params"]):
            getattr(module, name).copy_(value)
    return module


def _paths(p, device):
    glu = ClampedSwiGLU(ALPHA, LIMIT)
    counts = p["counts"]

    def ours(fn, **kw):
        return lambda x, w1, b1, w2, b2: fn(x, counts, w1.transpose(1, 2), w2.transpose(1, 2), glu, b_gate_up=b1,
                                            b_down=b2, **kw)

    paths = {"grouped": ours(grouped_mlp), "grouped-triton": ours(grouped_kernel, backend="triton"),
             "loop": ours(grouped_mlp_reference),
             "no bias, silu halves": lambda x, w1, b1, w2, b2: grouped_mlp(x, counts, w1.transpose(1, 2),
                                                                           w2.transpose(1, 2), F.silu),
             "hf GptOssExperts": "hf"}
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        paths["grouped-triton"] = "needs CUDA (or TRITON_INTERPRET=1)"
    return paths


def _step_fn(name, fn, p):
    """One forward + backward: (out, grads of the input and of every parameter)."""
    params = p["params"]
    if name == "hf GptOssExperts":
        module = _hf_experts(p)

        def step():
            x = p["x"].detach().requires_grad_()
            out = module(x, p["idx"], p["weights"])
            return out, torch.autograd.grad(out, [x, *module.parameters()], torch.full_like(out, 0.01))
        return step

    def step():
        x = p["sorted_x"].detach().requires_grad_()
        out = fn(x, *params)
        return out, torch.autograd.grad(out, [x, *params], torch.full_like(out, 0.01), allow_unused=True)
    return step


def run_shape(name, shape, args, device, dtype):
    experts, hidden, inter, top_k = shape
    p = _problem(experts, hidden, inter, top_k, args.tokens, dtype, device)
    rows = args.tokens * top_k
    flops = 18 * rows * hidden * inter
    counts = p["counts"].tolist()
    print(f"\n{name}: {experts} experts of {hidden} -> 2x{inter} -> {hidden} (biased, clamped SwiGLU), top {top_k}, "
          f"{args.tokens} tokens ({rows} rows; per expert min {min(counts)} / max {max(counts)}), {dtype}, {device}")
    paths = _paths(p, device)
    ref = None
    if args.check:
        out, grads = _step_fn("loop", paths["loop"], p)()
        ref = (out.detach(), [g.detach() for g in grads])
    results = {}
    for path, fn in paths.items():
        if isinstance(fn, str) and fn != "hf":
            results[path] = (float("nan"), fn, float("nan"))
            continue
        try:
            step = _step_fn(path, fn, p)
            err = float("nan")
            if ref is not None and path in ("grouped", "grouped-triton", "loop"):
                out, grads = step()
                err = max([rel_err(out, ref[0])] + [rel_err(g, r) for g, r in zip(grads, ref[1])])
            results[path] = (median_ms(step, args.warmup, args.steps, args.repeats), "", err)
        except (ImportError, RuntimeError, ValueError) as exc:
            results[path] = (float("nan"), f"failed: {str(exc).splitlines()[0][:70]}", float("nan"))
    loop_ms = results["loop"][0]
    print(f"{'path':<24}{'ms':>10}{'TFLOP/s':>10}{'x loop':>9}{'err':>10}  note")
    for path, (ms, note, err) in results.items():
        tf = flops / ms / 1e9 if ms == ms else float("nan")
        print(f"{path:<24}{ms:>10.3f}{tf:>10.2f}{loop_ms / ms:>9.2f}{err:>10.2e}  {note}", flush=True)
    return results


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    ap.add_argument("--shapes", default="20b,120b", help=f"comma-separated of {', '.join(SHAPES)}")
    ap.add_argument("--tokens", type=int, default=None, help="tokens per step (default 8192; --tiny 64)")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--steps", type=int, default=None, help="steps per timed window (default 10; --tiny 2)")
    ap.add_argument("--repeats", type=int, default=5, help="timed windows; the median is reported")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--tiny", action="store_true", help="small shapes, fp32, few steps (the CPU smoke mode)")
    ap.add_argument("--check", action="store_true", help="each path's relative error against the loop")
    args = ap.parse_args(argv)
    if args.tiny:
        args.tokens, args.steps, args.repeats, args.warmup = args.tokens or 64, args.steps or 2, 1, 1
        args.dtype = "fp32" if args.device == "cpu" else args.dtype
    args.tokens, args.steps = args.tokens or 8192, args.steps or 10
    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    table = TINY if args.tiny else SHAPES
    print(f"torch {torch.__version__}; device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}")
    for name in args.shapes.split(","):
        if name not in table:
            raise SystemExit(f"--shapes: unknown shape {name!r} (known: {', '.join(table)})")
        run_shape(name, table[name], args, device, dtype)


if __name__ == "__main__":
    main()
