"""Block-sparse self-attention (lightspeed.ops.sparse_attention: DeepSpeed's SparseSelfAttention on
compiled FlexAttention) vs dense scaled_dot_product_attention (the flash kernel) on the same length.

Claim: at 90% block sparsity the sparse forward + backward is >= 5x faster than dense flash attention
at 64k tokens. Reported per sequence length: the layout's measured block sparsity, ms per forward and
per forward + backward of each, and the speed-ups. Before timing, `--check` (on by default) compares
the compiled path with the dense masked reference at 2k tokens (block 16 and 128; rpe, an additive
key-padding mask and a multiplicative attention mask), forward and gradients.

    python benchmarks/sparse_attention.py --device cuda                    # 16k, 32k, 64k; bf16; block 128
    python benchmarks/sparse_attention.py --device cuda --block 16         # DeepSpeed's default block
    python benchmarks/sparse_attention.py --device cuda --layout fixed     # another kind (see LAYOUTS)
    python benchmarks/sparse_attention.py --smoke                          # tiny, CPU: eager flex, forward only
    python benchmarks/sparse_attention.py --device cuda --json out.json    # also write the rows

The layout: BigBird by default (a sliding window, random blocks and one global block row / column),
its window and random counts chosen per length so about `--density` (0.1) of the blocks are computed;
the measured sparsity is printed. Timing: CUDA events around `--iters` calls after warm-up (the first
call compiles), median of `--repeats` windows.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from lightspeed.ops import sparse_attention as sa  # noqa: E402
from lightspeed.ops.sparse_attention import reference  # noqa: E402

LAYOUTS = ("bigbird", "fixed", "bslongformer", "variable")


def make_config(kind: str, heads: int, block: int, seq_len: int, density: float) -> sa.SparsityConfig:
    """A layout of `kind` computing about `density` of the blocks at `seq_len`."""
    n = seq_len // block
    budget = max(3, round(density * n))  # blocks per row
    if kind == "bigbird":
        window = max(3, (budget // 2) | 1)
        return sa.BigBirdSparsityConfig(heads, block=block, different_layout_per_head=True,
                                        num_random_blocks=max(0, budget - window - 2), num_sliding_window_blocks=window)
    if kind == "fixed":  # local windows of w blocks, one global block per window: about w + n / w per row
        local = max(2, round(budget / 2))
        return sa.FixedSparsityConfig(heads, block=block, num_local_blocks=local)
    if kind == "bslongformer":
        return sa.BSLongformerSparsityConfig(heads, block=block, num_sliding_window_blocks=max(3, (budget - 2) | 1))
    local = max(2, budget - 1)
    return sa.VariableSparsityConfig(heads, block=block, local_window_blocks=[local], global_block_indices=[0])


def _time_ms(fn, iters: int, repeats: int) -> float:
    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) * 1e3 / iters
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    windows = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        windows.append(start.elapsed_time(end) / iters)
    return sorted(windows)[len(windows) // 2]


def _dense(q, k, v):
    if q.is_cuda and q.dtype != torch.float32:  # the flash kernel takes 16-bit inputs only
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v)
    return F.scaled_dot_product_attention(q, k, v)


def check(device: str, dtype: torch.dtype, heads: int, head_dim: int) -> list[str]:
    """The compiled path vs the dense masked reference (fp32 math) at 2k tokens; returns failures."""
    failures = []
    L, B = 2048, 2
    for block in (16, 128):
        random.seed(0)
        config = sa.BigBirdSparsityConfig(heads, block=block, different_layout_per_head=True, num_random_blocks=2)
        module = sa.SparseSelfAttention(config, max_seq_length=L, backend="flex").to(device)
        g = torch.Generator(device=device).manual_seed(0)
        q, k, v = (torch.randn(B, heads, L, head_dim, device=device, generator=g, dtype=dtype) for _ in range(3))
        rpe = (0.1 * torch.randn(B, heads, L, L, device=device, generator=g)).to(dtype)
        kpm = torch.where(torch.rand(B, L, device=device, generator=g) < 0.1, -10000.0, 0.0).to(dtype)
        am = (torch.rand(L, L, device=device, generator=g) > 0.2).to(dtype)
        am.diagonal().fill_(1)
        grad = torch.randn(B, heads, L, head_dim, device=device, generator=g, dtype=dtype)
        results = []
        for path in ("flex", "reference"):
            inputs = [t.clone().requires_grad_() for t in (q, k, v)]
            if path == "flex":
                out = module(*inputs, rpe=rpe, key_padding_mask=kpm, attn_mask=am)
            else:
                out = reference.sparse_attention(*inputs, module.get_layout(L), block, head_dim ** -0.5, rpe=rpe,
                                                 key_padding_mask=kpm, attn_mask=am)
            out.backward(grad)
            results.append([out.float()] + [t.grad.float() for t in inputs])
        tol = 2e-2 if dtype != torch.float32 else 2e-3
        for name, a, b in zip(("out", "dq", "dk", "dv"), *results):
            err = (a - b).abs().max().item() / max(b.abs().max().item(), 1e-6)
            status = "ok" if err <= tol else "FAIL"
            print(f"check block={block:4d} {name}: max |flex - reference| / max |reference| = {err:.2e} {status}")
            if status == "FAIL":
                failures.append(f"block {block} {name}")
    return failures


def run_length(args, L: int, dtype: torch.dtype, cuda: bool) -> dict:
    random.seed(0)
    config = make_config(args.layout, args.heads, args.block, L, args.density)
    module = sa.SparseSelfAttention(config, max_seq_length=L, backend="flex").to(args.device)
    sparsity = 1.0 - module.get_layout(L).float().mean().item()
    g = torch.Generator(device=args.device).manual_seed(0)
    q, k, v = (torch.randn(args.batch, args.heads, L, args.head_dim, device=args.device, generator=g,
                           dtype=dtype, requires_grad=cuda) for _ in range(3))
    grad = torch.randn_like(q)
    with torch.no_grad():
        sparse_fwd = _time_ms(lambda: module(q, k, v), args.iters, args.repeats)
        dense_fwd = _time_ms(lambda: _dense(q, k, v), args.iters, args.repeats)
    sparse_fb = dense_fb = float("nan")
    if cuda:  # torch's eager (CPU) flex_attention has no backward
        sparse_fb = _time_ms(lambda: torch.autograd.backward(module(q, k, v), grad), args.iters, args.repeats)
        dense_fb = _time_ms(lambda: torch.autograd.backward(_dense(q, k, v), grad), args.iters, args.repeats)
    return {"tokens": L, "block_sparsity": sparsity, "sparse_fwd_ms": sparse_fwd, "dense_fwd_ms": dense_fwd,
            "speedup_fwd": dense_fwd / sparse_fwd, "sparse_fwd_bwd_ms": sparse_fb, "dense_fwd_bwd_ms": dense_fb,
            "speedup_fwd_bwd": dense_fb / sparse_fb, "layout": args.layout, "block": args.block,
            "config": repr(config)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[16384, 32768, 65536])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--density", type=float, default=0.1, help="fraction of blocks computed (0.1: 90%% sparse)")
    parser.add_argument("--layout", choices=LAYOUTS, default="bigbird")
    parser.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-check", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on CPU (eager flex, forward only)")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    if args.smoke:
        args.device, args.seq_lens, args.heads, args.head_dim, args.block = "cpu", [512], 2, 16, 16
        args.iters, args.repeats, args.no_check, dtype = 2, 1, True, torch.float32
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here (use --smoke for the CPU run)")
    # one compiled flex_attention per length and per check case: stay under dynamo's recompile limit
    # (past it, flex_attention would run unfused and materialise L x L scores)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    if not args.no_check and cuda:
        failures = check(args.device, dtype, heads=4, head_dim=64)
        if failures:
            print("check FAILED: " + ", ".join(failures))
            return 1
    rows = []
    print(f"{'tokens':>7} {'sparsity':>8} {'sparse fwd':>11} {'dense fwd':>10} {'x fwd':>6} "
          f"{'sparse f+b':>11} {'dense f+b':>10} {'x f+b':>6}   (ms; {args.layout}, block {args.block}, "
          f"B={args.batch} H={args.heads} D={args.head_dim} {args.dtype if not args.smoke else 'fp32'})")
    for L in args.seq_lens:
        row = run_length(args, L, dtype, cuda)
        rows.append(row)
        print(f"{L:>7} {row['block_sparsity']:>8.3f} {row['sparse_fwd_ms']:>11.3f} {row['dense_fwd_ms']:>10.3f} "
              f"{row['speedup_fwd']:>6.2f} {row['sparse_fwd_bwd_ms']:>11.3f} {row['dense_fwd_bwd_ms']:>10.3f} "
              f"{row['speedup_fwd_bwd']:>6.2f}")
        if cuda:
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
