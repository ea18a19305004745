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

Note: [--deepspeed] adds a table per shape of the whole layer, forward + backward (gate, dispatch,
experts, combine, and the gate's l_aux in the backward), each system's
`MoE(hidden, expert=GatedMLP(hidden, inter), num_experts, ep_size=1, k, capacity_factor,
eval_capacity_factor=capacity_factor, min_capacity, drop_tokens)` from the same seed, in `--dtype`:
- `DeepSpeed 0.19.8 deepspeed.moe.layer.MoE`: real DeepSpeed, in a child process (`--deepspeed-python`,
  default this interpreter, with `--deepspeed-path` first on its PYTHONPATH, default
  $LIGHTSPEED_DS_SITE), one rank (`deepspeed.init_distributed`, then `set_deepspeed_parallelism()` for
  the ep_size 1 groups); DeepSpeed is never imported in this process. Its gate takes any k (top-1,
  top-2, and `topkgating` above 2), so both shapes run on both systems;
- `lightspeed deepspeed.moe.layer.MoE`: what a DeepSpeed user gets after
  `lightspeed.register_as_deepspeed()`, i.e. lightspeed.parallel.experts.MoE (DeepSpeed's design: the
  expert module deep-copied per expert, [experts, capacity, hidden] buffers), its expert
  lightspeed.parallel.experts.GatedMLP (the same module as this file's, which DeepSpeed's row uses), a
  recognised MLP, so the local experts run as batched matmuls (parallel/experts/batched.py; the note
  column says "experts batched" when that path engaged, "experts looped" otherwise);
- `lightspeed deepspeed.moe.layer.MoE, per-expert loop`: the same layer with `Experts.batched = False`
  (the loop over the expert modules, as DeepSpeed's);
- `lightspeed grouped-GEMM experts, same gate`: that layer's gate and routes, the experts' weights
  stacked and run through ops.grouped_gemm (`permute` -> `grouped_mlp` -> `unpermute`; no capacity
  padding). Not DeepSpeed's API: what the layer would give on the grouped kernels.
The default `drop_tokens=False` computes every route on both systems (the capacity is the largest
expert's load, so no token is dropped and the work is the same); `--drop-tokens` with
`--capacity-factor` applies DeepSpeed's capacity rule on both. TFLOP/s counts the experts' useful
18 R H I only; "x DS" is DeepSpeed's time over the row's; max load (the most routes any expert got,
before any drop: the capacity when drop_tokens=False), |out| and l_aux are the first step's (the same
routes give the same values on every row).

    python benchmarks/moe_train.py                    # one GPU: both shapes
    python benchmarks/moe_train.py --tiny --check     # small shapes, on the CPU (a functional check)
    python benchmarks/moe_train.py --device cpu --tiny --deepspeed   # the CPU smoke of the layer rows
    python benchmarks/moe_train.py --deepspeed --deepspeed-path /path/to/site-packages-with-deepspeed
        [--profile]   # and each whole-layer row's most expensive operators (torch.profiler)
    python benchmarks/moe_train.py --tiny --deepspeed \\
        --deepspeed-python ~/.cache/lightspeed/deepspeed-0.19.8-venv/bin/python   # CPU (DS_ACCELERATOR=cpu)
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.harness import emit_result, median_ms, rel_err, run_deepspeed_child, sync  # noqa: E402
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
                err = max([rel_err(out, ref[0])] + [rel_err(g, r) for g, r in zip(grads, ref[1])])
            ms = median_ms(step, args.warmup, args.steps, args.repeats)
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


# ---------------------------------------------------------------- the whole layer, against DeepSpeed's
class GatedMLP(nn.Module):
    """The expert DeepSpeed's row hands to `MoE(expert=...)`: x -> down(silu(gate(x)) * up(x)), no biases
    (Mixtral's). lightspeed's rows use lightspeed.parallel.experts.GatedMLP: the same parameters and
    computation, a class its batched experts recognise."""

    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_up = nn.Linear(hidden, 2 * inter, bias=False)
        self.down = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


def _build_layer(moe_cls, shape, args, device, dtype, expert_cls=GatedMLP):
    """`moe_cls(...)` with this run's settings, seeded so both systems start from the same weights, its
    expert-parallel group (size 1) set as `deepspeed.initialize` would; and the input tokens."""
    experts, hidden, inter, top_k = shape
    torch.manual_seed(0)
    layer = moe_cls(hidden_size=hidden, expert=expert_cls(hidden, inter), num_experts=experts, ep_size=1, k=top_k,
                    capacity_factor=args.capacity_factor, eval_capacity_factor=args.capacity_factor,
                    min_capacity=args.min_capacity, drop_tokens=args.drop_tokens).to(device, dtype)
    layer.set_deepspeed_parallelism()
    # the layer deep-copies one expert (identical experts); distinct ones make |out| depend on the routes
    gen = torch.Generator(device=device).manual_seed(3)
    with torch.no_grad():
        for module in layer.deepspeed_moe.experts.deepspeed_experts:
            for p in module.parameters():
                p.copy_(torch.randn(p.shape, generator=gen, device=device) * p.shape[-1] ** -0.5)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(args.tokens, hidden, generator=gen).to(device, dtype)
    return layer, x


def _layer_step(forward, params, x, grad_out):
    """One forward + backward of a layer `forward(x) -> (out, l_aux, exp_counts)`; returns all three."""
    def step():
        for p in params:
            p.grad = None
        xi = x.detach().requires_grad_()
        out, l_aux, counts = forward(xi)
        torch.autograd.backward([out, l_aux], [grad_out, torch.ones_like(l_aux)])
        return out, l_aux, counts
    return step


def _time_layer(name, forward, params, x, args, note=""):
    grad_out = torch.full_like(x, 0.01)
    step = _layer_step(forward, params, x, grad_out)
    torch.manual_seed(2)  # the gate's random draws (top-2's second-expert sampling) the same on both sides
    out, l_aux, counts = step()
    check = {"out_norm": out.float().norm().item(), "l_aux": l_aux.float().item(), "max_load": int(counts.max())}
    ms = median_ms(step, args.warmup, args.steps, args.repeats)
    row = {"system": name, "ms": ms, **check, "note": note}
    if getattr(args, "profile", False):
        row["profile"] = _profile(step)
    return row


def _profile(step, steps: int = 3, rows: int = 12) -> str:
    """Where a layer row's time goes (`--profile`): a table of its `rows` most expensive operators over
    `steps` steps by torch.profiler, sorted by GPU kernel time on CUDA (else by CPU time)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        sync()
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    return (f"top operators over {steps} steps, by {key}\n"
            + prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=60))


def _grouped_forward(layer):
    """lightspeed's grouped-GEMM path under the same gate: the compat layer's own gate and routes (its
    capacity drops included: a dropped route's index is -1, which `permute` drops), the experts' weights
    stacked into [E, 2I, H] / [E, H, I], `permute` -> `grouped_mlp` -> `unpermute`."""
    moe = layer.deepspeed_moe
    mods = moe.experts.deepspeed_experts
    w_gu = nn.Parameter(torch.stack([m.gate_up.weight.detach() for m in mods]))
    w_dn = nn.Parameter(torch.stack([m.down.weight.detach() for m in mods]))
    experts = len(mods)

    def forward(x):
        routes = moe.gate.routes(x)
        rows, row_map, counts = permute(x, routes.indices.t().contiguous(), experts)
        y = grouped_mlp(rows, offsets_from_counts(counts), w_gu.transpose(1, 2), w_dn.transpose(1, 2))
        return unpermute(y, row_map, routes.gates.t()), routes.l_aux, routes.exp_counts
    return forward, [w_gu, w_dn, *moe.gate.parameters()]


def _experts_note(layer, x) -> str:
    """Whether lightspeed's layer runs its experts batched on this input (the same check its forward makes)."""
    from lightspeed.parallel.experts.batched import batched_experts

    experts = layer.deepspeed_moe.experts
    probe = x.new_zeros(1, experts.num_local_experts, 1, x.shape[-1])
    return "experts batched" if experts.batched and batched_experts(experts.deepspeed_experts, probe) else \
        "experts looped"


def time_layers(moe_cls, system, shapes, args, device, dtype, grouped=False, expert_cls=GatedMLP):
    """{shape: [row, ...]}: `moe_cls`'s layer (its experts `expert_cls`), forward + backward, on each shape
    (and, with `grouped`, lightspeed's layer again with its experts looped, and lightspeed's grouped-GEMM
    experts under the same gate). A row that cannot run holds its reason."""
    out = {}
    for name, shape in shapes.items():
        rows = []
        try:
            layer, x = _build_layer(moe_cls, shape, args, device, dtype, expert_cls)
            note = _experts_note(layer, x) if grouped else ""
            rows.append(_time_layer(system, layer, list(layer.parameters()), x, args, note))
            if grouped:
                layer.deepspeed_moe.experts.batched = False
                rows.append(_time_layer(f"{system}, per-expert loop", layer, list(layer.parameters()), x, args,
                                        _experts_note(layer, x)))
                layer.deepspeed_moe.experts.batched = True
                fwd, params = _grouped_forward(layer)
                rows.append(_time_layer("lightspeed grouped-GEMM experts, same gate", fwd, params, x, args))
            del layer, x
        except (RuntimeError, ValueError, AssertionError, NotImplementedError) as exc:
            rows.append({"system": system, "error": " ".join(f"{type(exc).__name__}: {exc}".split())[:200]})
        if device.type == "cuda":
            torch.cuda.empty_cache()
        out[name] = rows
    return out


def _ds_child(args, shapes, device, dtype):
    """In DeepSpeed's interpreter: one rank, DeepSpeed's groups, its MoE layer timed on every shape."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
                      LOCAL_WORLD_SIZE="1")
    import deepspeed
    from deepspeed.moe.layer import MoE

    if device.type == "cuda":
        torch.cuda.set_device(0)
    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")
    name = f"DeepSpeed {deepspeed.__version__} deepspeed.moe.layer.MoE"
    emit_result({"version": deepspeed.__version__, "where": os.path.dirname(deepspeed.__file__),
                 "rows": time_layers(MoE, name, shapes, args, device, dtype)})


def deepspeed_rows(args, shapes):
    """DeepSpeed's rows, from its own interpreter (`--deepspeed-python`, `--deepspeed-path`)."""
    argv = [os.path.abspath(__file__), "--ds-child", "--shapes", ",".join(shapes), "--tokens", str(args.tokens),
            "--dtype", args.dtype, "--steps", str(args.steps), "--repeats", str(args.repeats), "--warmup",
            str(args.warmup), "--capacity-factor", str(args.capacity_factor), "--min-capacity",
            str(args.min_capacity)] + (["--drop-tokens"] if args.drop_tokens else []) \
        + (["--tiny"] if args.tiny else []) + (["--cpu"] if args.cpu else []) \
        + (["--profile"] if args.profile else [])
    results, err = run_deepspeed_child(argv, args.deepspeed_python, args.deepspeed_path,
                                       cpu=args.cpu or not torch.cuda.is_available(), timeout=args.timeout)
    if not results:
        return {name: [{"system": "DeepSpeed deepspeed.moe.layer.MoE", "error": err or "no result"}]
                for name in shapes}, ""
    return results[0]["rows"], f"DeepSpeed {results[0]['version']} from {results[0]['where']}"


def print_layer_table(name, shape, rows, args):
    experts, hidden, inter, top_k = shape
    flops = 18 * args.tokens * top_k * hidden * inter
    print(f"\n{name}, the whole MoE layer (gate + dispatch + experts + combine), forward + backward: {experts} "
          f"experts of {hidden} -> {inter} -> {hidden}, top {top_k}, {args.tokens} tokens; drop_tokens="
          f"{args.drop_tokens}, capacity_factor={args.capacity_factor}, min_capacity={args.min_capacity}")
    ds = next((r for r in rows if r["system"].startswith("DeepSpeed") and "ms" in r), None)
    print(f"{'system':<54}{'ms':>10}{'TFLOP/s':>9}{'x DS':>7}{'max load':>9}{'|out|':>12}{'l_aux':>10}  note")
    for r in rows:
        if "ms" not in r:
            print(f"{r['system']:<54}{'':>47}  {r['error']}")
            continue
        speedup = f"{ds['ms'] / r['ms']:>7.2f}" if ds else f"{'':>7}"
        print(f"{r['system']:<54}{r['ms']:>10.3f}{flops / r['ms'] / 1e9:>9.1f}{speedup}{r['max_load']:>9}"
              f"{r['out_norm']:>12.5g}"
              f"{r['l_aux']:>10.5f}  {r.get('note', '')}", flush=True)
    for r in rows:
        if r.get("profile"):
            print(f"\n-- {r['system']}: {r['profile']}", flush=True)


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
    ap.add_argument("--device", choices=["cuda", "cpu"], default=None,
                    help="cuda (fails without a GPU) or cpu (the same as --cpu); default: cuda when available")
    ap.add_argument("--check", action="store_true", help="each path's relative error against the loop")
    ap.add_argument("--deepspeed", action="store_true",
                    help="also time the whole MoE layer: DeepSpeed's against lightspeed's (the Note on --deepspeed)")
    ap.add_argument("--deepspeed-python", default=sys.executable,
                    help="the interpreter DeepSpeed's rows run in (default this one)")
    ap.add_argument("--deepspeed-path", default=os.environ.get("LIGHTSPEED_DS_SITE"),
                    help="a site dir holding DeepSpeed, put first on that interpreter's PYTHONPATH "
                         "(default $LIGHTSPEED_DS_SITE)")
    ap.add_argument("--capacity-factor", type=float, default=1.0, help="MoE(capacity_factor=...), both systems")
    ap.add_argument("--min-capacity", type=int, default=4, help="MoE(min_capacity=...), both systems")
    ap.add_argument("--drop-tokens", action="store_true",
                    help="MoE(drop_tokens=True) on both systems (default False: every route is computed)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds DeepSpeed's child may run")
    ap.add_argument("--profile", action="store_true",
                    help="the whole-layer rows: also each row's most expensive operators (torch.profiler)")
    ap.add_argument("--ds-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: this torch sees no CUDA device")
    args.cpu = args.cpu or args.device == "cpu"
    args.tokens = args.tokens or (64 if args.tiny else 8192)
    args.steps = args.steps or (3 if args.tiny else 10)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)  # as DeepSpeed's child runs on the CPU (OMP_NUM_THREADS=1)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    table = TINY if args.tiny else SHAPES
    for name in args.shapes.split(","):
        if name not in table:
            raise SystemExit(f"--shapes: unknown shape {name!r} (known: {', '.join(table)})")
    shapes = {name: table[name] for name in args.shapes.split(",")}
    if args.ds_child:
        _ds_child(args, shapes, device, dtype)
        return
    ds_rows = ds_where = None
    if args.deepspeed:  # first, while this process holds no GPU memory
        ds_rows, ds_where = deepspeed_rows(args, shapes)
    print(f"torch {torch.__version__}; device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}")
    for name, shape in shapes.items():
        run_shape(name, shape, args, device, dtype)
    if not args.deepspeed:
        return
    import lightspeed

    lightspeed.register_as_deepspeed()
    from deepspeed.moe.layer import MoE  # lightspeed's, through the registration

    from lightspeed.parallel.experts import GatedMLP as LightspeedGatedMLP

    ls_rows = time_layers(MoE, "lightspeed deepspeed.moe.layer.MoE", shapes, args, device, dtype, grouped=True,
                          expert_cls=LightspeedGatedMLP)
    print(f"\nDeepSpeed's rows: {ds_where or 'not measured'}; lightspeed's: `deepspeed.moe.layer.MoE` after "
          f"lightspeed.register_as_deepspeed(), which is {MoE.__module__}.{MoE.__qualname__}")
    for name, shape in shapes.items():
        print_layer_table(name, shape, ds_rows[name] + ls_rows[name], args)


if __name__ == "__main__":
    main()
