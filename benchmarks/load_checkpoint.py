"""Loading a Llama checkpoint onto one GPU in FP6 (or INT8 / INT4): host memory, GPU memory and time of
three routes, measured in the same run, each in a fresh process:

  state_dict    plain PyTorch: the model's parameters allocated on the host in fp16, each file's
                state dict loaded into them (`safetensors.torch.load_file` + `load_state_dict`, what
                DeepSpeed's own checkpoint loading does with torch.load), then `init_inference(model,
                quant=...)`: the whole float model in host memory
  transformers  `LlamaForCausalLM.from_pretrained(dir, dtype=float16)` on the host, then
                `init_inference(model, quant=...)` (transformers 5 maps the files: the parameters
                are file pages, not anonymous memory)
  streamed      built under `lightspeed.OnDevice(device="meta")`, then
                `init_inference(model, quant=..., checkpoint=dir, save_mp_checkpoint_path=out)`
  reload        built on meta, then `init_inference(model, checkpoint=out)`: the saved quantized model,
                no quantizing

Claim: streaming holds one tensor at a time in host memory (not the model, as loading a state dict
does), and the saved quantized checkpoint reloads faster than quantizing again, with the same logits.

The checkpoint is Llama-2-70B's shapes (hidden 8192, MLP 28672, GQA 8 of 64 heads, vocab 32000) with
`--layers` layers of random fp16 weights, written once as sharded safetensors (about 1.7 GB a layer).
Before each route the files are dropped from the page cache (posix_fadvise DONTNEED), so reads start
cold where the filesystem honours it. Host memory is the peak of the process's anonymous resident
memory (RssAnon, sampled every 5 ms): file pages mapped by safetensors are not counted, as the kernel
can drop them.

    python benchmarks/load_checkpoint.py --layers 16 --dir /tmp/ckpt     # H200: ~28 GB of fp16 files
    python benchmarks/load_checkpoint.py --smoke                         # tiny shapes, CPU or GPU
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FULL = dict(hidden_size=8192, intermediate_size=28672, num_attention_heads=64, num_key_value_heads=8,
            vocab_size=32000)
SMOKE = dict(hidden_size=256, intermediate_size=704, num_attention_heads=8, num_key_value_heads=2, vocab_size=1000)


def llama_config(shapes: dict, layers: int):
    import transformers

    return transformers.LlamaConfig(**shapes, num_hidden_layers=layers, max_position_embeddings=4096,
                                    tie_word_embeddings=False)


def write_checkpoint(directory: str, shapes: dict, layers: int, device: str) -> float:
    """Random fp16 weights (std 0.02; norms 1) as one safetensors shard per layer + embeddings/head, with
    the Hugging Face index and config. Returns GB written."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    cfg = llama_config(shapes, layers)
    cfg.save_pretrained(directory)
    h, f, v = shapes["hidden_size"], shapes["intermediate_size"], shapes["vocab_size"]
    kv = h // shapes["num_attention_heads"] * shapes["num_key_value_heads"]
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(*shape):
        return (torch.randn(*shape, generator=gen, device=device, dtype=torch.float16) * 0.02).cpu()

    def shards():
        yield "model-outer.safetensors", {"model.embed_tokens.weight": rand(v, h), "lm_head.weight": rand(v, h),
                                          "model.norm.weight": torch.ones(h, dtype=torch.float16)}
        for i in range(layers):
            p = f"model.layers.{i}."
            yield f"model-layer{i:03d}.safetensors", {
                p + "self_attn.q_proj.weight": rand(h, h), p + "self_attn.k_proj.weight": rand(kv, h),
                p + "self_attn.v_proj.weight": rand(kv, h), p + "self_attn.o_proj.weight": rand(h, h),
                p + "mlp.gate_proj.weight": rand(f, h), p + "mlp.up_proj.weight": rand(f, h),
                p + "mlp.down_proj.weight": rand(h, f),
                p + "input_layernorm.weight": torch.ones(h, dtype=torch.float16),
                p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.float16)}

    total = 0
    weight_map = {}
    for name, tensors in shards():  # one shard in host memory at a time
        save_file(tensors, os.path.join(directory, name), metadata={"format": "pt"})
        total += sum(t.numel() * 2 for t in tensors.values())
        weight_map.update({key: name for key in tensors})
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh)
    return total / 1e9


def drop_page_cache(directory: str) -> None:
    for path in glob.glob(os.path.join(directory, "*.safetensors")):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


class AnonPeak:
    """Peak RssAnon of this process, sampled in a thread."""

    def __init__(self, period: float = 0.005):
        self.peak, self.period, self._stop = 0, period, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def now() -> int:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
        return 0

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.now())
            time.sleep(self.period)

    def __enter__(self):
        self.base = self.now()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.now())


def run_route(args) -> dict:
    """One route in this process; prints one JSON line."""
    import transformers

    import lightspeed
    from lightspeed.inference import init_inference

    quant = {"weight": args.format, "group_size": args.group_size}
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = transformers.AutoConfig.from_pretrained(args.dir)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    with AnonPeak() as host:
        if args.route == "state_dict":
            from safetensors.torch import load_file

            with lightspeed.OnDevice(dtype=torch.float16, device="meta"):
                model = transformers.LlamaForCausalLM(cfg)
            for module in model.modules():  # host storage for the parameters (buffers are real already)
                for name, p in module._parameters.items():
                    if p is not None and p.is_meta:
                        module._parameters[name] = torch.nn.Parameter(torch.empty_like(p, device="cpu"),
                                                                      requires_grad=False)
            for path in sorted(glob.glob(os.path.join(args.dir, "model-*.safetensors"))):
                model.load_state_dict(load_file(path), strict=False)
            t_host = time.perf_counter() - t0
            model = init_inference(model, dtype=torch.float16, device=device, quant=quant)
        elif args.route == "transformers":
            model = transformers.LlamaForCausalLM.from_pretrained(args.dir, dtype=torch.float16)
            t_host = time.perf_counter() - t0
            model = init_inference(model, dtype=torch.float16, device=device, quant=quant)
        else:
            with lightspeed.OnDevice(dtype=torch.float16, device="meta"):
                model = transformers.LlamaForCausalLM(cfg)
            t_host = 0.0
            if args.route == "streamed":
                model = init_inference(model, dtype=torch.float16, device=device, quant=quant, checkpoint=args.dir)
            else:
                model = init_inference(model, dtype=torch.float16, device=device, checkpoint=args.saved)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    save_s = None
    if args.route == "streamed":  # outside the host-memory window: the save holds one shard (2 GiB) twice
        t1 = time.perf_counter()
        from lightspeed.inference.checkpoint import save_inference_checkpoint

        save_inference_checkpoint(model, args.saved)
        save_s = time.perf_counter() - t1
    ids = torch.arange(1, 17, device=device).view(1, 16) * 37 % cfg.vocab_size
    with torch.no_grad():
        logits = model(ids).logits.float()
    out = {"route": args.route, "seconds": seconds, "host_s": t_host, "save_s": save_s,
           "host_peak_gib": (host.peak - host.base) / 2**30,
           "gpu_peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan"),
           "gpu_final_gib": torch.cuda.memory_allocated() / 2**30 if device.type == "cuda" else float("nan"),
           "logits_sum": float(logits.double().sum()), "logits_absmax": float(logits.abs().max())}
    torch.save(logits.cpu(), os.path.join(args.dir, f"logits_{args.route}.pt"))
    print("RESULT " + json.dumps(out), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--dir", default="/tmp/lightspeed_load_ckpt")
    ap.add_argument("--format", default="fp6", choices=["fp6", "int8", "int4"])
    ap.add_argument("--group-size", type=int, default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, 2 layers")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint written by an earlier run")
    ap.add_argument("--route", help=argparse.SUPPRESS)
    ap.add_argument("--saved", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.route:
        run_route(args)
        return
    shapes = SMOKE if args.smoke else FULL
    layers = 2 if args.smoke else args.layers
    saved = os.path.join(args.dir, "quantized")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if not (args.keep and os.path.exists(os.path.join(args.dir, "model.safetensors.index.json"))):
        t0 = time.perf_counter()
        gb = write_checkpoint(args.dir, shapes, layers, device)
        print(f"wrote {gb:.1f} GB of fp16 safetensors ({layers} layers) in {time.perf_counter() - t0:.0f} s",
              flush=True)
    results = {}
    for route in ("state_dict", "transformers", "streamed", "reload"):
        drop_page_cache(args.dir)
        drop_page_cache(saved)
        cmd = [sys.executable, os.path.abspath(__file__), "--route", route, "--dir", args.dir, "--saved", saved,
               "--format", args.format] + (["--group-size", str(args.group_size)] if args.group_size else [])
        proc = subprocess.run(cmd, capture_output=True, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            print(f"{route}: failed (rc {proc.returncode})\n{proc.stderr[-3000:]}")
            sys.exit(1)
        results[route] = json.loads(lines[-1][len("RESULT "):])
    ref = torch.load(os.path.join(args.dir, "logits_state_dict.pt"))
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    print(f"\nLlama-2-70B shapes, {layers} layers, {args.format} (group {args.group_size}); {name}; "
          f"torch {torch.__version__}")
    print("| route | load s (host part) | x state_dict | host peak GiB (anon) | GPU peak GiB | GPU after GiB |"
          " logits vs state_dict |")
    print("|---|---|---|---|---|---|---|")
    base = results["state_dict"]["seconds"]
    for route, r in results.items():
        logits = torch.load(os.path.join(args.dir, f"logits_{route}.pt"))
        same = "equal" if torch.equal(logits, ref) else f"max diff {float((logits - ref).abs().max()):.2e}"
        host_part = f" ({r['host_s']:.1f})" if r["host_s"] else ""
        print(f"| {route} | {r['seconds']:.1f}{host_part} | {base / r['seconds']:.2f}x | {r['host_peak_gib']:.2f} | "
              f"{r['gpu_peak_gib']:.2f} | {r['gpu_final_gib']:.2f} | {same} |")
    print(f"saving the quantized model (streamed route): {results['streamed']['save_s']:.1f} s; "
          f"files {sum(os.path.getsize(p) for p in glob.glob(os.path.join(saved, '*.safetensors'))) / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
