"""AutoTP on a model built under zero.Init: a tiny Hugging Face Llama checkpoint loaded by `from_pretrained`
at ZeRO-3 (transformers' `HfDeepSpeedConfig` path, lightspeed registered as `deepspeed`: the model is built
partitioned and the weights loaded into it), then `lightspeed.initialize` with `tensor_parallel.autotp_size`,
against the same checkpoint loaded whole with the same config, in one world of 4 gloo ranks (fp32): tp 2 x
dp 2 and tp 4 (dp 1: each split layer kept by one rank); and a tiny Mixtral at tp 2 x ep 2 (AutoEP's
experts, kept whole by AutoTP, take their rows through zero/stage3/init_rows.py beside the split layers).

- after initialize() every rank's ZeRO-3 partition of every parameter (ds_shape, its shard's values) and
  every placement equal the whole-built model's exactly;
- the logits and the losses of 3 AdamW steps (with clipping) equal the whole-built model's within 1e-5,
  and so does the consolidated 16-bit state dict after them;
- each split layer's zero.Init storage is partitioned again over the ranks holding the same slices (the
  data-parallel ones), as zero/stage3/init_tp.py says, and no two layers are whole on a rank at once;
- transformers' Trainer order (`deepspeed.tp_model_init` on the zero.Init model, then initialize) trains
  the same, called directly and by a real `Trainer` (ZeRO-3, bf16, its "auto" config) against its run
  on the model loaded whole.
"""

from __future__ import annotations

import pytest
import torch

from lightspeed.testing.run_world import run_world

transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.no_real_deepspeed, pytest.mark.dist, pytest.mark.timeout(300)]

SEQ, MICRO, STEPS, LR, VOCAB = 6, 2, 3, 0.01, 64
WORLD = 4
# (model, tp, how): tp 2 x dp 2 (the split layers partitioned again over 2 ranks) and tp 4 (over one rank each)
RUNS = (("llama", 2, "whole"), ("llama", 2, "zero_init"), ("llama", 2, "tp_model_init"), ("llama", 4, "whole"),
        ("llama", 4, "zero_init"), ("mixtral", 2, "whole"), ("mixtral", 2, "zero_init"))
COMMON = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
              max_position_embeddings=64, initializer_range=0.2)


def build(name: str):
    torch.manual_seed(0)
    if name == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(intermediate_size=32, **COMMON)).float()
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(intermediate_size=24, num_local_experts=4,
                                                                      num_experts_per_tok=2, **COMMON)).float()


def data(step: int, dp_rank: int):
    gen = torch.Generator().manual_seed(11 + step)
    return torch.randint(0, VOCAB, (2 * MICRO, SEQ), generator=gen)[dp_rank * MICRO:(dp_rank + 1) * MICRO]


def config(name: str, tp: int) -> dict:
    experts = {"expert_parallel": {"enabled": True, "autoep_size": 2}} if name == "mixtral" else {}
    return {**experts, "train_micro_batch_size_per_gpu": MICRO, "train_batch_size": MICRO * WORLD,  # DeepSpeed counts the tp ranks
            "steps_per_print": 1000,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}}, "gradient_clipping": 0.5,
            "zero_optimization": {"stage": 3}, "tensor_parallel": {"autotp_size": tp}}


def _run(model_dir: str, name: str, tp: int, how: str) -> dict:
    import lightspeed
    from lightspeed.zero.stage3 import param_group
    from lightspeed.zero.stage3.init import StandaloneScheduler
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    cfg = config(name, tp)
    # from_pretrained builds under zero.Init; transformers (5.2x) refuses to load at ZeRO-3 while the
    # registered config has a tensor_parallel section, so the load sees the config without it
    load_cfg = {k: v for k, v in cfg.items() if k != "tensor_parallel"}
    hf_config = HfDeepSpeedConfig(load_cfg) if how != "whole" else None
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    unset_hf_deepspeed_config()
    del hf_config
    partitioned = all(p.numel() == 0 for p in model.parameters())
    gathered: list[tuple[str, int]] = []  # the zero.Init groups gathered before training, and their sizes
    seen: list = []
    most_whole = 0  # the most planned layers' (nn.Linear's) Init groups gathered at once
    original = param_group.ParamGroup.gather

    def gather(g):
        nonlocal most_whole
        if isinstance(g.coordinator, StandaloneScheduler):
            gathered.append((g.name, g.comm.world_size))
            seen.append(g)
            most_whole = max(most_whole, sum(h.name == "init:Linear" and (h is g or h.state != param_group.RELEASED)
                                             for h in dict.fromkeys(seen)))
        original(g)

    param_group.ParamGroup.gather = gather
    try:
        if how == "tp_model_init":  # transformers' Trainer: split first, then its optimizer's parameters
            import deepspeed

            model = deepspeed.tp_model_init(model=model, tp_size=tp, dtype=torch.float32, config=cfg)
        engine, *_ = lightspeed.initialize(model=model, config=cfg,
                                           model_parameters=[p for p in model.parameters() if p.requires_grad])
    finally:
        param_group.ParamGroup.gather = original
    shards = {n: (tuple(p.ds_shape), p.ds_tensor.detach().clone()) for n, p in engine.module.named_parameters()}
    placements = {n: p.as_record() for n, p in engine.placements.items()}
    dp_rank = engine.groups.dp_rank
    engine.eval()
    with torch.no_grad():
        logits = engine(input_ids=data(0, dp_rank)).logits
    engine.train()
    losses = []
    for s in range(STEPS):
        ids = data(s, dp_rank)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    state = engine._zero3_consolidated_16bit_state_dict()
    engine.destroy()
    return {"partitioned": partitioned, "gathered": gathered, "most_whole": most_whole, "shards": shards,
            "placements": placements, "logits": logits, "losses": losses, "state": state}


def _trainer(model_dir: str, out_dir: str, zero_init: bool) -> dict:
    """transformers' Trainer at ZeRO-3 with autotp_size 2 (bf16, its "auto" config); under zero.Init the
    model is loaded first with the config less its tensor_parallel section (see `_run`), and the Trainer
    splits it through `deepspeed.tp_model_init` before `deepspeed.initialize`."""
    from transformers import AutoModelForCausalLM, Trainer
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    from tests.distributed.test_hf_trainer import dataset, hf_ds_config, training_args

    ds = hf_ds_config(3)
    # "train_batch_size": "auto" stays: transformers fills it as micro x accumulation x world, as DeepSpeed counts it
    hf_config = HfDeepSpeedConfig(dict(ds, bf16={"enabled": True}, train_micro_batch_size_per_gpu=2,
                                       gradient_accumulation_steps=2)) if zero_init else None
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    unset_hf_deepspeed_config()
    del hf_config
    partitioned = all(p.numel() == 0 for p in model.parameters())
    trainer = Trainer(model=model, args=training_args(out_dir, dict(ds, tensor_parallel={"autotp_size": 2}),
                                                      save=False), train_dataset=dataset())
    trainer.train()
    unset_hf_deepspeed_config()
    return {"partitioned": partitioned, "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h]}


def _world(model_dirs: dict[str, str], out_dir: str):
    import lightspeed

    lightspeed.register_as_deepspeed()
    out = {run: _run(model_dirs[run[0]], *run) for run in RUNS}
    out["trainer"] = {zero_init: _trainer(model_dirs["llama"], f"{out_dir}/{zero_init}", zero_init)
                      for zero_init in (False, True)}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    paths = {}
    for name in dict.fromkeys(name for name, _, _ in RUNS):
        paths[name] = str(tmp_path_factory.mktemp(name))
        build(name).save_pretrained(paths[name])
    return run_world(_world, WORLD, paths, str(tmp_path_factory.mktemp("trainer")))


@pytest.mark.parametrize("run", [run for run in RUNS if run[2] != "whole"])
def test_zero_init_matches_the_whole_built_model(run, runs):
    for rank, result in enumerate(runs):
        whole, init = result[run[:2] + ("whole",)], result[run]
        assert init["partitioned"] and not whole["partitioned"]
        assert init["placements"] == whole["placements"]
        assert init["shards"].keys() == whole["shards"].keys()
        for name, (shape, shard) in whole["shards"].items():
            assert init["shards"][name][0] == shape, name
            torch.testing.assert_close(init["shards"][name][1], shard, rtol=0, atol=0, msg=name)
        torch.testing.assert_close(init["logits"], whole["logits"], rtol=1e-5, atol=1e-5)
        assert init["losses"] == pytest.approx(whole["losses"], rel=1e-5, abs=1e-6)
        if rank == 0:
            assert init["state"].keys() == whole["state"].keys()
            for key, value in whole["state"].items():
                torch.testing.assert_close(init["state"][key], value, rtol=1e-5, atol=1e-6, msg=key)
        else:
            assert init["state"] is None


@pytest.mark.parametrize("run", [run for run in RUNS if run[2] != "whole"])
def test_split_layers_are_partitioned_again_over_their_data_parallel_ranks(run, runs):
    tp = run[1]
    for result in runs:
        sizes = dict(result[run]["gathered"])
        # the split layers' Init groups (over the ranks holding this tp rank's slices), gathered as ZeRO-3
        # took them over; the planned layers' own and the rest's, over the world, as they were split and
        # taken over
        assert sizes["init:ColumnParallelLinear"] == WORLD // tp and sizes["init:RowParallelLinear"] == WORLD // tp
        assert sizes["init:Linear"] == WORLD and sizes["init:Embedding"] == WORLD, sizes
        assert result[run]["most_whole"] == 1  # one layer whole at a time


def test_the_trainer_trains_a_zero_init_model_as_a_whole_one(runs):
    for result in runs:
        whole, init = result["trainer"][False], result["trainer"][True]
        assert init["partitioned"] and not whole["partitioned"] and len(whole["losses"]) == 4
        assert init["losses"] == pytest.approx(whole["losses"], rel=1e-5)
