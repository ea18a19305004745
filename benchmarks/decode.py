"""End-to-end decoding with `lightspeed.init_inference`: a transformers Llama model (Mistral for
`mistral-7b`, every layer a sliding window; Mixtral for the mixture-of-experts sizes) with the layer
shapes of a named size (random weights, no download) in fp16 vs the same model with its linear layers
(and MoE experts) in FP6 / INT8 / INT4 (`quant={"weight": ...}`), milliseconds per generated token.

Claim: weight-only quantized layers make decoding faster than fp16. The kernel table is
`fp6_gemm.py`; this measures what a model's decode step gets from it, attention, norms and the fp16
output head included. Per format: weight memory, ms per token with the decode step replayed from a
CUDA graph (GPU time: batch B, one new token per sequence, a static KV cache holding `--context`
tokens), ms per token of the model's own eager `generate` (Python launch overhead included), peak GPU
memory while building the model and prefilling the cache, and the first decode step's logits against
the fp16 model's (relative L2 error, top-1 agreement; random layers amplify any perturbation, so these
are no measure of quantization quality) and, per quantized layer of one step, the kernel's output
against F.linear with its dequantized weight (max over layers).
`--cuda-graph` adds the model's own `generate` with `enable_cuda_graph` (each decode step replayed from a
CUDA graph; graphs are captured in warm-up calls, so the timing is the steady state of repeated calls),
ms per token, and whether its tokens equal eager `generate`'s with the same static KV cache.
`--compile` adds the decode step compiled by torch.compile (inductor, fullgraph: each quantized layer is
one `lightspeed::quantized_matmul` node) and replayed from a CUDA graph, and its logits against the
same model's eager step.

    python benchmarks/decode.py --size llama2-7b                 # fp16, fp6, int8, int4 (GPU)
    python benchmarks/decode.py --size llama2-70b --layers 20     # the first 20 of 80 layers
    python benchmarks/decode.py --size mixtral-8x7b --layers 8 --formats fp16,fp6,int4 --cuda-graph
                                     # mixture of experts (QuantizedExperts); fp16's experts cannot be graphed
    python benchmarks/decode.py --smoke                           # tiny model on CPU (reference path)
    python benchmarks/decode.py --no-eager --compile              # + torch.compile'd decode steps
    python benchmarks/decode.py --cuda-graph                      # + generate with enable_cuda_graph
    python benchmarks/decode.py --size llama2-70b --tied-layers --formats fp16,fp6,int4 --no-eager
                                     # all 80 layers: one set of CPU weights, every layer its own on the GPU
    python benchmarks/decode.py --size llama2-70b --layers 20 --tp 2 --no-eager
                                     # tensor parallelism over 2 GPUs (relaunches itself under torchrun, NCCL)
"""

from __future__ import annotations

import argparse
import copy
import gc
import inspect
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import lightspeed  # noqa: E402

# transformers LlamaConfig fields of the public checkpoints' shapes (their config.json files)
SIZES = {
    "tiny": dict(hidden_size=256, intermediate_size=640, num_attention_heads=4, num_key_value_heads=2,
                 num_hidden_layers=2, vocab_size=1000),
    "llama2-7b": dict(hidden_size=4096, intermediate_size=11008, num_attention_heads=32, num_key_value_heads=32,
                      num_hidden_layers=32, vocab_size=32000),
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                      num_hidden_layers=32, vocab_size=128256, rope_theta=500000.0),
    "llama2-13b": dict(hidden_size=5120, intermediate_size=13824, num_attention_heads=40, num_key_value_heads=40,
                       num_hidden_layers=40, vocab_size=32000),
    "llama2-70b": dict(hidden_size=8192, intermediate_size=28672, num_attention_heads=64, num_key_value_heads=8,
                       num_hidden_layers=80, vocab_size=32000),
    # every layer a sliding window (4096 tokens): its static cache counts tokens in Python (enable_cuda_graph)
    "mistral-7b": dict(family="mistral", hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                       num_key_value_heads=8, num_hidden_layers=32, vocab_size=32000, sliding_window=4096),
    # mixture of experts: 8 experts of 4096 -> 14336 -> 4096 per layer, top 2 (93 GB in fp16: pass --layers)
    "mixtral-8x7b": dict(family="mixtral", hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                         num_key_value_heads=8, num_hidden_layers=32, vocab_size=32000, num_local_experts=8,
                         num_experts_per_tok=2),
    "tiny-moe": dict(family="mixtral", hidden_size=256, intermediate_size=640, num_attention_heads=4,
                     num_key_value_heads=2, num_hidden_layers=2, vocab_size=1000, num_local_experts=4,
                     num_experts_per_tok=2),
}
FORMATS = ["fp16", "fp6", "int8", "int4"]


def _config(size: str, layers: int | None):
    """(config, model class) of a size: Llama unless its fields name another family."""
    import transformers

    fields = dict(SIZES[size])
    if layers is not None:
        fields["num_hidden_layers"] = layers
    family = {"llama": "Llama", "mistral": "Mistral", "mixtral": "Mixtral"}[fields.pop("family", "llama")]
    cfg = getattr(transformers, f"{family}Config")(max_position_embeddings=4096, **fields)
    return cfg, getattr(transformers, f"{family}ForCausalLM")


def build_model(size: str, layers: int | None, device: torch.device, seed: int = 0):
    cfg, cls = _config(size, layers)
    torch.manual_seed(seed)
    with torch.device(device):
        model = cls(cfg)
    return model.to(torch.float16).eval()


def build_tied_model(size: str, layers: int | None):
    """A model whose decoder layers all share the first layer's CPU weights (host memory of one layer):
    the random weights of a 70B-shaped model without 138 GB of host memory. `init_inference` quantizes
    layer by layer, so every layer still gets its own quantized copy on the GPU; `untie` gives the fp16
    baseline its own copies there."""
    one = build_model(size, 1, torch.device("cpu"))
    cfg, cls = _config(size, layers)
    with torch.device("meta"):
        model = cls(cfg)
    model.model.embed_tokens, model.model.norm, model.lm_head = one.model.embed_tokens, one.model.norm, one.lm_head
    model.model.rotary_emb = one.model.rotary_emb
    first = one.model.layers[0]
    for layer in model.model.layers:
        for name, param in first.named_parameters():
            owner, _, leaf = name.rpartition(".")
            layer.get_submodule(owner)._parameters[leaf] = param
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"build_tied_model: tensors left on meta: {left[:4]}")
    return model.to(torch.float16).eval()


def untie(model) -> None:
    """Give every decoder layer its own copy of the (shared) weights, on their device."""
    seen = set()
    for layer in model.model.layers:
        for name, param in list(layer.named_parameters(remove_duplicate=False)):
            if id(param) in seen:
                owner, _, leaf = name.rpartition(".")
                layer.get_submodule(owner)._parameters[leaf] = torch.nn.Parameter(param.detach().clone(),
                                                                                requires_grad=False)
            seen.add(id(param))


def _cache_kwarg(model) -> str:
    """The forward's KV-cache argument: `cache` (transformers >= 5.2x) or `past_key_values`."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _static_cache(model, max_len: int, batch: int):
    import transformers

    params = inspect.signature(transformers.StaticCache.__init__).parameters
    kw = {"config": model.config, "max_cache_len": max_len}
    if "max_batch_size" in params:  # older transformers allocate at construction
        kw.update(max_batch_size=batch, device=next(model.parameters()).device, dtype=torch.float16)
    return transformers.StaticCache(**kw)


def _forward(model, ids, pos, cache, key, fn=None):
    kw = {key: cache, "use_cache": True, "position_ids": pos}
    if "cache_position" in inspect.signature(model.model.forward).parameters:
        kw["cache_position"] = pos[0]
    return (fn or model)(ids, **kw).logits[:, -1]


class DecodeStep:
    """One decode step (batch B, one token each) on a static cache prefilled with `context` tokens; the
    inputs live in fixed buffers so the step can be captured in a CUDA graph."""

    def __init__(self, model, batch: int, context: int, seed: int = 1, compiled=None):
        self.model, self.compiled = model, compiled  # compiled: the step's forward (the prefill runs eager)
        self.key = _cache_kwarg(model)
        device = next(model.parameters()).device
        g = torch.Generator().manual_seed(seed)
        vocab = model.config.vocab_size
        prompt = torch.randint(0, vocab, (batch, context), generator=g).to(device)
        # transformers' static cache writes at its own device-side counter, which every step (a graph replay
        # too) advances: room for every step this object runs (attention covers the whole static length, so
        # a step costs the same wherever it writes)
        self.cache = _static_cache(model, context + self.MAX_STEPS, batch)
        self.steps = 0
        pos = torch.arange(context, device=device)[None].expand(batch, -1)
        with torch.no_grad():
            _forward(model, prompt, pos, self.cache, self.key)
        self.ids = torch.randint(0, vocab, (batch, 1), generator=g).to(device)
        self.pos = torch.full((batch, 1), context, device=device, dtype=torch.long)
        self.graph = None

    MAX_STEPS = 256

    def _count(self, n: int = 1) -> None:
        self.steps += n
        if self.steps > self.MAX_STEPS:
            raise RuntimeError(f"DecodeStep: more than {self.MAX_STEPS} steps on one static cache")

    def __call__(self) -> torch.Tensor:
        self._count()
        with torch.no_grad():
            return _forward(self.model, self.ids, self.pos, self.cache, self.key, self.compiled)

    def capture(self) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):  # warm-up on the side stream (autotuning happened before)
                self()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = self()

    def graph_ms(self, reps: int = 50) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self._count(1 + 3 * reps)
        self.graph.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(3):
            start.record()
            for _ in range(reps):
                self.graph.replay()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / reps)
        return min(times)


def generate_ms(model, batch: int, context: int, new_tokens: int, seed: int = 2) -> float:
    """ms per token of the model's own greedy `generate`: (time for 1 + new_tokens) - (time for 1), over
    new_tokens, after one call of each length (so, with enable_cuda_graph, the steady state of repeated
    calls: no capture inside the timing)."""
    g = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    prompt = torch.randint(0, model.config.vocab_size, (batch, context), generator=g).to(device)

    def run(n):
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0)
        sync()
        return time.perf_counter() - t0

    run(1)  # warm-up at both lengths: with enable_cuda_graph, every graph the timed calls replay is captured
    run(1 + new_tokens)
    t1 = min(run(1) for _ in range(2))
    tn = min(run(1 + new_tokens) for _ in range(2))
    return (tn - t1) * 1e3 / new_tokens


def graphed_generate(model, device, batch: int, context: int, new_tokens: int) -> tuple[float, str, int]:
    """(ms per token of `generate` with the forward graphed as `init_inference(enable_cuda_graph=True)`
    does it; its tokens against eager generate's with the same static cache: "same", or the first step
    that differs, with the largest |logit difference| / max |logit| over the steps up to it; graphs
    captured). The model is left as it was."""
    from lightspeed.inference import cuda_graph

    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, model.config.vocab_size, (batch, context), generator=g).to(device)

    def tokens(**kw):
        with torch.no_grad():
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                                 cache_implementation="static", return_dict_in_generate=True, output_logits=True,
                                 **kw)
        return out.sequences[:, context:], torch.stack(out.logits).float()

    want, want_logits = tokens(disable_compile=True)  # transformers would compile the forward for a static cache
    runner = cuda_graph.install(model, device)
    try:
        got, got_logits = tokens()
        ms = generate_ms(model, batch, context, new_tokens)
    finally:
        cuda_graph.uninstall(model)
    differ = (got != want).any(0).nonzero()
    if len(differ) == 0:
        return ms, "same", runner.captures
    step = int(differ[0])
    diff = ((got_logits[: step + 1] - want_logits[: step + 1]).abs().max() / want_logits.abs().max()).item()
    return ms, f"step {step} ({diff:.0e})", runner.captures


def layer_errors(model, step: "DecodeStep") -> float:
    """Max over the QuantizedLinear layers of one decode step of |y - F.linear(x, dequantized W, b)| /
    max |y_ref| on the step's own activations: the kernels against their reference at the model's shapes
    (the logits columns compound 32+ random layers, which amplify any perturbation)."""
    from lightspeed.inference import QuantizedLinear

    errs = []

    def hook(module, inputs, output):
        ref = torch.nn.functional.linear(inputs[0].float(), module.dequantize_weight().float(),
                                         None if module.bias is None else module.bias.float())
        errs.append(((output.float() - ref).abs().max() / ref.abs().max()).item())

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, QuantizedLinear)]
    try:
        step()
    finally:
        for h in handles:
            h.remove()
    return max(errs) if errs else float("nan")


def compiled_step(model, batch: int, context: int, eager_logits: torch.Tensor, gpu: bool):
    """(ms per token of the compiled step in a CUDA graph (nan on CPU), its first logits' relative L2
    error against the eager step's `eager_logits` (same model, same inputs), seconds spent compiling)."""
    torch._dynamo.reset()
    compiled = torch.compile(model.forward, fullgraph=True)
    step = DecodeStep(model, batch, context, compiled=compiled)
    t0 = time.perf_counter()
    logits = step().float()
    compile_s = time.perf_counter() - t0
    err = ((logits - eager_logits).norm() / eager_logits.norm()).item()
    ms = float("nan")
    if gpu:
        step.capture()
        ms = step.graph_ms()
    return ms, err, compile_s


def weight_gib(model) -> float:
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors) / 2**30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="llama2-7b", choices=sorted(SIZES))
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the size's own count)")
    ap.add_argument("--formats", default=",".join(FORMATS),
                    help="comma-separated; a format with '+inject' also fuses projections (replace_with_kernel_inject)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=512, help="tokens in the KV cache before the timed step")
    ap.add_argument("--new-tokens", type=int, default=32, help="tokens per eager generate timing")
    ap.add_argument("--no-eager", action="store_true", help="skip the eager generate timing")
    ap.add_argument("--smoke", action="store_true", help="the tiny size, short context (CPU: reference path)")
    ap.add_argument("--tied-layers", action="store_true",
                    help="build the model on the CPU with one layer's weights shared by all (see build_tied_model)")
    ap.add_argument("--compile", action="store_true",
                    help="also a decode step compiled by torch.compile (inductor, fullgraph) in a CUDA graph")
    ap.add_argument("--cuda-graph", action="store_true",
                    help="also generate with enable_cuda_graph (GPU): ms per token and tokens against eager")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel GPUs (init_inference tensor_parallel)")
    args = ap.parse_args()
    if args.tp > 1:
        if args.compile or args.tied_layers or args.smoke:
            ap.error("--tp: without --compile, --tied-layers and --smoke")
        if "LOCAL_RANK" not in os.environ:  # relaunch as tp processes, one GPU each
            os.execv(sys.executable, [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                      f"--nproc_per_node={args.tp}", os.path.abspath(__file__), *sys.argv[1:]])
    if args.smoke:
        args.size, args.context, args.new_tokens = "tiny", 16, 4
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    for f in formats:
        if f.removesuffix("+inject") not in FORMATS:
            ap.error(f"--formats: unknown format {f!r} (known: {', '.join(FORMATS)})")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rank = 0
    if args.tp > 1:
        import torch.distributed as dist

        rank = int(os.environ["LOCAL_RANK"])
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl")
        if dist.get_world_size() != args.tp:
            raise SystemExit(f"--tp {args.tp}: the process group has {dist.get_world_size()} ranks")
    global print
    if rank != 0:
        print = lambda *a, **k: None  # noqa: E731  (one report: rank 0's)
    gpu = device.type == "cuda"
    tp_kwargs = {"tensor_parallel": {"tp_size": args.tp}} if args.tp > 1 else {}
    base = build_tied_model(args.size, args.layers) if args.tied_layers else build_model(args.size, args.layers, device)
    layers = base.config.num_hidden_layers
    print(f"# {args.size} shapes, {layers} layers, batch {args.batch}, context {args.context}, "
          f"{torch.cuda.get_device_name() if gpu else 'CPU'}, torch {torch.__version__}"
          + (f", tensor parallel over {args.tp} GPUs" if args.tp > 1 else ""))
    ref_logits, rows = None, []
    for name in formats:
        fmt, inject = name.removesuffix("+inject"), name.endswith("+inject")
        if gpu:
            torch.cuda.reset_peak_memory_stats()
        try:
            if fmt == "fp16" and not inject and not args.tied_layers and args.tp == 1:
                model = base
            else:
                model = copy.deepcopy(base)  # tied stays tied: quantizing gives each layer its own copy, untie fp16
                lightspeed.init_inference(model, dtype=torch.float16, quant=None if fmt == "fp16" else {"weight": fmt},
                                          device=device, replace_with_kernel_inject=inject, **tp_kwargs)
                if fmt == "fp16":
                    untie(model)
            step = DecodeStep(model, args.batch, args.context)
        except torch.OutOfMemoryError as err:
            print(f"  {name}: out of GPU memory ({str(err).splitlines()[0]})", flush=True)
            model = step = None
            gc.collect()
            torch.cuda.empty_cache()
            continue
        peak_gib = torch.cuda.max_memory_allocated() / 2**30 if gpu else float("nan")
        print(f"  {name}: peak GPU memory {peak_gib:.1f} GiB (build + prefill)", flush=True)
        logits = step().float()  # the first call autotunes every layer shape for this M
        if fmt == "fp16" and not inject:
            ref_logits = logits
        err = agree = float("nan")
        if ref_logits is not None:
            err = ((logits - ref_logits).norm() / ref_logits.norm()).item()
            agree = (logits.argmax(-1) == ref_logits.argmax(-1)).float().mean().item()
        # (under tensor parallelism a row-parallel layer's hooked output is the group's sum: not compared)
        kernel_err = layer_errors(model, step) if fmt != "fp16" and args.tp == 1 else float("nan")
        graph_ms = float("nan")
        if gpu:
            try:
                step.capture()
                graph_ms = step.graph_ms()
            except RuntimeError as exc:  # transformers' fp16 MoE experts read the routes back to the host
                print(f"  {name}: the decode step cannot be captured ({str(exc).splitlines()[0][:90]})", flush=True)
                step = DecodeStep(model, args.batch, args.context)  # a fresh cache: the failed capture advanced it
        eager_ms = float("nan") if args.no_eager else generate_ms(model, args.batch, args.context, args.new_tokens)
        comp_ms = comp_err = float("nan")
        if args.compile:
            comp_ms, comp_err, compile_s = compiled_step(model, args.batch, args.context, logits, gpu)
            print(f"  {name}: compiled in {compile_s:.0f} s", flush=True)
        cg_ms, cg_same = float("nan"), "-"
        if args.cuda_graph and gpu:
            try:
                cg_ms, cg_same, captures = graphed_generate(model, device, args.batch, args.context, args.new_tokens)
                print(f"  {name}: generate with enable_cuda_graph {cg_ms:.2f} ms/token ({captures} graphs captured), "
                      f"tokens against eager's: {cg_same}", flush=True)
            except RuntimeError as exc:  # enable_cuda_graph's one-line error (fp16 MoE experts sync with the host)
                print(f"  {name}: no enable_cuda_graph row: {str(exc).splitlines()[0][:160]}", flush=True)
        rows.append((name, weight_gib(model), peak_gib, graph_ms, eager_ms, cg_ms, cg_same, comp_ms, err, agree,
                     kernel_err, comp_err))
        print(f"  {name}: graph {graph_ms:.3f} ms/token, eager {eager_ms:.2f} ms/token, compiled {comp_ms:.3f}",
              flush=True)
        del step
        if model is not base:
            del model
        gc.collect()
        if gpu:
            torch.cuda.empty_cache()
    base_row = next((r for r in rows if r[0] == "fp16"), None)
    print(f"\n{'format':<12}{'weights GiB':>12}{'peak GiB':>10}{'graph ms/tok':>14}{'x fp16':>8}{'eager ms/tok':>14}"
          f"{'x fp16':>8}{'cuda_graph ms/tok':>19}{'x fp16 eager':>14}{'tokens':>16}{'compiled ms/tok':>17}{'x fp16':>8}"
          f"{'logits err':>12}{'top-1 agree':>13}{'layer err':>11}{'compiled err':>14}")
    if args.tp > 1:
        print("(weights and peak memory: per GPU)")
    for fmt, gib, peak, g_ms, e_ms, cg_ms, cg_same, c_ms, err, agree, kerr, cerr in rows:
        gx, ex, cgx, cx = ((base_row[i] / ms if base_row else float("nan"))
                           for i, ms in ((3, g_ms), (4, e_ms), (4, cg_ms), (7, c_ms)))
        print(f"{fmt:<12}{gib:>12.2f}{peak:>10.1f}{g_ms:>14.3f}{gx:>8.2f}{e_ms:>14.2f}{ex:>8.2f}{cg_ms:>19.2f}{cgx:>14.2f}"
              f"{cg_same:>16}{c_ms:>17.3f}{cx:>8.2f}{err:>12.2e}{agree:>13.3f}{kerr:>11.1e}{cerr:>14.2e}")
    if args.tp > 1:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
