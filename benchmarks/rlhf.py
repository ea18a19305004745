"""RLHF experience step: lightspeed's hybrid engine against DeepSpeed 0.19.8 (ZeRO-3 `generate` without its
hybrid engine, and its own hybrid engine) and plain unsharded Hugging Face `generate`, in the same run.

    python benchmarks/rlhf.py [--world N] [--batch 16] [--prompt-len 256] [--answer-len 256]
        [--actor opt-1.3b] [--critic opt-350m] [--dtype bf16] [--warmup 1] [--repeats 3] [--rounds 1]
        [--systems plain lightspeed-hybrid deepspeed-zero3 deepspeed-hybrid] [--cuda-graph] [--deepspeed-python PY]
    python benchmarks/rlhf.py --tiny        # CPU smoke run: 2 layers, width 64, world 2 (gloo), seconds

What one experience step is (DeepSpeed-Chat's `DeepSpeedPPOTrainer.generate_experience`): the actor's
`actor.module.generate(prompts, attention_mask=mask, ...)` (DeepSpeed-Chat's spelling; under a hybrid
engine it is the engine's `generate`), greedy, `synced_gpus` true where the actor is ZeRO-3 (as
DeepSpeed-Chat passes it), then without gradients the actor's and the reference model's forwards over
prompt + answer (log-probabilities of the taken tokens), the reward model's `forward_value` (the score at
each answer's last token) and the critic's values, called on the engines as DeepSpeed-Chat calls them
(`reward_model.forward_value(...)`: both engines pass the attribute on to their module; lightspeed runs
it between the root's ZeRO-3 hooks). Every answer is `--answer-len` tokens (`min_new_tokens` =
`max_new_tokens`: random weights must not end a row early, so every system generates the same number
of tokens).

Models (random weights from configs, nothing downloaded; the same seed in every system): the actor and
the reference are `OPTForCausalLM` of `--actor`'s shapes (OPT-1.3B: 24 layers, width 2048, 32 heads);
the critic and the reward model are DeepSpeed-Chat's `RewardModel` shape (an `OPTModel` of `--critic`'s
shapes, OPT-350M: 24 layers, width 1024, projected to 512, and a bias-free value head). Actor and critic
get a client `torch.optim.AdamW` (as in training; not stepped here), reference and reward none. All four
at ZeRO-3 with DeepSpeed-Chat's stage-3 settings (parameter persistence threshold 1e4, live parameters
and prefetch bucket 3e7); `--dtype` bf16 (default on GPU) or fp32 (CPU).

Systems (rows):
- `lightspeed-hybrid`: lightspeed, the actor with `"hybrid_engine": {"enabled": true}` (its weights
  gathered once per `generate` call, then resharded); the other three lightspeed ZeRO-3 engines.
- `lightspeed-hybrid-graph` (added by `--cuda-graph`, or named in `--systems`): `lightspeed-hybrid` with
  `hybrid_engine.enable_cuda_graph` true: the decode steps of `generate` replay CUDA graphs over a static KV
  cache (lightspeed/hybrid/graphs.py; the first call captures, later calls replay while the gathered weights
  keep their addresses). On CPU (`--tiny`) the runner runs eagerly, so the row only smoke-tests the path.
- `deepspeed-zero3`: DeepSpeed 0.19.8 ZeRO-3 without the hybrid engine: the model's HF `generate`, with
  ZeRO-3's hooks gathering every layer at every decode step.
- `deepspeed-hybrid`: DeepSpeed 0.19.8 with `hybrid_engine.enabled` (DeepSpeedHybridEngine, its inference
  kernels). If it fails (it may, with the installed transformers, or on CPU where its kernels are not
  built), the error is the row's result.
- `plain`: each rank holds all four models whole (no engine, no communication) and calls HF `generate`
  and the forwards: the ceiling.
DeepSpeed runs in its own environment (`--deepspeed-python`, default the venv of
lightspeed.testing.deepspeed_env) in a subprocess that spawns one world per DeepSpeed system; lightspeed
never imports it. lightspeed's rows run in a lightspeed world (lightspeed.testing.run_world).

Figures: per system, `--warmup` experience steps, then `--repeats` timed ones, each after a barrier;
rank 0's times; the median. Generation tokens/s = world x batch x answer-len / the generate call's time;
the step's time is generate + the four forwards. `--rounds` > 1 alternates lightspeed's world and
DeepSpeed's (a neighbour's load falls on both) and reports the median over rounds. Ratios are each row's
time over lightspeed-hybrid's (higher: lightspeed faster). The `tokens` column says whether rank 0's
generated sequences equal the plain row's (fp32 must agree exactly; bf16 may differ where rounding
flips an argmax).

Hardware: the real figures (OPT-1.3B actor, 256 + 256 tokens, NCCL) need one or more GPUs (an H200 is
what this was written for); none was available when it was written, so no GPU figure of it exists yet.
`--tiny` runs on CPU (gloo, fp32, one thread per rank) and supports no claim: at width 64 the step is
Python and dispatch overhead, not the weights' gathering or the GEMMs.
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

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
MARK = "@@RLHF@@"
PAD, BOS, EOS = 1, 2, 2
SYSTEMS = ("plain", "lightspeed-hybrid", "deepspeed-zero3", "deepspeed-hybrid")
GRAPH_SYSTEM = "lightspeed-hybrid-graph"  # lightspeed-hybrid with hybrid_engine.enable_cuda_graph (--cuda-graph)
LIGHTSPEED_SYSTEMS = ("plain", "lightspeed-hybrid", GRAPH_SYSTEM)
SHAPES = {  # layers, width, ffn, heads, word_embed_proj_dim (OPT's configs)
    "opt-125m": (12, 768, 3072, 12, 768),
    "opt-350m": (24, 1024, 4096, 16, 512),
    "opt-1.3b": (24, 2048, 8192, 32, 2048),
    "opt-2.7b": (32, 2560, 10240, 32, 2560),
    "opt-6.7b": (32, 4096, 16384, 32, 4096),
    "tiny-actor": (2, 64, 256, 4, 64),
    "tiny-critic": (2, 64, 256, 4, 32),
}


# ---------------------------------------------------------------- models and the step (both environments)
def opt_config(shape: str, args):
    from transformers import OPTConfig

    layers, width, ffn, heads, proj = SHAPES[shape]
    return OPTConfig(vocab_size=args.vocab, hidden_size=width, num_hidden_layers=layers, ffn_dim=ffn,
                     num_attention_heads=heads, word_embed_proj_dim=proj, do_layer_norm_before=shape != "opt-350m",
                     max_position_embeddings=max(2048, args.prompt_len + args.answer_len), dropout=0.0,
                     attention_dropout=0.0, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS)


class RewardModel(nn.Module):
    """DeepSpeed-Chat's reward / critic model: a base transformer and a bias-free value head."""

    def __init__(self, base, width: int):
        super().__init__()
        self.config = base.config
        self.rwtransformer = base
        self.v_head = nn.Linear(width, 1, bias=False)

    def forward_value(self, input_ids, attention_mask, prompt_length: int = 0, return_value_only: bool = False):
        hidden = self.rwtransformer(input_ids, attention_mask=attention_mask, use_cache=False)[0]
        values = self.v_head(hidden).squeeze(-1)
        if return_value_only:
            return values
        scores = []
        for i in range(input_ids.shape[0]):  # the value at each answer's last token (before its first pad)
            pads = (input_ids[i, prompt_length:] == PAD).nonzero()
            end = pads[0].item() + prompt_length if len(pads) else input_ids.shape[1]
            scores.append(values[i, end - 1])
        return {"values": values, "chosen_end_scores": torch.stack(scores)}

    def forward(self, input_ids, attention_mask=None):
        return self.forward_value(input_ids, attention_mask, return_value_only=True)


def build_actor(args):
    from transformers import OPTForCausalLM

    torch.manual_seed(0)
    return OPTForCausalLM(opt_config(args.actor, args))


def build_critic(args):
    from transformers import OPTModel

    torch.manual_seed(1)
    cfg = opt_config(args.critic, args)
    return RewardModel(OPTModel(cfg), cfg.word_embed_proj_dim)


def make_adam(params):
    return torch.optim.AdamW(params, lr=1e-5)


def ds_config(args, world: int, train: bool, hybrid: bool, cuda_graph: bool = False) -> dict:
    """DeepSpeed-Chat's training (actor, critic) and evaluation (reference, reward) configs at ZeRO-3."""
    zero = {"stage": 3, "stage3_param_persistence_threshold": 10000}
    if train:
        zero.update(stage3_max_live_parameters=30000000, stage3_prefetch_bucket_size=30000000)
    cfg = {"train_batch_size": args.batch * world, "train_micro_batch_size_per_gpu": args.batch,
           "steps_per_print": 10**9, "zero_optimization": zero, "gradient_clipping": 1.0, "wall_clock_breakdown": False}
    if args.dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if hybrid:
        cfg["hybrid_engine"] = {"enabled": True, "max_out_tokens": args.prompt_len + args.answer_len,
                                "inference_tp_size": 1, "release_inference_cache": False, "pin_parameters": True,
                                "tp_gather_partition_size": 8, "enable_cuda_graph": cuda_graph}
    return cfg


def prompt_batch(args, rank: int, device):
    g = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(4, args.vocab, (args.batch, args.prompt_len), generator=g)
    return ids.to(device), torch.ones_like(ids).to(device)


def gather_log_probs(logits, labels):
    return torch.log_softmax(logits, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def experience(models: dict, prompts, mask, args, synced: bool, device) -> tuple[float, float, torch.Tensor]:
    """One `generate_experience`; returns (generate seconds, whole step seconds, the sequences)."""
    actor, ref, critic, reward = models["actor"], models["ref"], models["critic"], models["reward"]
    for m in (actor, ref, critic, reward):
        m.eval()
    sync(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        seq = actor.module.generate(prompts, attention_mask=mask, max_new_tokens=args.answer_len,
                                    min_new_tokens=args.answer_len, do_sample=False, pad_token_id=PAD,
                                    synced_gpus=synced)
    sync(device)
    t1 = time.perf_counter()
    attention_mask = seq.ne(PAD).long()
    with torch.no_grad():
        logits = actor(seq, attention_mask=attention_mask).logits
        logits_ref = ref(seq, attention_mask=attention_mask).logits
        score = reward.forward_value(seq, attention_mask, prompt_length=args.prompt_len)["chosen_end_scores"]
        values = critic.forward_value(seq, attention_mask, return_value_only=True)[:, :-1]
        logprobs = gather_log_probs(logits[:, :-1, :], seq[:, 1:])
        ref_logprobs = gather_log_probs(logits_ref[:, :-1, :], seq[:, 1:])
    sync(device)
    t2 = time.perf_counter()
    assert seq.shape[1] == args.prompt_len + args.answer_len, seq.shape
    assert logprobs.shape == ref_logprobs.shape == values.shape and score.shape == (args.batch,)
    return t1 - t0, t2 - t0, seq


class _Plain(nn.Module):
    """A whole model with DeepSpeed's `.module` spelling, for the plain row."""

    def __init__(self, model):
        super().__init__()
        self.module = model

    def forward(self, *a, **k):
        return self.module(*a, **k)

    def forward_value(self, *a, **k):
        return self.module.forward_value(*a, **k)


def device_of(backend: str):
    if backend == "nccl":
        rank = torch.distributed.get_rank()
        torch.cuda.set_device(rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    torch.set_num_threads(1)
    return torch.device("cpu")


def build_system(system: str, initialize, args, world: int, device) -> dict:
    """The four models of `system`: engines from `initialize` (lightspeed's or DeepSpeed's), or whole."""
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    if system == "plain":
        with device:  # built where they run (a 1.3B model's random init on the host alone takes seconds)
            return {name: _Plain(build(args)).to(device=device, dtype=dtype)
                    for name, build in (("actor", build_actor), ("ref", build_actor), ("critic", build_critic),
                                        ("reward", build_critic))}
    hybrid = system.endswith("hybrid") or system == GRAPH_SYSTEM
    out = {}
    for name, build, train in (("actor", build_actor, True), ("ref", build_actor, False),
                               ("critic", build_critic, True), ("reward", build_critic, False)):
        with device:
            model = build(args)
        params = [p for p in model.parameters() if p.requires_grad]
        engine, *_ = initialize(model=model, optimizer=make_adam if train else None, model_parameters=params,
                                config=ds_config(args, world, train, hybrid and name == "actor",
                                                 cuda_graph=system == GRAPH_SYSTEM))
        out[name] = engine
    return out


def measure(system: str, initialize, args, device) -> dict:
    """Build `system`'s models in this world and time its experience steps (every rank; rank 0's figures)."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    models = build_system(system, initialize, args, world, device)
    prompts, mask = prompt_batch(args, rank, device)
    gens, steps = [], []
    for i in range(args.warmup + args.repeats):
        dist.barrier()
        gen, step, seq = experience(models, prompts, mask, args, synced=system != "plain" and world > 1,
                                    device=device)
        if i >= args.warmup:
            gens.append(gen)
            steps.append(step)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    graphs = getattr(models["actor"], "_decode_graphs", None)
    graph_counts = None if graphs is None else {"captures": graphs.runner.captures, "replays": graphs.runner.replays,
                                                "drops": graphs.drops}
    for m in models.values():
        if hasattr(m, "destroy"):
            m.destroy()
    del models
    dist.barrier()
    gen_s, step_s = sorted(gens)[len(gens) // 2], sorted(steps)[len(steps) // 2]
    if rank == 0:  # as each system finishes, so a run cut short still reports the finished ones
        tokens = world * args.batch * args.answer_len
        print(f"  {system}: generate {gen_s:.3f} s ({tokens / gen_s:.1f} tokens/s), step {step_s:.3f} s"
              + (f", peak {peak:.2f} GiB" if peak is not None else "")
              + (f", graphs {graph_counts}" if graph_counts else ""), flush=True)
    return {"system": system, "gen_s": gen_s, "step_s": step_s,
            "gens": gens, "steps": steps, "peak_gib": peak, "seq": seq.cpu().tolist(), "graphs": graph_counts}


# ---------------------------------------------------------------- lightspeed (run_world children)
def _lightspeed_world(args_dict: dict, systems: list, backend: str) -> list[dict]:
    import lightspeed

    args = argparse.Namespace(**args_dict)
    device = device_of(backend)
    return [measure(s, lightspeed.initialize, args, device) for s in systems]


def run_lightspeed(args, systems: list) -> dict:
    from lightspeed.testing.run_world import run_world

    backend = "nccl" if args.gpu else "gloo"
    # run_world's ranks default to lightspeed's CPU accelerator
    env = {"LIGHTSPEED_ACCELERATOR": "cuda"} if args.gpu else {"OMP_NUM_THREADS": "1"}
    rank0 = run_world(_lightspeed_world, args.world, vars(args), systems, backend, backend=backend,
                      timeout=args.timeout, env=env)[0]
    return {r["system"]: r for r in rank0}


# ---------------------------------------------------------------- DeepSpeed (its own interpreter)
def _ds_worker(rank: int, world: int, port: int, args_dict: dict, system: str, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    args = argparse.Namespace(**args_dict)
    if args.gpu:  # the rank's GPU before NCCL's communicator is made
        torch.cuda.set_device(rank % torch.cuda.device_count())
    import deepspeed

    deepspeed.init_distributed(dist_backend="nccl" if args.gpu else "gloo")
    device = device_of("nccl" if args.gpu else "gloo")
    try:
        result = measure(system, deepspeed.initialize, args, device)
    except Exception as err:  # the row's result (DeepSpeed's hybrid engine may not run here)
        import traceback

        frames = traceback.extract_tb(err.__traceback__)
        chain = [f for f in frames if "/deepspeed/" in f.filename][-3:] or frames[-1:]
        at = " <- ".join(f"{f.filename.split('site-packages/')[-1]}:{f.lineno} ({f.name})" for f in reversed(chain))
        msg = " ".join(f"{type(err).__name__}: {err}".split())
        result = {"system": system, "error": f"{msg[:200]} [raised in {at}]"}
    result["version"] = deepspeed.__version__
    if rank == 0:
        Path(out_path).write_text(json.dumps(result))


def _ds_child(args) -> None:
    """In DeepSpeed's interpreter: one spawned world per system; prints each result after MARK."""
    import torch.multiprocessing as mp

    for system in args.systems:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            path = f.name
        try:
            mp.start_processes(_ds_worker, args=(args.world, port, vars(args), system, path), nprocs=args.world,
                               start_method="spawn")
            result = json.loads(Path(path).read_text())
        except Exception as err:  # a rank died outside measure (a crash, not an exception)
            result = {"system": system, "error": " ".join(f"{type(err).__name__}: {err}".split())[:300]}
        print(MARK + json.dumps(result), flush=True)
        os.unlink(path)


def run_deepspeed(args, systems: list) -> dict:
    python = args.deepspeed_python
    if python is None:
        sys.path.insert(0, str(REPO))
        from lightspeed.testing import deepspeed_env

        found = deepspeed_env.python()
        if found is None:
            return {s: {"system": s, "error": f"not measured: {deepspeed_env.missing_reason()}"} for s in systems}
        python = str(found)
    env = dict(os.environ, PYTHONPATH="")
    if not args.gpu:
        env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    argv = [python, __file__, "--ds-child", *passthrough(args), "--systems", *systems]
    try:
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, cwd=tempfile.gettempdir(),
                              timeout=args.timeout)
        stdout, stderr, rc = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as err:
        stdout, stderr, rc = err.stdout or "", f"timed out after {args.timeout:.0f} s", "timeout"
        stdout = stdout if isinstance(stdout, str) else stdout.decode()
    results = {}
    for line in stdout.splitlines():
        if line.startswith(MARK):
            r = json.loads(line[len(MARK):])
            results[r["system"]] = r
    for s in systems:
        if s not in results:
            tail = " | ".join((stderr or stdout).strip().splitlines()[-3:])
            results[s] = {"system": s, "error": f"DeepSpeed child failed (exit {rc}): {tail}"[:400]}
    return results


# ---------------------------------------------------------------- table
def passthrough(args) -> list[str]:
    out = []
    for key in ("world", "batch", "prompt_len", "answer_len", "actor", "critic", "vocab", "dtype", "warmup",
                "repeats"):
        out += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    return out + (["--gpu"] if args.gpu else [])


def med(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else float("nan")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: 2 layers, width 64, world 2, gloo, fp32")
    ap.add_argument("--world", type=int, default=None, help="ranks (default: the GPUs; 2 with --tiny)")
    ap.add_argument("--batch", type=int, default=None, help="prompts per rank (default 16; 2 with --tiny)")
    ap.add_argument("--prompt-len", type=int, default=None, help="default 256; 16 with --tiny")
    ap.add_argument("--answer-len", type=int, default=None, help="default 256; 16 with --tiny")
    ap.add_argument("--actor", default=None, choices=sorted(SHAPES), help="default opt-1.3b")
    ap.add_argument("--critic", default=None, choices=sorted(SHAPES), help="default opt-350m")
    ap.add_argument("--vocab", type=int, default=None, help="default OPT's 50272; 512 with --tiny")
    ap.add_argument("--dtype", default=None, choices=("bf16", "fp32"), help="default bf16 on GPU, fp32 on CPU")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3, help="timed experience steps (the median is reported)")
    ap.add_argument("--rounds", type=int, default=1, help="alternating lightspeed / DeepSpeed rounds")
    ap.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS + (GRAPH_SYSTEM,))
    ap.add_argument("--cuda-graph", action="store_true",
                    help=f"add the {GRAPH_SYSTEM} row (hybrid_engine.enable_cuda_graph true)")
    ap.add_argument("--deepspeed-python", default=None, help="an interpreter that imports deepspeed")
    ap.add_argument("--gpu", action="store_true", help=argparse.SUPPRESS)  # set from the machine, for children
    ap.add_argument("--timeout", type=float, default=3000)
    ap.add_argument("--ds-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.ds_child:
        _ds_child(args)
        return
    if args.cuda_graph and GRAPH_SYSTEM not in args.systems:
        args.systems.insert(args.systems.index("lightspeed-hybrid") + 1 if "lightspeed-hybrid" in args.systems
                            else len(args.systems), GRAPH_SYSTEM)
    tiny = args.tiny
    args.gpu = torch.cuda.is_available() and not tiny
    defaults = {"world": 2 if tiny else max(torch.cuda.device_count(), 1), "batch": 2 if tiny else 16,
                "prompt_len": 16 if tiny else 256, "answer_len": 16 if tiny else 256,
                "actor": "tiny-actor" if tiny else "opt-1.3b", "critic": "tiny-critic" if tiny else "opt-350m",
                "vocab": 512 if tiny else 50272, "dtype": "bf16" if args.gpu else "fp32"}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if not args.gpu and not tiny:
        raise SystemExit("rlhf.py: no GPU here; the CPU run is --tiny (its figures support no claim)")
    sys.path.insert(0, str(REPO))
    hw = torch.cuda.get_device_name() if args.gpu else f"CPU ({os.cpu_count()} cores, gloo, 1 thread per rank)"
    print(f"actor {args.actor} (+ reference), critic {args.critic} (+ reward), ZeRO-3, {args.dtype}; world "
          f"{args.world}, batch {args.batch} per rank, prompt {args.prompt_len} + answer {args.answer_len} tokens; "
          f"{hw}; torch {torch.__version__}; load average at start {os.getloadavg()[0]:.2f}")
    ls_sys = [s for s in args.systems if s in LIGHTSPEED_SYSTEMS]
    ds_sys = [s for s in args.systems if s not in LIGHTSPEED_SYSTEMS]
    rounds = []
    for _ in range(args.rounds):
        got = run_lightspeed(args, ls_sys) if ls_sys else {}
        got.update(run_deepspeed(args, ds_sys) if ds_sys else {})
        rounds.append(got)
    tokens = args.world * args.batch * args.answer_len
    plain_seq = next((r["plain"]["seq"] for r in rounds if "seq" in r.get("plain", {})), None)
    names = {"plain": "plain HF generate (unsharded)", "lightspeed-hybrid": "lightspeed hybrid engine",
             GRAPH_SYSTEM: "lightspeed hybrid, enable_cuda_graph",
             "deepspeed-zero3": "DeepSpeed {v} ZeRO-3 HF generate", "deepspeed-hybrid": "DeepSpeed {v} hybrid engine"}
    print(f"\n== experience step (median over {args.repeats} steps after {args.warmup} warm-up; median over "
          f"{args.rounds} round(s)); vs lightspeed = the row's time / lightspeed-hybrid's")
    print(f"{'system':<38}{'gen s':>9}{'gen tok/s':>11}{'vs ls':>8}{'step s':>9}{'vs ls':>8}{'peak GiB':>10}"
          f"  tokens")
    spread = []
    for s in args.systems:
        rs = [r[s] for r in rounds if s in r]
        ok = [r for r in rs if "gen_s" in r]
        name = names[s].format(v=next((r.get("version") for r in rs if r.get("version")), "0.19.8"))
        if not ok:
            print(f"{name:<38}  {rs[0]['error'] if rs else 'not run'}")
            continue
        gen, step = med([r["gen_s"] for r in ok]), med([r["step_s"] for r in ok])
        pairs = [(r[s], r["lightspeed-hybrid"]) for r in rounds
                 if "gen_s" in r.get(s, {}) and "gen_s" in r.get("lightspeed-hybrid", {})]
        gen_ratios = [a["gen_s"] / b["gen_s"] for a, b in pairs]
        step_ratios = [a["step_s"] / b["step_s"] for a, b in pairs]
        vs_gen, vs_step = med(gen_ratios), med(step_ratios)
        if len(pairs) > 1 and s != "lightspeed-hybrid":
            spread.append(f"{name}: generate {min(gen_ratios):.2f}-{max(gen_ratios):.2f}x, "
                          f"step {min(step_ratios):.2f}-{max(step_ratios):.2f}x")
        peak = f"{ok[0]['peak_gib']:.2f}" if ok[0]["peak_gib"] is not None else "n/a"
        same = "n/a" if plain_seq is None else ("= plain" if ok[0]["seq"] == plain_seq else "differ from plain")
        vs_gen, vs_step = (f"{v:.2f}x" if pairs else "n/a" for v in (vs_gen, vs_step))
        print(f"{name:<38}{gen:>9.3f}{tokens / gen:>11.1f}{vs_gen:>8}{step:>9.3f}{vs_step:>8}{peak:>10}  {same}")
    if spread:
        print("ratios over the rounds: " + "; ".join(spread))
    for r in rounds:
        if r.get(GRAPH_SYSTEM, {}).get("graphs") is not None:
            c = r[GRAPH_SYSTEM]["graphs"]
            print(f"{GRAPH_SYSTEM} (rank 0, all {args.warmup + args.repeats} steps): {c['captures']} capture(s), "
                  f"{c['replays']} replayed decode steps, graphs dropped {c['drops']} time(s) for moved weights")
    print(f"load average at end: {os.getloadavg()[0]:.2f} (1 min), {os.getloadavg()[1]:.2f} (5 min)")


if __name__ == "__main__":
    main()
