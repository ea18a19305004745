"""Generate text with a Hugging Face causal LM whose linear layers run as FP6 / INT8 / INT4 weights,
written the way a DeepSpeed inference script is: build the model on the meta device, hand
`init_inference` the checkpoint, generate with the model's own `generate`.

    python examples/generate_quantized.py --model /path/to/Llama-2-7b-hf --quant fp6 --prompt "The capital of"
    torchrun --nproc-per-node 2 examples/generate_quantized.py --model /path/to/model --tp 2
    python examples/generate_quantized.py --model /path/to/model --cuda-graph   # decode steps from CUDA graphs
    python examples/generate_quantized.py --model /path/to/model --cuda-graph --kernel-inject  # + q/k/v, gate/up fused
    python examples/generate_quantized.py --model /path/to/model --save /path/to/model-fp6   # quantize once
    python examples/generate_quantized.py --model /path/to/model-fp6                          # reload, no quantizing
    python examples/generate_quantized.py                  # no --model: a tiny random Llama, saved to a temp dir

The checkpoint is read one tensor at a time and each linear layer is quantized on its way to the GPU, so
neither the host nor the GPU ever holds the model in fp16 (a 70B model in FP6 fits one H200).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import torch

import lightspeed


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="a Hugging Face model directory (config.json + weights), or a directory saved "
                                   "with --save; default: a tiny random Llama")
    p.add_argument("--quant", default="fp6", choices=["fp6", "int8", "int4", "none"])
    p.add_argument("--group-size", type=int, default=None, help="per-group scales along K (default: per channel)")
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    p.add_argument("--prompt", default="Once upon a time")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (run under torchrun / lightspeed)")
    p.add_argument("--save", help="also save the quantized model here (loads back without quantizing)")
    p.add_argument("--device", default=None, help="default: this rank's GPU, else the CPU")
    p.add_argument("--cuda-graph", action="store_true",
                   help="init_inference(enable_cuda_graph=True): generate replays its decode steps (GPU only)")
    p.add_argument("--kernel-inject", action="store_true",
                   help="init_inference(replace_with_kernel_inject=True): q/k/v and gate/up fused into one product each")
    return p.parse_args(argv)


def tiny_model_dir() -> str:
    """A 2-layer random Llama saved as safetensors (the example needs no download)."""
    import transformers

    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=128, intermediate_size=352, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=512, max_position_embeddings=256)
    torch.manual_seed(0)
    directory = tempfile.mkdtemp(prefix="lightspeed_tiny_llama_")
    transformers.LlamaForCausalLM(cfg).save_pretrained(directory)
    return directory


def main(argv=None) -> None:
    args = parse_args(argv)
    model_dir = args.model or tiny_model_dir()  # each rank its own copy, before the process group exists
    try:
        run(args, model_dir)
    finally:
        if args.model is None:
            shutil.rmtree(model_dir, ignore_errors=True)


def run(args: argparse.Namespace, model_dir: str) -> None:
    import transformers

    if args.tp > 1:
        import torch.distributed as dist

        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = int(os.environ.get("RANK", 0))
    say = print if rank == 0 else (lambda *a, **k: None)
    config = transformers.AutoConfig.from_pretrained(model_dir)
    dtype = getattr(torch, args.dtype)
    with lightspeed.OnDevice(dtype=dtype, device="meta"):  # no memory: init_inference fills it
        model = transformers.AutoModelForCausalLM.from_config(config)
    start = time.perf_counter()
    model = lightspeed.init_inference(
        model, dtype=dtype, checkpoint=model_dir, device=args.device,
        quant=None if args.quant == "none" else {"weight": args.quant, "group_size": args.group_size},
        tensor_parallel={"tp_size": args.tp}, save_mp_checkpoint_path=args.save, enable_cuda_graph=args.cuda_graph,
        replace_with_kernel_inject=args.kernel_inject)
    device = next(model.parameters()).device
    say(f"loaded {model_dir} on {device} in {time.perf_counter() - start:.1f} s"
        + (f" (saved to {args.save})" if args.save else ""))

    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
        ids = tokenizer(args.prompt, return_tensors="pt").input_ids
    except (OSError, ValueError, TypeError):  # no tokenizer files (the tiny model): token ids instead
        tokenizer, ids = None, torch.arange(1, 9)[None] % config.vocab_size
    if args.save and tokenizer is not None and rank == 0:
        tokenizer.save_pretrained(args.save)  # the saved directory is then a whole model directory
    ids = ids.to(device)
    def generate():
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                             do_sample=False, pad_token_id=getattr(config, "pad_token_id", None) or 0)
        return out, time.perf_counter() - start

    out, seconds = generate()
    if args.cuda_graph:  # the first call captured the decode step; a second call replays it from the start
        say(f"first call (graphs captured) {seconds:.2f} s")
        out, seconds = generate()
    new = out[0, ids.shape[1]:]
    say(tokenizer.decode(out[0], skip_special_tokens=True) if tokenizer is not None else f"tokens: {out[0].tolist()}")
    say(f"{len(new)} new tokens in {seconds:.2f} s ({len(new) / seconds:.1f} tokens/s, "
        f"{'generate with CUDA graphs' if args.cuda_graph else 'eager generate'})")
    if args.tp > 1:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
