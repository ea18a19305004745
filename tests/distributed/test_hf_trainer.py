"""transformers' Trainer on lightspeed registered as `deepspeed` (2 gloo processes, CPU): ZeRO-2 and
ZeRO-3 with a Hugging Face ds_config full of "auto" values, bf16, gradient accumulation 2, against
Trainer's own DDP run; a checkpoint resumed in a fresh job; `save_model` under ZeRO-3;
`from_pretrained` under ZeRO-3 (right weights, never the whole model on one rank); a Llama's
`from_config` under ZeRO-3; and Ulysses sequence parallelism (accelerate's ParallelismConfig, sp 2, so
transformers' `deepspeed_sp_compute_loss`) at ZeRO-2 and ZeRO-3 in fp32 against one process on the whole
sequence: the gradient norms and the trained weights.

Registration happens inside the spawned ranks only: the pytest process never sees a `deepspeed`.

Tolerance of the loss comparison: Trainer's DDP run keeps fp32 weights and computes under bf16
autocast; the DeepSpeed runs keep bf16 weights (the config's bf16) with an fp32 master, so the two
differ by bf16 rounding of the weights and of the activations autocast leaves in fp32. Measured
(2026-12-01, this test's model and data): DDP 3.9094, 3.8675, 3.8190, 3.7549; ZeRO-2 and ZeRO-3
3.9095, 3.8679, 3.8223, 3.7529, i.e. at most 8.5e-4 relative. The bound, 5e-3, leaves 6x room and
stays below what one step changes the loss (1.1% to 1.7% here), so a step missed, doubled or taken
with a wrong gradient average fails.
"""

from __future__ import annotations

import os

import pytest
import torch

from lightspeed.testing.run_world import run_world

pytestmark = [pytest.mark.no_real_deepspeed, pytest.mark.dist, pytest.mark.slow, pytest.mark.timeout(600)]

VOCAB, SEQ, STEPS = 64, 16, 4


def hf_ds_config(stage: int) -> dict:
    zero = {"stage": stage, "reduce_bucket_size": "auto"}
    if stage == 3:
        zero.update(stage3_prefetch_bucket_size="auto", stage3_param_persistence_threshold="auto",
                    stage3_gather_16bit_weights_on_model_save=True)
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto", "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
            "optimizer": {"type": "AdamW",
                          "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
            "zero_optimization": zero}


def save_tiny_gpt2(path: str) -> dict[str, torch.Tensor]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=4, n_head=2,
                                       bos_token_id=0, eos_token_id=0))
    model.save_pretrained(path)
    return {k: v.clone() for k, v in model.state_dict().items()}


def dataset():
    """Arithmetic sequences modulo the vocabulary: learnable, so the loss falls step by step."""
    g = torch.Generator().manual_seed(0)
    start = torch.randint(0, VOCAB, (64, 1), generator=g)
    stride = torch.randint(1, 4, (64, 1), generator=g)
    return [{"input_ids": x, "labels": x} for x in (start + stride * torch.arange(SEQ)) % VOCAB]


def training_args(out_dir: str, ds_config: dict | None, save: bool):
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=out_dir, deepspeed=ds_config, per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, max_steps=STEPS, learning_rate=1e-2,
                             lr_scheduler_type="constant", weight_decay=0.01, bf16=True, logging_steps=1,
                             report_to=[], save_strategy="steps" if save else "no", save_steps=2, use_cpu=True,
                             seed=0, disable_tqdm=True)


def gathered_state(model) -> dict[str, torch.Tensor]:
    import deepspeed

    out = {}
    for name, p in model.named_parameters():
        with deepspeed.zero.GatheredParameters(p):
            out[name] = p.detach().float().clone()
    return out


def llama_from_config() -> dict:
    """A tiny Llama built by `from_config` under ZeRO-3 (transformers enters zero.Init, then initializes
    each module's gathered parameters on rank 0): per parameter (std, mean), and the RoPE buffer's dtype."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=SEQ)
    model = AutoModelForCausalLM.from_config(config)
    stats = {n: (float(v.std()), float(v.mean())) for n, v in gathered_state(model).items()}
    return {"stats": stats, "inv_freq": model.model.rotary_emb.inv_freq.dtype,
            "partitioned": all(p.numel() == 0 for p in model.parameters())}


class PeakGathered:
    """Test instrumentation: the most full-size parameter elements alive at once in stage-3 groups
    (gathered buffers, plus a group's values and buffer while it is being built)."""

    def __init__(self):
        from lightspeed.zero.stage3 import param_group

        self.live = self.peak = 0
        cls = param_group.ParamGroup
        originals = {name: getattr(cls, name) for name in ("__init__", "gather", "release", "discard")}
        tracker = self

        def init(group, name, params, names, values, *a, **k):
            numel = sum(v.numel() for v in values)
            tracker.peak = max(tracker.peak, tracker.live + 2 * numel)
            tracker.live += numel  # the values (the caller's) plus the group's buffer, until it is released
            originals["__init__"](group, name, params, names, values, *a, **k)
            tracker.live -= numel

        def gather(group):
            if group.state == param_group.RELEASED:
                tracker.live += group.layout.numel
                tracker.peak = max(tracker.peak, tracker.live)
            originals["gather"](group)

        def release(group, **kwargs):
            if group.state != param_group.RELEASED:
                tracker.live -= group.layout.numel
            originals["release"](group, **kwargs)

        def discard(group):
            if group.state != param_group.RELEASED:
                tracker.live -= group.layout.numel
            originals["discard"](group)

        cls.__init__, cls.gather, cls.release, cls.discard = init, gather, release, discard


def _run(mode: str, model_dir: str, out_dir: str, resume: str | None):
    from transformers import AutoModelForCausalLM, Trainer
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config
    from transformers.trainer_pt_utils import get_model_param_count

    ds = hf_ds_config(int(mode[-1])) if mode != "ddp" else None
    args = training_args(out_dir, ds, save=mode == "zero3")
    peak = loaded = None
    llama = None
    if mode == "zero3":
        tracker = PeakGathered()
        model = AutoModelForCausalLM.from_pretrained(model_dir)  # inside deepspeed.zero.Init
        peak = tracker.peak
        loaded = gathered_state(model)
        llama = llama_from_config()
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir)
    trainer = Trainer(model=model, args=args, train_dataset=dataset())
    trainer.train(resume_from_checkpoint=resume)
    out = {"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
           "global_step": trainer.state.global_step, "loaded": loaded, "peak": peak,
           "total": sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters()),
           "param_count": get_model_param_count(model, trainable_only=True) if mode == "zero3" else None,
           "engine": type(trainer.model_wrapped).__name__, "llama": llama,
           "setup_peak": trainer.model_wrapped.strategy.setup_peak_numel if mode == "zero3" else None}
    if mode == "zero3" and resume is None:
        trainer.save_model(os.path.join(out_dir, "final"))
        out["trained"] = gathered_state(trainer.model_wrapped.module)
    unset_hf_deepspeed_config()  # the next run in this process starts without this run's config
    return out


# ---------------------------------------------------------------- Ulysses sequence parallelism, fp32
SP_STEPS, SP_CLIP = 4, 3.0  # the clip acts at some steps only: a gradient scaled by 1/sp changes the weights
# Adam turns the rounding of near-zero gradient elements into steps of up to lr: the weights after 4 steps
# differ from one process's by at most 2.3e-5 (2026-12-05, this model and data); with the gradients halved
# (the sp ranks averaged at ZeRO-2) by up to 6.4e-3, and the norms by 2x
SP_WEIGHT_ATOL = 2e-4


def sp_sample() -> dict[str, torch.Tensor]:
    """One sample, repeated: every batch is the same whatever order the sampler takes. Its first labels are
    -100 (a prompt), so the two sp halves count different numbers of tokens."""
    ids = torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[:5] = -100
    return {"input_ids": ids, "labels": labels}


def save_tiny_llama(path: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                 attn_implementation="sdpa")).save_pretrained(path)


def sp_reference(model_dir: str) -> dict:
    """One process on the whole sequence: AdamW (the config's "auto" values: Trainer's defaults), the
    gradient clipped at SP_CLIP, a batch of two copies of `sp_sample`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa")
    batch = {k: v.expand(2, -1) for k, v in sp_sample().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    norms, losses = [], []
    for _ in range(SP_STEPS):
        loss = model(**batch).loss
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), SP_CLIP)))
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return {"norms": norms, "losses": losses, "trained": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _run_sp(stage: int, model_dir: str, out_dir: str) -> dict:
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    ds = hf_ds_config(stage)
    del ds["bf16"]
    pc = ParallelismConfig(sp_backend="deepspeed", sp_size=2, sp_handler=DeepSpeedSequenceParallelConfig(
        sp_seq_length_is_variable=True, sp_attn_implementation="sdpa"))
    args = TrainingArguments(output_dir=out_dir, deepspeed=ds, per_device_train_batch_size=2, max_steps=SP_STEPS,
                             learning_rate=1e-2, lr_scheduler_type="constant", weight_decay=0.0,
                             max_grad_norm=SP_CLIP, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
                             seed=0, disable_tqdm=True, parallelism_config=pc)
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa")
    trainer = Trainer(model=model, args=args, train_dataset=[sp_sample() for _ in range(4 * SP_STEPS)])
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    out = {"norms": [h["grad_norm"] for h in logs], "losses": [h["loss"] for h in logs],
           "global_step": trainer.state.global_step, "engine": type(trainer.model_wrapped).__name__,
           "trained": gathered_state(trainer.model_wrapped.module)}
    unset_hf_deepspeed_config()
    UlyssesSPAttentionHF.unregister_from_transformers()  # accelerate registers it again for the next run
    return out


def _trainer_worker(model_dir: str, out_root: str, modes: tuple[str, ...], resume: str | None,
                    llama_dir: str | None = None):
    """Each mode's Trainer run, one after the other in this job (TrainingArguments resets accelerate's
    state, so one process serves the DDP run and the DeepSpeed ones). The sp modes come last: the
    sequence-parallel groups they build stay for the life of the process."""
    import lightspeed

    lightspeed.register_as_deepspeed()  # the DDP run does not use it: its TrainingArguments has no config
    return {mode: (_run_sp(int(mode[-1]), llama_dir, os.path.join(out_root, mode)) if mode.startswith("sp_")
                   else _run(mode, model_dir, os.path.join(out_root, mode), resume)) for mode in modes}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny_gpt2"))
    return path, save_tiny_gpt2(path)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny_llama"))
    save_tiny_llama(path)
    return path


@pytest.fixture(scope="module")
def runs(tiny, tiny_llama, tmp_path_factory):
    out_root = str(tmp_path_factory.mktemp("trainer"))
    results = run_world(_trainer_worker, 2, tiny[0], out_root, ("ddp", "zero2", "zero3", "sp_zero2", "sp_zero3"),
                        None, tiny_llama, timeout=560)
    return out_root, results


@pytest.mark.parametrize("stage", [2, 3])
def test_trainer_ulysses_sp_matches_one_process(stage, tiny_llama, runs):
    """transformers backpropagates each sp rank's share of the loss (times sp at ZeRO-3 below DeepSpeed
    0.20.2): the engine's sum over sp at ZeRO-2 and average at ZeRO-3 (DeepSpeed 0.19.8's) make the
    gradient one process's on the whole sequence. The clip acts at some steps only, so a gradient off by
    sp changes the weights as well as the norms."""
    _, results = runs
    ref = sp_reference(tiny_llama)
    assert min(ref["norms"]) < SP_CLIP < max(ref["norms"])
    for r in (res[f"sp_zero{stage}"] for res in results):
        assert r["engine"] == "LightspeedEngine" and r["global_step"] == SP_STEPS
        assert r["norms"] == pytest.approx(ref["norms"], rel=1e-5)
        assert r["losses"] == pytest.approx(ref["losses"], rel=1e-5)
        for name, value in ref["trained"].items():
            torch.testing.assert_close(r["trained"][name], value, rtol=1e-5, atol=SP_WEIGHT_ATOL, msg=name)


def test_trainer_zero2_matches_ddp(runs):
    _, results = runs
    ddp, zero2 = results[0]["ddp"], results[0]["zero2"]
    assert ddp["engine"] == "DistributedDataParallel" and zero2["engine"] == "LightspeedEngine"
    assert ddp["global_step"] == zero2["global_step"] == STEPS
    assert zero2["losses"] == results[1]["zero2"]["losses"]
    assert zero2["losses"] == pytest.approx(ddp["losses"], rel=5e-3)


def test_trainer_zero3_load_train_save_resume(tiny, runs):
    from transformers import AutoModelForCausalLM

    model_dir, ref = tiny
    out_root, results = runs
    r0 = results[0]["zero3"]
    total = sum(v.numel() for k, v in ref.items() if k != "lm_head.weight")
    for r in (res["zero3"] for res in results):
        # from_pretrained under zero.Init: the checkpoint's weights (as bf16: the config's dtype) ...
        assert sorted(r["loaded"]) == sorted(k for k in ref if k != "lm_head.weight")
        for k, v in r["loaded"].items():
            assert torch.equal(v, ref[k].bfloat16().float()), k
        # ... and no rank ever held the whole model: one module or unit at a time
        assert r["total"] == total and 0 < r["peak"] < total / 2, (r["peak"], total)
        assert r["param_count"] == total  # Trainer counts with p.ds_numel
        assert r["setup_peak"] < total  # initialize() took Init's shards over one unit (a block) at a time
    assert r0["engine"] == "LightspeedEngine"
    # from_config under ZeRO-3: Llama's own init rule (normal(0, 0.02), norms at 1), the same on both ranks
    llama = r0["llama"]
    assert llama == results[1]["zero3"]["llama"] and llama["partitioned"] and llama["inv_freq"] == torch.float32
    for name, (std, mean) in llama["stats"].items():
        if name.endswith("norm.weight"):
            assert (std, mean) == (0.0, 1.0), name
        else:
            assert std == pytest.approx(0.02, rel=0.25), name
    assert r0["losses"] == results[1]["zero3"]["losses"] and r0["global_step"] == STEPS
    assert r0["losses"] == pytest.approx(results[0]["ddp"]["losses"], rel=5e-3)

    # save_model under ZeRO-3 wrote the full trained weights, which a plain from_pretrained loads
    saved = AutoModelForCausalLM.from_pretrained(os.path.join(out_root, "zero3", "final")).state_dict()
    for k, v in r0["trained"].items():
        assert torch.equal(saved[k].float(), v), k

    # Trainer's checkpoint at step 2 resumes in a fresh job to the same step count and losses
    ckpt = os.path.join(out_root, "zero3", "checkpoint-2")
    assert os.path.isdir(os.path.join(ckpt, "global_step2"))  # the engine's checkpoint inside Trainer's
    resumed = run_world(_trainer_worker, 2, model_dir, os.path.join(out_root, "resumed"), ("zero3",), ckpt,
                        timeout=400)
    assert resumed[0]["zero3"]["global_step"] == STEPS
    # (the log history of steps 1-2 comes back from the checkpoint; steps 3-4 are trained again)
    assert resumed[0]["zero3"]["losses"] == pytest.approx(r0["losses"], rel=1e-6)
