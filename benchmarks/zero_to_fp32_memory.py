"""Peak host memory of consolidating a ZeRO checkpoint into fp32 weights: lightspeed's streaming
`convert_zero_checkpoint_to_fp32_state_dict` against DeepSpeed's own `deepspeed.utils.zero_to_fp32`,
same checkpoint, same arguments, each in a fresh process, in the same run (CPU only).

Claim: lightspeed reads one parameter at a time and writes one shard at a time (safetensors: one tensor
at a time), so its anonymous memory stays near one tensor / one shard, while DeepSpeed's script builds
the whole fp32 model in memory (the often-reported out-of-memory of zero_to_fp32 on big models).

The checkpoint is synthetic, in DeepSpeed's layout (lightspeed.testing.deepspeed_layout; the tests check
that layout against files real DeepSpeed wrote): `--size-gb` of fp32 masters in [rows, 4096] matrices,
partitioned over `--world-size` ranks at `--stage`, Adam moments and a bf16 module beside them.

    python benchmarks/zero_to_fp32_memory.py --size-gb 3 --deepspeed-python /tmp/dsvenv/bin/python
    python benchmarks/zero_to_fp32_memory.py --smoke     # a committed fixture; DeepSpeed optional

Memory is sampled from /proc/self/status every 10 ms in the converting process: RSS and its anonymous
part (RssAnon: what the process itself allocated; RssFile is memory-mapped checkpoint pages, which the
kernel can drop at any time), plus the kernel's own high-water mark (VmHWM) at exit. (Not ru_maxrss:
Linux carries it over exec from the parent, which wrote the checkpoint.)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from collections import OrderedDict

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE = os.path.join(REPO, "tests", "fixtures", "deepspeed", "ws2_stage3_fp32", "ckpt")
MARK = "@@RESULT@@"

# Runs in the measured process: a sampler thread, then one conversion (__MODULE__: the zero_to_fp32 module).
CHILD = r"""
import json, os, sys, threading, time
peak = {"rss": 0, "anon": 0}
stop = False
def status():
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "RssAnon:", "VmHWM:")):
                key, value = line.split(":")
                out[key] = int(value.split()[0]) * 1024
    return out
def sample():
    while not stop:
        s = status()
        peak["rss"] = max(peak["rss"], s.get("VmRSS", 0))
        peak["anon"] = max(peak["anon"], s.get("RssAnon", 0))
        time.sleep(0.01)
import torch
from __MODULE__ import convert_zero_checkpoint_to_fp32_state_dict
base = status()
thread = threading.Thread(target=sample, daemon=True)
thread.start()
t0 = time.perf_counter()
convert_zero_checkpoint_to_fp32_state_dict(__CKPT__, __OUT__, max_shard_size=__SHARD__,
                                           safe_serialization=__SAFE__)
seconds = time.perf_counter() - t0
stop = True
thread.join()
print(__MARK__ + json.dumps({"seconds": seconds, "peak_rss": peak["rss"], "peak_anon": peak["anon"],
      "base_rss": base.get("VmRSS", 0), "base_anon": base.get("RssAnon", 0),
      "hwm": status().get("VmHWM", 0)}))
"""


def make_checkpoint(path: str, size_gb: float, world_size: int, stage: int) -> int:
    """A synthetic checkpoint of about `size_gb` GB of fp32 masters; returns the parameter count."""
    import torch

    sys.path.insert(0, REPO)
    from lightspeed.testing.deepspeed_layout import write_zero_checkpoint

    cols = 4096
    numel_total = int(size_gb * 1e9 / 4)
    rows_per = 2048 + 13  # odd sizes, so partitions split parameters and padding is exercised
    count = max(1, math.ceil(numel_total / (rows_per * cols)))
    shapes = OrderedDict()
    for i in range(count):
        shapes[f"layers.{i}.weight"] = torch.Size([rows_per, cols])
        shapes[f"layers.{i}.bias"] = torch.Size([rows_per])
    shapes["final_norm.weight"] = torch.Size([cols])

    def filler(rank: int, numel: int) -> torch.Tensor:
        return torch.randn(numel, generator=torch.Generator().manual_seed(rank))

    write_zero_checkpoint(path, stage=stage, world_size=world_size, shapes=shapes, partition_filler=filler,
                          buffer_names=[], lowp_dtype=torch.bfloat16, sub_group_numel=10**9)
    return sum(s.numel() for s in shapes.values())


def run_child(python: str, module: str, ckpt: str, out: str, shard, safe: bool, with_repo: bool) -> dict:
    code = CHILD
    for key, value in (("__MODULE__", module), ("__CKPT__", repr(ckpt)), ("__OUT__", repr(out)),
                       ("__SHARD__", repr(shard)), ("__SAFE__", repr(safe)), ("__MARK__", repr(MARK))):
        code = code.replace(key, value)
    env = dict(os.environ, DS_ACCELERATOR="cpu", LIGHTSPEED_LOG_LEVEL="WARNING")
    env["PYTHONPATH"] = REPO if with_repo else ""
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True, env=env, cwd=tempfile.gettempdir())
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith(MARK)), None)
    if proc.returncode != 0 or line is None:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"error": " | ".join(tail) or f"exit status {proc.returncode}"}
    return json.loads(line[len(MARK):])


def outputs_equal(a: str, b: str) -> bool:
    from safetensors import safe_open
    import torch

    def tensors(d):
        names = {}
        for f in os.listdir(d):
            if f.endswith(".safetensors"):
                with safe_open(os.path.join(d, f), "pt") as h:
                    names.update({k: os.path.join(d, f) for k in h.keys()})
        return names

    ta, tb = tensors(a), tensors(b)
    if set(ta) != set(tb):
        return False
    for k in ta:
        with safe_open(ta[k], "pt") as ha, safe_open(tb[k], "pt") as hb:
            if not torch.equal(ha.get_tensor(k), hb.get_tensor(k)):
                return False
    return True


def deepspeed_available(python: str) -> bool:
    probe = subprocess.run([python, "-c", "import deepspeed.utils.zero_to_fp32"], capture_output=True,
                           env=dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=""), cwd=tempfile.gettempdir())
    return probe.returncode == 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-gb", type=float, default=3.0, help="fp32 masters in the synthetic checkpoint (GB)")
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--stage", type=int, default=2, choices=(1, 2, 3))
    ap.add_argument("--max-shard-size", default="5GB", help='as the converters take it; "none": one file')
    ap.add_argument("--bin", action="store_true", help="write pytorch_model.bin instead of safetensors")
    ap.add_argument("--deepspeed-python", default=sys.executable,
                    help="an interpreter that can import deepspeed (default: this one)")
    ap.add_argument("--workdir", default=None, help="where the checkpoint and outputs go (default: a temp dir)")
    ap.add_argument("--smoke", action="store_true", help="convert a committed fixture (no synthetic checkpoint)")
    ap.add_argument("--reuse", action="store_true", help="reuse the checkpoint already in --workdir")
    args = ap.parse_args()

    work = args.workdir or tempfile.mkdtemp(prefix="z2f32_")
    os.makedirs(work, exist_ok=True)
    shard = None if args.max_shard_size.lower() == "none" else args.max_shard_size
    safe = not args.bin
    try:
        if args.smoke:
            ckpt, numel = FIXTURE, None
        else:
            ckpt = os.path.join(work, "ckpt")
            if args.reuse and os.path.isfile(os.path.join(ckpt, "latest")):
                sys.path.insert(0, REPO)
                from lightspeed.checkpoint.deepspeed_format import DeepSpeedCheckpointSource

                src = DeepSpeedCheckpointSource(ckpt)
                numel = sum(src.param_shape(n).numel() for n in src.param_names())
                args.stage, args.world_size = src.zero_stage, src.world_size
                del src
            else:
                numel = make_checkpoint(ckpt, args.size_gb, args.world_size, args.stage)
        runs = [("lightspeed", sys.executable, "lightspeed.checkpoint.zero_to_fp32", True)]
        if deepspeed_available(args.deepspeed_python):
            runs.append(("deepspeed", args.deepspeed_python, "deepspeed.utils.zero_to_fp32", False))
        else:
            print(f"deepspeed is not importable by {args.deepspeed_python}: measuring lightspeed only")
        results = {}
        for name, python, module, with_repo in runs:
            out = os.path.join(work, f"out_{name}")
            shutil.rmtree(out, ignore_errors=True)
            results[name] = run_child(python, module, ckpt, out, shard, safe, with_repo)
        size = f"{numel * 4 / 1e9:.2f} GB fp32 ({numel:,} params)" if numel else "fixture ws2_stage3_fp32"
        print(f"checkpoint: {size}, stage {args.stage if numel else 3}, world size {args.world_size if numel else 2}, "
              f"{'safetensors' if safe else 'pytorch_model.bin'}, max_shard_size {shard}")
        print(f"{'converter':<12}{'seconds':>9}{'peak RSS GiB':>14}{'peak anon GiB':>15}{'VmHWM GiB':>11}"
              f"{'start anon GiB':>16}")
        for name, r in results.items():
            if "error" in r:
                print(f"{name:<12} failed: {r['error']}")
                continue
            g = 2**30
            print(f"{name:<12}{r['seconds']:>9.1f}{r['peak_rss'] / g:>14.3f}{r['peak_anon'] / g:>15.3f}"
                  f"{r['hwm'] / g:>11.3f}{r['base_anon'] / g:>16.3f}")
        if all("error" not in r for r in results.values()) and len(results) == 2 and safe:
            same = outputs_equal(os.path.join(work, "out_lightspeed"), os.path.join(work, "out_deepspeed"))
            print(f"outputs identical: {same}")
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
