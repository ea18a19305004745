"""A mixture-of-experts GPT trained through the lightspeed engine on one GPU (world size 1), bf16,
ZeRO-2 (optionally 3), against the dense GPT of the same active size in the same run: step ms,
tokens/s and MFU counted on active FLOPs.

    python benchmarks/moe_gpt.py                          # one GPU: MoE and dense, ZeRO-2
    python benchmarks/moe_gpt.py --stages 2 3             # ZeRO-2 and ZeRO-3
    python benchmarks/moe_gpt.py --moe-layer deepspeed    # the DeepSpeed-API layer instead
    python benchmarks/moe_gpt.py --smoke                  # tiny model on the CPU (gloo, fp32)

Model: examples/gpt.py (learned positions, pre-LayerNorm blocks, SDPA causal attention, tied LM head)
with every block's MLP replaced:
- `moe`: a router (a bias-free linear to the experts, softmax in fp32, top-k, the k weights renormalised
  to sum to one) and `--experts` SwiGLU experts of `--width` -> `--expert-ffn` -> `--width`. With
  `--moe-layer grouped` (default) the experts' weights are stacked [E, 2I, H] / [E, H, I] and run
  through lightspeed.ops.grouped_gemm (`permute` -> `grouped_mlp` -> `unpermute`: no capacity, no token
  dropped; torch._grouped_mm for bf16 on Hopper); with `--moe-layer deepspeed` the block's MLP is
  lightspeed's `deepspeed.moe.layer.MoE` (lightspeed.parallel.experts.MoE: DeepSpeed's gate and
  capacity buffers, one expert module per expert in a loop) with drop_tokens=False. Each layer adds
  `--aux-coef` x its load-balancing loss (Switch's E x sum_e f_e P_e; DeepSpeed's l_aux) to the loss.
- `dense`: one SwiGLU MLP of `--width` -> top-k x `--expert-ffn` -> `--width`: the same active
  parameters as the MoE model less its routers, so the same matmul FLOPs per token.
Default shape: width 2048, 18 layers, 16 heads of 128, 8 experts of FFN 2688 (4/3 x width, SwiGLU:
the active MLP is the size of a 4 x width GELU MLP), top 2, GPT-2's padded vocabulary 50304, sequence
2048, micro batch 4 (8192 tokens a step): about 1.0B active and 2.8B total parameters; ZeRO-2 keeps
16 bytes a parameter on the GPU (bf16 weights and gradients, fp32 master weights and two Adam moments),
about 45 GB, plus the activations. Smaller GPUs: `--micro 2` or fewer `--layers`.

MFU = tokens/s x FLOPs per token / 989.4e12 (the dense bf16 peak of an H100 / H200 SXM), with
FLOPs per token = 6 x N_active + 12 x layers x width x seq (PaLM's appendix B, as examples/gpt.py
counts it): N_active is every parameter a token's forward multiplies by (the tied embedding once, as
the LM head; each layer's attention, router and k of its E experts; not the position embedding, a
lookup), 6 = forward 2 + backward 4 per parameter; the attention term (scores and values, forward and
backward, causal masking ignored) is the same for both models. The MoE's routing (permute, unpermute,
softmax, top-k) is counted as no FLOPs: it is the overhead MFU exposes.

Each configuration runs in a fresh process (world size 1; NCCL on the GPU, gloo for --smoke), as
benchmarks/zero_step.py does, and the parent prints one table; ms/step is the median of `--repeats`
windows of `--steps` steps after `--warmup`; optimizer AdamW (lightspeed's), gradient clipping 1.0.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import lightspeed  # noqa: E402
from benchmarks.harness import (H200_BF16_PEAK_FLOPS, Result, engine_step, peak_gib, print_table,  # noqa: E402
                                reset_memory, time_steps)
from benchmarks.moe_train import GatedMLP as SwiGLU  # noqa: E402  (the dense MLP and the experts')
from benchmarks.zero_step import ds_config, make_batches  # noqa: E402
from examples.gpt import GPT, GPTConfig  # noqa: E402
from lightspeed.ops.grouped_gemm import grouped_mlp, offsets_from_counts, permute, unpermute  # noqa: E402


class GroupedMoE(nn.Module):
    """Router + experts on lightspeed.ops.grouped_gemm (the module's Note on `moe`); `l_aux` holds the
    last forward's load-balancing loss."""

    def __init__(self, hidden: int, inter: int, experts: int, top_k: int) -> None:
        super().__init__()
        self.experts, self.top_k = experts, top_k
        self.router = nn.Linear(hidden, experts, bias=False)
        self.w_gate_up = nn.Parameter(torch.empty(experts, 2 * inter, hidden))  # HF's fused layout
        self.w_down = nn.Parameter(torch.empty(experts, hidden, inter))
        self.l_aux = None

    def forward(self, x):
        tokens = x.reshape(-1, x.shape[-1])
        probs = self.router(tokens).float().softmax(dim=-1)
        weights, idx = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        rows, row_map, counts = permute(tokens, idx, self.experts)
        y = grouped_mlp(rows, offsets_from_counts(counts), self.w_gate_up.transpose(1, 2),
                        self.w_down.transpose(1, 2))
        fraction = counts.float() / (tokens.shape[0] * self.top_k)
        self.l_aux = self.experts * (fraction * probs.mean(dim=0)).sum()
        return unpermute(y, row_map, weights).view_as(x)


class DeepSpeedMoE(nn.Module):
    """lightspeed's `deepspeed.moe.layer.MoE` (drop_tokens=False) as a block's MLP: its output, and its
    l_aux kept as `l_aux`."""

    def __init__(self, hidden: int, inter: int, experts: int, top_k: int) -> None:
        super().__init__()
        from lightspeed.parallel.experts import MoE

        self.moe = MoE(hidden, SwiGLU(hidden, inter), num_experts=experts, ep_size=1, k=top_k, drop_tokens=False)
        self.l_aux = None

    def forward(self, x):
        out, self.l_aux, _ = self.moe(x)
        return out


class MoEGPT(GPT):
    """examples/gpt.py's GPT with each block's MLP replaced (`kind`: "moe" or "dense"; the module's Note on
    the model); the loss adds `aux_coef` x the layers' load-balancing losses."""

    def __init__(self, config: GPTConfig, kind: str, experts: int, top_k: int, expert_ffn: int,
                 moe_layer: str = "grouped", aux_coef: float = 0.01) -> None:
        super().__init__(config)
        self.kind, self.experts, self.top_k, self.aux_coef = kind, experts, top_k, aux_coef
        hidden = config.n_embd
        for block in self.blocks:
            if kind == "dense":
                block.mlp = SwiGLU(hidden, top_k * expert_ffn)
            elif moe_layer == "grouped":
                block.mlp = GroupedMoE(hidden, expert_ffn, experts, top_k)
            else:
                block.mlp = DeepSpeedMoE(hidden, expert_ffn, experts, top_k)
        self._init_mlps()

    @torch.no_grad()
    def _init_mlps(self) -> None:
        # GPT-2's rule: N(0, 0.02), the projections into the residual stream scaled by 1/sqrt(2 x layers)
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for block in self.blocks:
            for name, p in block.mlp.named_parameters():
                into_residual = name.endswith("down.weight") or name.endswith("w_down")
                nn.init.normal_(p, mean=0.0, std=residual_std if into_residual else 0.02)

    def expert_params_per_layer(self) -> int:
        """One layer's expert parameters, all E experts (0 for the dense model)."""
        if self.kind == "dense":
            return 0
        mlp = self.blocks[0].mlp
        return sum(p.numel() for n, p in mlp.named_parameters() if "router" not in n and "wg" not in n)

    def active_params(self) -> int:
        """The parameters one token's forward multiplies by (the module's Note on MFU), plus the position
        embedding (a lookup): `flops_per_token` drops it."""
        inactive = self.expert_params_per_layer() * (self.experts - self.top_k) // self.experts
        return self.num_params() - self.config.n_layer * inactive

    def flops_per_token(self, seq_len: int | None = None) -> int:
        T = seq_len or self.config.block_size
        return 6 * (self.active_params() - self.wpe.weight.numel()) + 12 * self.config.n_layer * self.config.n_embd * T

    def forward(self, idx, targets=None):
        out = super().forward(idx, targets)
        if targets is None or self.kind == "dense" or not self.aux_coef:
            return out
        return out + self.aux_coef * sum(block.mlp.l_aux for block in self.blocks)


def build(args, kind: str) -> MoEGPT:
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.heads,
                    n_embd=args.width)
    return MoEGPT(cfg, kind, args.experts, args.top_k, args.expert_ffn, args.moe_layer, args.aux_coef)


def run_one(args, kind: str, stage: int) -> Result:
    """One configuration in this process (the parent runs each in a fresh one)."""
    lightspeed.init_distributed(verbose=False)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    torch.manual_seed(0)
    with device:  # initialised where it trains
        model = build(args, kind)
    flops_per_token = model.flops_per_token(args.seq)
    name = f"{kind} ZeRO-{stage}" + (f" ({args.moe_layer} layer)" if kind == "moe" else "")
    reset_memory()
    engine, *_ = lightspeed.initialize(model=model, model_parameters=model.parameters(),
                                       config=ds_config(stage, args.micro, device.type == "cuda", torch_adam=False))
    batches = make_batches(args.vocab, args.micro, args.seq, device)
    step = engine_step(engine, batches)

    ms, losses = time_steps(step, args.steps, args.warmup, args.repeats)
    r = Result(name, ms_per_step=ms, losses=losses)
    r.tokens_per_s = args.micro * args.seq / (ms / 1e3)
    r.mfu = flops_per_token * r.tokens_per_s / H200_BF16_PEAK_FLOPS
    r.peak_gib = peak_gib()
    r.note = f"loss {losses[0]:.3f} -> {losses[-1]:.3f}"
    dist.destroy_process_group()
    return r


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=18)
    ap.add_argument("--heads", type=int, default=None, help="default width / 128")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--expert-ffn", type=int, default=2688, help="each expert's SwiGLU intermediate width")
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--micro", type=int, default=4, help="sequences per step")
    ap.add_argument("--stages", nargs="+", type=int, default=[2], choices=[0, 1, 2, 3])
    ap.add_argument("--models", nargs="+", default=["moe", "dense"], choices=["moe", "dense"])
    ap.add_argument("--moe-layer", default="grouped", choices=["grouped", "deepspeed"])
    ap.add_argument("--aux-coef", type=float, default=0.01, help="weight of the load-balancing loss")
    ap.add_argument("--steps", type=int, default=10, help="steps per timed window")
    ap.add_argument("--repeats", type=int, default=3, help="timed windows (the median is reported)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU (gloo, fp32)")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # kind:stage, in a child
    args = ap.parse_args(argv)
    if args.smoke:
        os.environ["LIGHTSPEED_ACCELERATOR"] = "cpu"
        args.width, args.layers, args.heads, args.experts, args.expert_ffn = 64, 2, 2, 4, 96
        args.vocab, args.seq, args.micro, args.steps, args.repeats, args.warmup = 256, 32, 2, 2, 1, 1
    args.heads = args.heads or max(1, args.width // 128)
    if args.top_k > args.experts:
        raise SystemExit(f"--top-k {args.top_k} exceeds --experts {args.experts}")
    if args.one:
        kind, stage = args.one.split(":")
        print("RESULT " + json.dumps(asdict(run_one(args, kind, int(stage)))), flush=True)
        return
    with torch.device("meta"):
        counts = {kind: build(args, kind) for kind in ("moe", "dense")}
    moe, dense = counts["moe"], counts["dense"]
    hw = torch.cuda.get_device_name() if torch.cuda.is_available() and not args.smoke else "cpu"
    print(f"MoE GPT: width {args.width}, {args.layers} layers, {args.heads} heads, {args.experts} experts of FFN "
          f"{args.expert_ffn} (SwiGLU), top {args.top_k}, {args.moe_layer} layer, vocab {args.vocab}: "
          f"{moe.num_params():,} params total, {moe.active_params():,} active; "
          f"{moe.flops_per_token(args.seq) / 1e9:.2f} GFLOP/token")
    print(f"dense GPT: the same with one SwiGLU MLP of {args.top_k * args.expert_ffn}: "
          f"{dense.num_params():,} params; {dense.flops_per_token(args.seq) / 1e9:.2f} GFLOP/token")
    print(f"micro batch {args.micro} x seq {args.seq} = {args.micro * args.seq} tokens a step, "
          f"{'fp32' if args.smoke else 'bf16'}, {hw}, torch {torch.__version__}, world size 1, each run in a fresh "
          f"process; MFU against {H200_BF16_PEAK_FLOPS / 1e12:.1f} TFLOP/s", flush=True)
    passthrough = list(sys.argv[1:] if argv is None else argv)
    results = []
    for stage in args.stages:
        for kind in args.models:
            env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(_free_port()))
            proc = subprocess.run([sys.executable, __file__, *passthrough, "--one", f"{kind}:{stage}"], env=env,
                                  capture_output=True, text=True)
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
                results.append(Result(f"{kind} ZeRO-{stage}", note=f"failed: {tail[:160]}"))
            else:
                results.append(Result(**json.loads(line[len("RESULT "):])))
    base = next((r for r in results if r.name.startswith("dense")), results[0])
    print_table(results, base.name)
    for stage in args.stages:
        pair = [r for r in results if r.name.split(" (")[0] in (f"moe ZeRO-{stage}", f"dense ZeRO-{stage}")]
        if len(pair) == 2 and all(r.tokens_per_s == r.tokens_per_s for r in pair):
            m, d = pair if pair[0].name.startswith("moe") else pair[::-1]
            print(f"ZeRO-{stage}: MoE / dense tokens/s {m.tokens_per_s / d.tokens_per_s:.2f}, MFU {m.mfu / d.mfu:.2f}")


if __name__ == "__main__":
    main()
