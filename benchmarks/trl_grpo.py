"""TRL's `GRPOTrainer`: one training step on lightspeed (registered as `deepspeed`) against the same
unchanged TRL script on real DeepSpeed 0.19.8, in the same invocation.

    # GPU (one H100/H200, no network; estimated 3 to 4 minutes with the defaults, not yet run on a GPU:
    # Qwen2-0.5B's shapes, bf16, 16 completions of 96 tokens per step, 2 warm-up + 3 timed steps, six
    # rows each in its own process)
    python benchmarks/trl_grpo.py --device cuda --deepspeed-path "$LIGHTSPEED_DS_SITE"
    #   DeepSpeed 0.19.8 importable from that directory (--deepspeed-path, default $LIGHTSPEED_DS_SITE),
    #   or from another interpreter: --deepspeed-python /path/to/venv/bin/python
    # CPU smoke run (the tiny model, fp32, gloo, one thread; about 45 s; DeepSpeed from
    # lightspeed.testing.deepspeed_env's venv, `python -m lightspeed.testing.deepspeed_env` creates it)
    python benchmarks/trl_grpo.py --smoke

What runs: a Hugging Face model built from a config with random weights (`--model`: Qwen2-0.5B's shapes,
OPT-350M's, OPT-350M's width at 4 layers (`opt-350m-4l`), or a 2-layer toy under `--smoke`, `tiny` or
`opt-tiny`), saved once with a word-level tokenizer made locally (tokens
`t2`..`t<vocab-1>`, `<pad>` 0, `<eos>` 1), so nothing is downloaded; the prompts are `--prompt-len` words
(`datasets.Dataset.from_dict`). The reward is plain Python: the share of a completion's tokens whose number
is even (it varies between completions, so the advantages are not all zero). Every completion is exactly
`--completion-len` tokens (GRPO's `max_completion_length`, and `min_new_tokens` equal to it through
`generation_kwargs`: random weights must not stop a row early). `beta` 0.04 by default, so TRL also
builds its reference model through `prepare_deepspeed` (an eval-only engine). The trainer is TRL's as
shipped: `GRPOTrainer(model=<dir>, reward_funcs=..., args=GRPOConfig(..., deepspeed=<config dict>), ...)`
with GRPOConfig's defaults otherwise (gradient checkpointing on, TRL's default; one generation per step);
the config is `zero_optimization.stage` 2 or 3 with Trainer's `auto` values, bf16 on GPU (fp32 under
`--smoke`), and Trainer's own torch AdamW.

Rows (`--systems`; each in a fresh process with world size 1, so peak memory is the row's own):
- `lightspeed-zero3`, `lightspeed-zero2`: `lightspeed.register_as_deepspeed()`, then the script.
- `lightspeed-zero3-hybrid`: plus `"hybrid_engine": {"enabled": true}`. TRL generates with
  `accelerator.unwrap_model(engine).generate`, which lightspeed's hybrid engine points at `engine.generate`
  (lightspeed/hybrid/engine.py), so TRL's path uses it. TRL's own `ds3_gather_for_generation` (default
  true) has gathered the whole model around that call already, so at stage 3 the hybrid engine finds the
  weights whole and gathers nothing more; the row measures what the engine adds around TRL's gather.
- `lightspeed-zero2-graph` (and `lightspeed-zero3-graph`, not in the default list): the hybrid engine with
  `enable_cuda_graph`: the decode steps replay CUDA graphs (lightspeed/hybrid/graphs.py); the table's
  footer gives the captures and replays. On CPU the runner runs eagerly (the row only smoke-tests the path).
- `deepspeed-zero3`, `deepspeed-zero2`: the same script in DeepSpeed 0.19.8's interpreter
  (`--deepspeed-python`, default this one; `--deepspeed-path` prepended to its PYTHONPATH, default
  `$LIGHTSPEED_DS_SITE`; under `--smoke` with neither given, lightspeed.testing.deepspeed_env's venv).
  DeepSpeed is never imported in lightspeed's process: every row is a child process, and the DeepSpeed
  child checks that `deepspeed` is DeepSpeed's own 0.19.8 (the lightspeed child, that it is lightspeed's).
- `deepspeed-zero3-hybrid`, `deepspeed-zero2-hybrid` (not in the default list): DeepSpeed's hybrid engine
  (its inference kernels on GPU); if it fails, the error is the row's result.

Figures (per row): seconds per GRPO step, the median over `--steps` timed steps after `--warmup` steps (a
step is Trainer's optimizer step: TRL's generation, the reward, the reference model's forward, the
policy's forward and backward, the optimizer step; timed between consecutive `on_step_end` callbacks,
each after a device synchronization); generation seconds (TRL's `_generate_single_turn`, which holds its
ZeRO-3 gather, wrapped on the trainer instance to time it; the median over the timed steps) and generated
tokens per second (the tokens TRL got back / that time); peak GPU memory over the timed steps
(`max_memory_allocated`, reset at each step's end); the mean reward and gradient norm of the timed steps
(a sanity check: finite and of the same size in every row; `--trace` prints each timed step's loss and
gradient norm and a checksum of its completions, which agree across rows to about 1e-6 in fp32 on the
CPU, the sampled completions being the same). `vs DS` is DeepSpeed's step time at the same
ZeRO stage over the row's (above 1: faster than DeepSpeed); `wall s` is the row's whole process.

Hardware: written without a GPU; no GPU figure of it exists yet. `--smoke` runs on CPU (2 layers, width
64) and supports no claim: it checks that every row runs end to end. `--smoke --model opt-350m` and the
sizes below run on one CPU thread for a compute-bound figure (BENCHMARKS.md), not the GPU claim.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_SYSTEMS = ("lightspeed-zero3", "deepspeed-zero3", "lightspeed-zero2", "deepspeed-zero2",
                   "lightspeed-zero3-hybrid", "lightspeed-zero2-graph")
EXTRA_SYSTEMS = ("lightspeed-zero3-graph", "lightspeed-zero2-hybrid", "deepspeed-zero3-hybrid",
                 "deepspeed-zero2-hybrid")
MODELS = {  # architecture, layers, hidden, intermediate, heads, kv heads, vocab
    "qwen2-0.5b": ("qwen2", 24, 896, 4864, 14, 2, 151936),
    "opt-350m": ("opt", 24, 1024, 4096, 16, 16, 50272),
    "tiny": ("qwen2", 2, 64, 128, 4, 2, 128),
    "opt-tiny": ("opt", 2, 64, 128, 4, 4, 128),
    "opt-350m-4l": ("opt", 4, 1024, 4096, 16, 16, 50272),
}
PAD, EOS = 0, 1


def parse_system(name: str) -> tuple[str, int, bool, bool]:
    """`<impl>-zero<stage>[-hybrid|-graph]` -> (impl, stage, hybrid engine, CUDA graphs)."""
    impl, zero, *mode = name.split("-")
    return impl, int(zero[len("zero"):]), bool(mode), mode == ["graph"]


# ---------------------------------------------------------------- the model directory (parent process)
def save_model(args, path: str) -> None:
    """Random weights from the config (seed 0) and a word-level tokenizer over `t2`..`t<vocab-1>`."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import OPTConfig, OPTForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    arch, layers, hidden, ffn, heads, kv_heads, vocab = MODELS[args.model]
    positions = max(2048, args.prompt_len + args.completion_len)
    torch.manual_seed(0)
    if arch == "qwen2":
        cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                          num_attention_heads=heads, num_key_value_heads=kv_heads, tie_word_embeddings=True,
                          max_position_embeddings=positions, bos_token_id=EOS, eos_token_id=EOS, pad_token_id=PAD)
        model = Qwen2ForCausalLM(cfg)
    else:
        cfg = OPTConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, ffn_dim=ffn,
                        num_attention_heads=heads, word_embed_proj_dim=512, do_layer_norm_before=False,
                        max_position_embeddings=positions, dropout=0.0, attention_dropout=0.0, pad_token_id=PAD,
                        bos_token_id=EOS, eos_token_id=EOS)
        model = OPTForCausalLM(cfg)
    model.save_pretrained(path)
    words = {"<pad>": PAD, "<eos>": EOS, **{f"t{i}": i for i in range(2, vocab)}}
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # its own folder: beside a Qwen2 config.json, AutoTokenizer would rebuild it as Qwen2's BPE tokenizer
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    fast.save_pretrained(os.path.join(path, "tokenizer"))


# ---------------------------------------------------------------- one row (child process)
def reward_even(completions, **kwargs) -> list[float]:
    """The share of a completion's tokens whose number is even (plain Python)."""
    out = []
    for text in completions:
        toks = [t for t in text.split() if t[1:].isdigit()]
        out.append(sum(int(t[1:]) % 2 == 0 for t in toks) / max(len(toks), 1))
    return out


def ds_config(args, stage: int, hybrid: bool, graph: bool) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
           "train_batch_size": "auto", "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
           "steps_per_print": 10**9, "zero_optimization": {"stage": stage}}
    if hybrid:
        cfg["hybrid_engine"] = {"enabled": True, "max_out_tokens": args.prompt_len + args.completion_len,
                                "inference_tp_size": 1, "release_inference_cache": False, "pin_parameters": True,
                                "tp_gather_partition_size": 8, "enable_cuda_graph": graph}
    return cfg


def words(i: int, n: int, vocab: int) -> str:
    return " ".join(f"t{(i * 7919 + j * 104729) % (vocab - 2) + 2}" for j in range(n))


def run_row(args) -> dict:
    impl, stage, hybrid, graph = parse_system(args.worker)
    if impl == "lightspeed":
        sys.path.insert(0, str(REPO))
        import lightspeed

        lightspeed.register_as_deepspeed()
    import deepspeed

    where = str(Path(deepspeed.__file__).resolve())
    shim = f"{os.sep}compat{os.sep}deepspeed{os.sep}" in where  # lightspeed.compat.deepspeed
    if impl == "deepspeed" and (shim or deepspeed.__version__ != "0.19.8"):
        raise RuntimeError(f"the DeepSpeed child imported deepspeed {deepspeed.__version__} from {where}, "
                           "not DeepSpeed 0.19.8")
    if impl == "lightspeed" and not shim:
        raise RuntimeError(f"the lightspeed child imported deepspeed from {where}")
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    cuda = args.device == "cuda"
    if not cuda:
        torch.set_num_threads(1)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    vocab = MODELS[args.model][-1]
    total = args.warmup + args.steps
    prompts_per_step = args.batch // args.generations
    data = Dataset.from_dict({"prompt": [words(i, args.prompt_len, vocab) for i in range(prompts_per_step * total)]})
    out_dir = tempfile.mkdtemp(prefix="trl_grpo_")
    config = GRPOConfig(
        output_dir=out_dir, deepspeed=ds_config(args, stage, hybrid, graph), use_cpu=not cuda,
        bf16=args.dtype == "bf16", per_device_train_batch_size=args.batch, num_generations=args.generations,
        max_completion_length=args.completion_len, generation_kwargs={"min_new_tokens": args.completion_len},
        beta=args.beta, max_steps=total, learning_rate=1e-6, lr_scheduler_type="constant", logging_steps=1,
        report_to=[], seed=0, disable_tqdm=True, save_strategy="no", dataloader_num_workers=0)
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(args.model_dir, "tokenizer"))
    trainer = GRPOTrainer(model=args.model_dir, reward_funcs=reward_even, args=config, train_dataset=data,
                          processing_class=tokenizer)

    ends, gens, tokens, peaks, checks = [], [], [], [], []

    class Clock(TrainerCallback):
        def on_step_end(self, a, state, control, **kwargs):
            sync()
            ends.append(time.perf_counter())
            if cuda:
                if len(ends) > args.warmup:
                    peaks.append(torch.cuda.max_memory_allocated())
                torch.cuda.reset_peak_memory_stats()

    generate_single_turn = trainer._generate_single_turn

    def timed_generate(*a, **k):  # the instance's attribute: TRL's method, timed
        sync()
        t0 = time.perf_counter()
        completion_ids, logprobs = generate_single_turn(*a, **k)
        sync()
        gens.append((len(ends), time.perf_counter() - t0))
        tokens.append((len(ends), sum(len(c) for c in completion_ids)))
        checks.append(sum((i + 1) * t for c in completion_ids for i, t in enumerate(c)))
        return completion_ids, logprobs

    trainer._generate_single_turn = timed_generate
    trainer.add_callback(Clock())
    trainer.train()
    engine = trainer.model_wrapped
    graphs = getattr(engine, "_decode_graphs", None)  # lightspeed's hybrid engine with enable_cuda_graph
    counts = None if graphs is None else {"captures": graphs.runner.captures, "replays": graphs.runner.replays,
                                          "drops": graphs.drops}
    steps = [b - a for a, b in zip(ends[args.warmup - 1:], ends[args.warmup:])]
    timed = range(args.warmup, total)
    gen_s = [sum(t for s, t in gens if s == i) for i in timed]
    gen_tokens = [sum(n for s, n in tokens if s == i) for i in timed]
    logs = [h for h in trainer.state.log_history if "loss" in h][args.warmup:]
    return {"system": args.worker, "version": deepspeed.__version__, "engine": type(engine).__name__,
            "ref_engine": type(getattr(trainer, "ref_model", None)).__name__, "steps": steps, "gen_s": gen_s,
            "gen_tokens": gen_tokens, "peak_gib": max(peaks) / 2**30 if peaks else None,
            "loss": [h["loss"] for h in logs], "grad_norm": [h.get("grad_norm") for h in logs],
            "reward": [h.get("reward") for h in logs], "graphs": counts, "checks": checks}


def child_main(args) -> None:
    try:
        result = run_row(args)
    except Exception as err:  # the row's result
        import traceback

        traceback.print_exc()
        frames = traceback.extract_tb(err.__traceback__)[-2:]
        at = " <- ".join(f"{f.filename.split('site-packages/')[-1]}:{f.lineno}" for f in reversed(frames))
        result = {"system": args.worker, "error": " ".join(f"{type(err).__name__}: {err}".split())[:300] + f" [{at}]"}
    Path(args.json).write_text(json.dumps(result))


# ---------------------------------------------------------------- the parent
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def deepspeed_python(args) -> str | None:
    """The DeepSpeed child's interpreter, or None (with the reason printed) when there is none."""
    if args.deepspeed_python or args.deepspeed_path or not args.smoke:
        return args.deepspeed_python or sys.executable
    sys.path.insert(0, str(REPO))
    from lightspeed.testing import deepspeed_env

    found = deepspeed_env.python()
    if found is None:
        print(f"DeepSpeed rows not measured: {deepspeed_env.missing_reason()}")
    return None if found is None else str(found)


def run_child(args, system: str, model_dir: str, ds_python: str | None) -> dict:
    impl = parse_system(system)[0]
    if impl == "deepspeed" and ds_python is None:
        return {"system": system, "error": "not measured: no DeepSpeed interpreter"}
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", LOCAL_RANK="0",
               WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", WANDB_DISABLED="true")
    if args.device == "cpu":
        env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    base_path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if impl == "deepspeed":
        python = ds_python
        env["PYTHONPATH"] = os.pathsep.join(([args.deepspeed_path] if args.deepspeed_path else []) + base_path)
        if args.device == "cpu":
            env["DS_ACCELERATOR"] = "cpu"
    else:
        python = sys.executable
        env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + base_path)
        env.pop("DS_ACCELERATOR", None)
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    argv = [python, str(Path(__file__).resolve()), "--worker", system, "--model-dir", model_dir, "--json", out,
            *passthrough(args)]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, cwd=tempfile.gettempdir(),
                              timeout=args.timeout)
        rc, tail = proc.returncode, (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    except subprocess.TimeoutExpired:
        rc, tail = "timeout", [f"timed out after {args.timeout:.0f} s"]
    try:
        result = json.loads(Path(out).read_text())
    except (OSError, ValueError):
        result = {"system": system, "error": f"child failed (exit {rc}): {' | '.join(tail)}"[:400]}
    os.unlink(out)
    result["wall_s"] = time.perf_counter() - t0
    if args.verbose and rc != 0:
        print(proc.stderr[-3000:] if rc != "timeout" else tail[0])
    return result


def passthrough(args) -> list[str]:
    out = []
    for key in ("device", "model", "dtype", "batch", "generations", "prompt_len", "completion_len", "beta",
                "warmup", "steps"):
        out += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    return out


def med(xs):
    xs = sorted(x for x in xs if x is not None)
    return xs[len(xs) // 2] if xs else float("nan")


def mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else float("nan")


def print_table(args, results: list[dict]) -> None:
    ds_step = {parse_system(r["system"])[1]: med(r["steps"]) for r in results
               if "steps" in r and r["system"] == f"deepspeed-zero{parse_system(r['system'])[1]}"}
    print(f"\n== GRPO step: median over {args.steps} steps after {args.warmup} warm-up; vs DS = DeepSpeed's "
          "step time at the same stage / the row's (above 1: faster than DeepSpeed)")
    print(f"{'system':<26}{'step s':>9}{'vs DS':>8}{'gen s':>9}{'gen tok/s':>11}{'peak GiB':>10}{'reward':>9}"
          f"{'grad norm':>11}  engine (reference)      wall s")
    for r in results:
        if "steps" not in r:
            print(f"{r['system']:<26}  {r['error']}")
            continue
        step = med(r["steps"])
        base = ds_step.get(parse_system(r["system"])[1])
        vs = f"{base / step:.2f}x" if base else "n/a"
        gen = med(r["gen_s"])
        tok = med(r["gen_tokens"]) / gen if gen > 0 else float("nan")
        peak = f"{r['peak_gib']:.2f}" if r["peak_gib"] is not None else "n/a"
        name = r["system"] + (f" ({r['version']})" if r["system"].startswith("deepspeed") else "")
        print(f"{name:<26}{step:>9.3f}{vs:>8}{gen:>9.3f}{tok:>11.1f}{peak:>10}{mean(r['reward']):>9.3f}"
              f"{mean(r['grad_norm']):>11.3e}  {r['engine']} ({r['ref_engine']}){r['wall_s']:>8.0f}")
    for r in results:
        if r.get("graphs"):
            c = r["graphs"]
            print(f"{r['system']} (all {args.warmup + args.steps} steps): {c['captures']} CUDA graph capture(s), "
                  f"{c['replays']} replayed decode steps, graphs dropped {c['drops']} time(s)")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", "--tiny", action="store_true", dest="smoke",
                    help="CPU smoke run: the tiny model, fp32, 4 completions of 8 tokens, 1 + 2 steps")
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default cuda (cpu with --smoke)")
    ap.add_argument("--model", choices=sorted(MODELS), default=None, help="default qwen2-0.5b (tiny with --smoke)")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="default bf16 on cuda, fp32 on cpu")
    ap.add_argument("--batch", type=int, default=None, help="completions per step (default 16; 4 with --smoke)")
    ap.add_argument("--generations", type=int, default=None, help="completions per prompt (default 8; 2 --smoke)")
    ap.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 64; 8 with --smoke)")
    ap.add_argument("--completion-len", type=int, default=None,
                    help="generated tokens per completion (default 96; 8 with --smoke)")
    ap.add_argument("--beta", type=float, default=0.04, help="KL coefficient (0: no reference model)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps (default 2; 1 with --smoke)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 3; 2 with --smoke)")
    ap.add_argument("--systems", nargs="+", default=list(DEFAULT_SYSTEMS), choices=DEFAULT_SYSTEMS + EXTRA_SYSTEMS)
    ap.add_argument("--deepspeed-python", default=None, help="interpreter of the DeepSpeed rows (default: this one)")
    ap.add_argument("--deepspeed-path", default=os.environ.get("LIGHTSPEED_DS_SITE", ""),
                    help="prepended to the DeepSpeed child's PYTHONPATH (default $LIGHTSPEED_DS_SITE)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per row (its process)")
    ap.add_argument("--verbose", action="store_true", help="print a failed child's stderr")
    ap.add_argument("--trace", action="store_true", help="print each row's loss and gradient norm per timed step")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--json", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    smoke = args.smoke
    defaults = {"device": "cpu" if smoke else "cuda", "model": "tiny" if smoke else "qwen2-0.5b",
                "batch": 4 if smoke else 16, "generations": 2 if smoke else 8, "prompt_len": 8 if smoke else 64,
                "completion_len": 8 if smoke else 96, "warmup": 1 if smoke else 2, "steps": 2 if smoke else 3}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.dtype is None:
        args.dtype = "bf16" if args.device == "cuda" else "fp32"
    if args.worker:
        child_main(args)
        return
    if args.warmup < 1 or args.steps < 1:
        raise SystemExit("trl_grpo.py: --warmup and --steps must be at least 1 (a step is timed from the one before)")
    if args.batch % args.generations:
        raise SystemExit(f"trl_grpo.py: --batch {args.batch} is not a multiple of --generations {args.generations}")
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("trl_grpo.py: no GPU here; the CPU run is --smoke (its figures support no claim)")
    hw = torch.cuda.get_device_name() if args.device == "cuda" else "CPU (1 thread, gloo)"
    print(f"TRL GRPOTrainer, model {args.model} (random weights), {args.dtype}, world 1; {args.batch} completions "
          f"per step ({args.generations} per prompt), prompt {args.prompt_len} + completion {args.completion_len} "
          f"tokens, beta {args.beta}; {hw}; torch {torch.__version__}; load average {os.getloadavg()[0]:.2f}")
    ds_python = deepspeed_python(args) if any(s.startswith("deepspeed") for s in args.systems) else None
    with tempfile.TemporaryDirectory(prefix="trl_grpo_model_") as model_dir:
        save_model(args, model_dir)
        results = []
        for system in args.systems:
            results.append(run_child(args, system, model_dir, ds_python))
            r = results[-1]
            print(f"  {system}: {'%.3f s/step' % med(r['steps']) if 'steps' in r else r['error']}", flush=True)
    print_table(args, results)
    if args.trace:
        print("\n== per timed step: loss / gradient norm; then a checksum of every step's completion tokens (warm-up included)")
        for r in results:
            if "loss" in r:
                print(f"{r['system']:<28} " + "  ".join(f"{l:.6g}/{g:.6g}" for l, g in zip(r["loss"], r["grad_norm"])) + f"  {r['checks']}")


if __name__ == "__main__":
    main()
