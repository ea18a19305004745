"""One mixture-of-experts layer's experts at decode (Mixtral-8x7B's shapes by default: 8 experts of
4096 -> 14336 -> 4096, top 2, random weights and routes): transformers' fp16 experts module against
lightspeed's QuantizedExperts (FP6 / INT8 / INT4), microseconds per call.

Claim: quantized experts make a MoE decode step faster than fp16, and, run as grouped launches
with no host sync (`grouped_quantized_matmul`), can be replayed from a CUDA graph, which the per-expert
loop (it reads the routes back to the host) cannot. Rows per format:
- `graph`: the call replayed from a CUDA graph (GPU time; the quantized experts' grouped path; fp16:
  transformers' default for a model, `grouped_mm`);
- `eager`: events around eager calls (host launch overhead included when it exceeds GPU time);
- `loop`: the per-expert loop, eager (the quantized experts' path above MAX_GROUPED_ROWS routes; fp16:
  transformers' `eager` experts implementation).
"x fp16 best": over the fastest fp16 path measured (transformers 5.17's `grouped_mm` reads the routes
back to the host: it has no graph row). "floor" is the bytes of the experts the routes hit (distinct per
call) over the copy bandwidth; "err" the output against the fp16 module with the dequantized weights
(relative L2).

    python benchmarks/moe_decode.py                         # T = 1, 4, 16 tokens (GPU)
    python benchmarks/moe_decode.py --experts 60 --top-k 4 --hidden 2048 --inter 1408   # Qwen1.5-MoE-A2.7B
    python benchmarks/moe_decode.py --smoke                 # tiny, on CPU (reference path)
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.fp6_gemm import bench_us, copy_bandwidth  # noqa: E402
from lightspeed.inference.experts import QuantizedExperts, quantize_experts  # noqa: E402


def _experts_module(hidden: int, inter: int, experts: int, dtype, device):
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    cfg = MixtralConfig(hidden_size=hidden, intermediate_size=inter, num_local_experts=experts)
    module = MixtralExperts(cfg)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape) * 0.02)
    return module.to(device=device, dtype=dtype).eval()


def _fp16_impl(device) -> str:
    """What a transformers MoE model's experts run by default: `grouped_mm` (torch._grouped_mm) where it
    can dispatch (CUDA), else the eager loop."""
    return "grouped_mm" if device.type == "cuda" else "eager"


def _routes(tokens: int, experts: int, k: int, seed: int, device):
    gen = torch.Generator().manual_seed(seed)
    index = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, k, generator=gen), -1)
    return index.to(device), weights.to(device=device, dtype=torch.float16 if device.type == "cuda" else torch.float32)


def _time(fn, timing: str) -> float:
    if timing == "graph":
        try:
            return bench_us(lambda i: fn(), 1, timing="graph")
        except RuntimeError as err:  # a host sync inside the capture
            print(f"    (no graph: {str(err).splitlines()[0][:80]})")
            return float("nan")
    return bench_us(lambda i: fn(), 1, timing="events")


def run(args) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    bw = copy_bandwidth(device)
    if bw == bw:
        print(f"device-to-device copy bandwidth: {bw / 1e12:.2f} TB/s")
    base = _experts_module(args.hidden, args.inter, args.experts, dtype, device)
    models = {"fp16": base}
    for fmt in args.formats:
        holder = nn.Module()
        holder.experts = copy.deepcopy(base)
        quantize_experts(holder, fmt, None, lambda name: True, device=device, dtype=dtype)
        assert isinstance(holder.experts, QuantizedExperts)
        models[fmt] = holder.experts
    print(f"experts {args.experts} x (hidden {args.hidden}, intermediate {args.inter}), top {args.top_k}, "
          f"{dtype}, {device}")
    print(f"{'T':>4} {'format':<7} {'path':<6} {'us':>9} {'x fp16 best':>12} {'floor us':>9} {'of floor':>9} "
          f"{'err':>8}")
    for tokens in args.tokens:
        index, weights = _routes(tokens, args.experts, args.top_k, tokens, device)
        x = (torch.randn(tokens, args.hidden, generator=torch.Generator().manual_seed(1)) * 0.5).to(device, dtype)
        hit = int(index.unique().numel())
        with torch.no_grad():
            want = base(x, index, weights).float()
            fp16_best = float("inf")  # fp16's fastest path (it may have no graph: a host sync)
            for fmt, module in models.items():
                per_expert = (sum(p[0].numel() * p.element_size() for p in module.parameters()) if fmt == "fp16"
                              else sum(b.numel() * b.element_size() for s in module._stacks
                                       for b in (s.planes[0][0], s.scales[0])))
                floor = hit * per_expert / bw * 1e6 if bw == bw else float("nan")
                if fmt == "fp16":
                    err = 0.0
                else:
                    ref = copy.deepcopy(base)
                    ref.gate_up_proj.copy_(torch.stack([m.dequantize_weight() for m in module.gate_up]))
                    ref.down_proj.copy_(torch.stack([m.dequantize_weight() for m in module.down]))
                    got = module(x, index, weights).float()
                    err = ((got - ref(x, index, weights).float()).norm() / want.norm()).item()
                    del ref
                paths = [("graph", "graph"), ("eager", "events")] if device.type == "cuda" else [("eager", "events")]
                paths.append(("loop", "loop"))
                for path, timing in paths:
                    if fmt == "fp16":  # transformers' default for a model (grouped_mm), or its eager loop
                        module.config._experts_implementation = "eager" if path == "loop" else _fp16_impl(device)
                        us = _time(lambda: module(x, index, weights), "events" if path == "loop" else timing)
                    elif timing == "loop":
                        stacks = module._stacks
                        module._stacks = None
                        us = _time(lambda: module(x, index, weights), "events")
                        module._stacks = stacks
                    else:
                        us = _time(lambda: module(x, index, weights), timing)
                    if fmt == "fp16" and us == us:
                        fp16_best = min(fp16_best, us)
                    ratio = fp16_best / us if us == us else float("nan")
                    print(f"{tokens:>4} {fmt:<7} {path:<6} {us:>9.1f} {ratio:>11.2f}x {floor:>9.1f} "
                          f"{floor / us:>9.2f} {err:>8.4f}", flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--inter", type=int, default=14336)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--tokens", default="1,4,16")
    p.add_argument("--formats", default="fp6,int8,int4")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    args = p.parse_args(argv)
    args.tokens = [int(t) for t in args.tokens.split(",")]
    args.formats = [f for f in args.formats.split(",") if f]
    if args.smoke:
        args.hidden, args.inter, args.experts, args.tokens = 64, 96, 4, [1, 3]
    run(args)


if __name__ == "__main__":
    main()
