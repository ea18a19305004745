"""One mixture-of-experts layer's experts in training, forward + backward (the gated MLP on expert-sorted
rows: gate / up product, SwiGLU, down product, and the gradients of the rows and of every weight),
bf16, 8192 tokens by default, on two shapes:
- `mixtral`: Mixtral-8x7B, 8 experts of 4096 -> 14336 -> 4096, top 2;
- `fine`: DeepSeek-MoE-16B's routed experts, 64 experts of 2048 -> 1408 -> 2048, top 6.
Routes come from random router logits with a per-expert bias (uneven loads, as a router's are).

Rows ("path"), each the same products and FLOPs:
- `lightspeed`: `lightspeed.ops.grouped_gemm.grouped_mlp`, automatic backend (Note: [backend rule]: on a
  Hopper GPU in bf16 that is torch._grouped_mm, its tail rows zeroed; the CPU runs the reference loop);
- `lightspeed-triton`: the same, forced onto lightspeed's Triton kernels (CUDA, or TRITON_INTERPRET=1);
- `+routing`: `lightspeed` with permute before and the weighted unpermute after (from tokens [S, H]);
- `loop`: a per-expert loop of torch matmuls (the counts read back to the host once per step, as
  transformers' eager experts do);
- `torch._grouped_mm`: the same MLP written directly on torch._grouped_mm and its own autograd;
- `dense`: two dense matmuls of the same shapes over all rows (one expert's weights): the ceiling.
ms is the median over `--repeats` windows of `--steps` steps (after `--warmup`); TFLOP/s counts 18 R H I
(forward 6 R H I, backward twice that; R = tokens x top-k); "x loop" is the loop's time over the row's,
"of dense" the row's TFLOP/s over dense's. `--check` adds each row's largest relative error (output and
gradients, against the loop's, in fp32 norms).

    python benchmarks/moe_train.py                    # one GPU: both shapes
    python benchmarks/moe_train.py --tiny --check     # small shapes, on the CPU (a functional check)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.harness import sync  # noqa: E402
from lightspeed.ops.grouped_gemm import grouped_mlp, offsets_from_counts, permute, unpermute  # noqa: E402

SHAPES = {  # name: (experts, hidden, intermediate, top-k)
    "mixtral": (8, 4096, 14336, 2),
    "fine": (64, 2048, 1408, 6),
}
TINY = {"mixtral": (4, 64, 96, 2), "fine": (16, 32, 24, 6)}


def _problem(experts, hidden, inter, top_k, tokens, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=gen) + 0.5 * torch.randn(experts, generator=gen)
    probs, idx = torch.softmax(logits, -1).topk(top_k, dim=-1)
    weights = (probs / probs.sum(-1, keepdim=True)).to(device)
    x = torch.randn(tokens, hidden, generator=gen).to(device=device, dtype=dtype)
    # HF's parameter layouts ([E, 2I, H], [E, H, I]), read as [E, H, 2I] / [E, I, H] views
    w_gate_up = (torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5).to(device, dtype)
    w_down = (torch.randn(experts, hidden, inter, generator=gen) * inter ** -0.5).to(device, dtype)
    idx = idx.to(device)
    sorted_x, row_map, counts = permute(x, idx, experts)
    return dict(x=x, idx=idx, weights=weights, sorted_x=sorted_x.detach(), row_map=row_map, counts=counts,
                offsets=offsets_from_counts(counts), w_gate_up=w_gate_up.requires_grad_(),
                w_down=w_down.requires_grad_(), experts=experts)


def _mlp_loop(x, counts, w_gate_up, w_down):
    out, start = [], 0
    for e, c in enumerate(counts.tolist()):
        xe = x[start:start + c]
        gate, up = (xe @ w_gate_up[e].t()).chunk(2, dim=-1)
        out.append((F.silu(gate) * up) @ w_down[e].t())
        start += c
    return torch.cat(out)


def _mlp_torch_grouped(x, offsets, w_gate_up, w_down):
    gate, up = torch._grouped_mm(x, w_gate_up.transpose(1, 2), offs=offsets).chunk(2, dim=-1)
    return torch._grouped_mm(F.silu(gate) * up, w_down.transpose(1, 2), offs=offsets)


def _paths(p, device):
    """name -> forward(sorted rows) -> out (None: `+routing`, which starts from the tokens), or the reason
    the path cannot run here."""
    off, counts = p["offsets"], p["counts"]
    gu, dn = p["w_gate_up"], p["w_down"]
    paths = {
        "lightspeed": lambda x: grouped_mlp(x, off, gu.transpose(1, 2), dn.transpose(1, 2)),
        "lightspeed-triton": lambda x: grouped_mlp(x, off, gu.transpose(1, 2), dn.transpose(1, 2),
                                                   backend="triton"),
        "+routing": None,
        "loop": lambda x: _mlp_loop(x, counts, gu, dn),
        "torch._grouped_mm": lambda x: _mlp_torch_grouped(x, off, gu, dn),
        "dense": lambda x: _dense(x, gu, dn),
    }
    interpreting = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if device.type != "cuda" and not interpreting:
        paths["lightspeed-triton"] = "needs CUDA (or TRITON_INTERPRET=1)"
    if not hasattr(torch, "_grouped_mm"):
        paths["torch._grouped_mm"] = "this torch has no torch._grouped_mm"
    return paths


def _dense(x, gu, dn):
    gate, up = (x @ gu[0].t()).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ dn[0].t()


def _step_fn(name, fn, p):
    """One forward + backward: (out, grads of the input rows and of both weights)."""
    gu, dn = p["w_gate_up"], p["w_down"]

    def step():
        if name == "+routing":
            x = p["x"].detach().requires_grad_()
            w = p["weights"].detach().requires_grad_()
            rows, row_map, _ = permute(x, p["idx"], p["experts"])
            y = grouped_mlp(rows, p["offsets"], gu.transpose(1, 2), dn.transpose(1, 2))
            out = unpermute(y, row_map, w)
            return out, torch.autograd.grad(out, [x, w, gu, dn], torch.full_like(out, 0.01))
        x = p["sorted_x"].detach().requires_grad_()
        out = fn(x)
        return out, torch.autograd.grad(out, [x, gu, dn], torch.full_like(out, 0.01))
    return step


def _time(step, warmup, steps, repeats):
    for _ in range(warmup):
        step()
    sync()
    windows = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        windows.append((time.perf_counter() - t0) * 1e3 / steps)
    return statistics.median(windows)


def _rel_err(got, want):
    got, want = got.float(), want.float()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def run_shape(name, shape, args, device, dtype):
    experts, hidden, inter, top_k = shape
    p = _problem(experts, hidden, inter, top_k, args.tokens, dtype, device)
    rows = args.tokens * top_k
    flops = 18 * rows * hidden * inter
    counts = p["counts"].tolist()
    print(f"\n{name}: {experts} experts of {hidden} -> {inter} -> {hidden}, top {top_k}, {args.tokens} tokens "
          f"({rows} rows; per expert min {min(counts)} / max {max(counts)}), {dtype}, {device}")
    paths = _paths(p, device)
    ref = None
    if args.check:
        out, grads = _step_fn("loop", paths["loop"], p)()
        ref = (out.detach(), [g.detach() for g in grads])
    results = {}
    for path, fn in paths.items():
        if isinstance(fn, str):
            results[path] = (float("nan"), fn, float("nan"))
            continue
        try:
            step = _step_fn(path, fn, p)
            err = float("nan")
            if ref is not None and path not in ("dense", "+routing"):
                out, grads = step()
                err = max([_rel_err(out, ref[0])] + [_rel_err(g, r) for g, r in zip(grads, ref[1])])
            ms = _time(step, args.warmup, args.steps, args.repeats)
            results[path] = (ms, "", err)
        except (RuntimeError, ValueError) as exc:
            results[path] = (float("nan"), f"failed: {str(exc).splitlines()[0][:70]}", float("nan"))
    loop_ms = results["loop"][0]
    dense_tf = flops / results["dense"][0] / 1e9 if results["dense"][0] == results["dense"][0] else float("nan")
    print(f"{'path':<20}{'ms':>10}{'TFLOP/s':>10}{'x loop':>9}{'of dense':>10}{'err':>10}  note")
    for path, (ms, note, err) in results.items():
        tf = flops / ms / 1e9 if ms == ms else float("nan")
        print(f"{path:<20}{ms:>10.3f}{tf:>10.2f}{loop_ms / ms:>9.2f}{tf / dense_tf:>10.2f}{err:>10.2e}  {note}",
              flush=True)
    return results


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="mixtral,fine", help=f"comma-separated of {', '.join(SHAPES)}")
    ap.add_argument("--tokens", type=int, default=None, help="tokens per step (default 8192; --tiny 64)")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--steps", type=int, default=None, help="steps per timed window (default 10; --tiny 3)")
    ap.add_argument("--repeats", type=int, default=5, help="timed windows; the median is reported")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--tiny", action="store_true", help="small shapes (runs on the CPU)")
    ap.add_argument("--cpu", action="store_true", help="run on the CPU even when CUDA is available")
    ap.add_argument("--check", action="store_true", help="each path's relative error against the loop")
    args = ap.parse_args(argv)
    args.tokens = args.tokens or (64 if args.tiny else 8192)
    args.steps = args.steps or (3 if args.tiny else 10)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    table = TINY if args.tiny else SHAPES
    print(f"torch {torch.__version__}; device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}")
    for name in args.shapes.split(","):
        if name not in table:
            raise SystemExit(f"--shapes: unknown shape {name!r} (known: {', '.join(table)})")
        run_shape(name, table[name], args, device, dtype)


if __name__ == "__main__":
    main()
