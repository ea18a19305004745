"""AutoEP on a model built under zero.Init: a tiny Hugging Face Mixtral and Qwen3-MoE checkpoint loaded by
`from_pretrained` at ZeRO-3 (transformers' `is_deepspeed_zero3_enabled()` path through
`HfDeepSpeedConfig`, lightspeed registered as `deepspeed`: the model is built partitioned and the
weights loaded into it), then `lightspeed.initialize` with `expert_parallel` at autoep_size 2 and 1, on
two gloo ranks (float32), against the same checkpoint loaded whole and initialized alike:

- the logits of each rank's tokens and the losses of 3 AdamW steps at ZeRO-3 equal the whole-built
  model's within 1e-5;
- after initialize() each rank's expert parameters are its ep rank's rows only (`ds_shape` [E/ep, ...]),
  its ZeRO-3 shard of them holds exactly those rows' values (at ep 2 the expert-data-parallel group is
  one rank), and the model's experts' zero.Init groups were never gathered during initialize() (each
  rank received its rows by an all-to-all, then partitioned them again: zero/stage3/init_rows.py).

Beside tensor parallelism, on four gloo ranks as tp2 x dp2 (autotp_size 2, autoep_size 2,
expert_tensor_parallel_size 2: the experts sliced over tp), the tiny Mixtral loaded at ZeRO-3 by
`from_pretrained` under zero.Init, against the same checkpoint loaded whole: the logits and 3 AdamW
steps' losses within 1e-5; each rank's experts are its (ep rank, tp rank) slice (`ds_shape`, and its
ZeRO-3 shard's values equal to that slice of the checkpoint's tensors, and to the whole-built run's
shard), the attention's q_proj split by AutoTP holds each tp rank's rows between the ZeRO-3 shards of
that tp rank's ranks, and the experts' zero.Init groups were never gathered. (GPT-OSS's sliced layout,
biases and interleaved gate|up, is checked against the whole-built slicing in
tests/unit/parallel/test_autoep.py: AutoTP's plan of GPT-OSS is refused, whole-built or not, for its
biased experts.)
"""

from __future__ import annotations

import pytest
import torch

from lightspeed.testing.run_world import run_world

pytestmark = [pytest.mark.no_real_deepspeed, pytest.mark.dist, pytest.mark.timeout(300)]

SEQ, MICRO, STEPS, LR, VOCAB = 6, 2, 3, 0.01, 64
COMMON = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, initializer_range=0.2)
RUNS = (("mixtral", 2), ("mixtral", 1), ("qwen3_moe", 2))
TP_RUNS = ("mixtral",)  # at tp2 x dp2, autoep_size 2, experts sliced over tp


def build(name: str):
    import transformers as tf

    torch.manual_seed(0)
    if name == "mixtral":
        return tf.MixtralForCausalLM(tf.MixtralConfig(intermediate_size=24, num_local_experts=4,
                                                      num_experts_per_tok=2, **COMMON)).float()
    return tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(intermediate_size=24, moe_intermediate_size=12, num_experts=8,
                                                    num_experts_per_tok=2, head_dim=4, norm_topk_prob=True,
                                                    **COMMON)).float()


def data(step: int, rank: int):
    gen = torch.Generator().manual_seed(11 + step)
    return torch.randint(0, VOCAB, (2 * MICRO, SEQ), generator=gen)[rank * MICRO:(rank + 1) * MICRO]


def config(ep: int) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 1000,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
            "zero_optimization": {"stage": 3}, "expert_parallel": {"enabled": True, "autoep_size": ep}}


def _run(model_dir: str, ep: int, zero_init: bool, rank: int, tp: int = 1) -> dict:
    import lightspeed
    from lightspeed.parallel.experts.autoep_layer import EPExperts
    from lightspeed.zero.stage3 import param_group
    from lightspeed.zero.stage3.init import StandaloneScheduler
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    cfg = config(ep)
    # from_pretrained builds under zero.Init (its ZeRO-3 loading refuses a tensor_parallel section: the
    # split is initialize()'s)
    hf_config = HfDeepSpeedConfig(dict(cfg)) if zero_init else None
    if tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": tp}
        cfg["expert_parallel"]["expert_tensor_parallel_size"] = tp
    dp_rank = rank // tp
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    unset_hf_deepspeed_config()
    del hf_config
    partitioned = all(p.numel() == 0 for p in model.parameters())
    gathered: list[str] = []  # the zero.Init groups gathered during initialize()
    original = param_group.ParamGroup.gather

    def gather(group):
        if isinstance(group.coordinator, StandaloneScheduler):
            gathered.append(group.name)
        original(group)

    param_group.ParamGroup.gather = gather
    try:
        engine, *_ = lightspeed.initialize(model=model, config=cfg)
    finally:
        param_group.ParamGroup.gather = original
    experts = {}
    for name, m in engine.module.named_modules():
        if isinstance(m, EPExperts):
            for pname, p in m.named_parameters():
                experts[f"{name}.{pname}"] = (tuple(p.ds_shape), p.ds_tensor.detach().clone())
    split = engine.module.get_parameter("model.layers.1.self_attn.q_proj.weight")
    split = (tuple(split.ds_shape), split.ds_tensor.detach().clone())
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
    engine.destroy()
    return {"partitioned": partitioned, "gathered": gathered, "experts": experts, "split": split, "logits": logits,
            "losses": losses}


def _world(model_dirs: dict[str, str]):
    import lightspeed
    import torch.distributed as dist

    lightspeed.register_as_deepspeed()
    rank = dist.get_rank()
    return {(name, ep, zero_init): _run(model_dirs[name], ep, zero_init, rank)
            for name, ep in RUNS for zero_init in (False, True)}


def _tp_world(model_dirs: dict[str, str]):
    import lightspeed
    import torch.distributed as dist

    lightspeed.register_as_deepspeed()
    rank = dist.get_rank()
    return {(name, zero_init): _run(model_dirs[name], 2, zero_init, rank, tp=2)
            for name in TP_RUNS for zero_init in (False, True)}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for name in {name for name, _ in RUNS} | set(TP_RUNS):
        path = str(tmp_path_factory.mktemp(name))
        model = build(name)
        model.save_pretrained(path)
        out[name] = (path, {k: v.detach().clone() for k, v in model.state_dict().items()})
    return out


@pytest.fixture(scope="module")
def runs(checkpoints):
    return run_world(_world, 2, {name: path for name, (path, _) in checkpoints.items()})


@pytest.fixture(scope="module")
def tp_runs(checkpoints):
    return run_world(_tp_world, 4, {name: checkpoints[name][0] for name in TP_RUNS})


@pytest.mark.parametrize("name,ep", RUNS)
def test_zero_init_matches_the_whole_built_model(name, ep, runs):
    for rank, result in enumerate(runs):
        whole, init = result[(name, ep, False)], result[(name, ep, True)]
        assert init["partitioned"] and not whole["partitioned"]
        torch.testing.assert_close(init["logits"], whole["logits"], rtol=1e-5, atol=1e-5)
        assert init["losses"] == pytest.approx(whole["losses"], rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("name,ep", RUNS)
def test_each_rank_holds_only_its_experts(name, ep, runs, checkpoints):
    state = checkpoints[name][1]
    for result in runs:
        init = result[(name, ep, True)]
        # the model's experts were never gathered (each rank received its rows); the EPExperts' Init
        # groups (over the expert-data-parallel ranks) were, as ZeRO-3 took them over
        assert "init:EPExperts" in init["gathered"]
        assert not [g for g in init["gathered"] if g.endswith("Experts") and g != "init:EPExperts"], init["gathered"]
        assert init["experts"] and init["experts"].keys() == result[(name, ep, False)]["experts"].keys()
    for key, full in ((k, v) for k, v in state.items() if k in runs[0][(name, ep, True)]["experts"]):
        local = full.shape[0] // ep
        for ep_rank in range(ep):
            # the ranks of this ep rank (its expert-data-parallel group: one rank at ep 2, both at ep 1)
            # hold, between their ZeRO-3 shards, exactly its rows
            edp = [r for r in range(2) if r % ep == ep_rank]
            shards = [runs[r][(name, ep, True)]["experts"][key] for r in edp]
            assert all(shape == (local,) + tuple(full.shape[1:]) for shape, _ in shards), key
            rows = full[ep_rank * local:(ep_rank + 1) * local].reshape(-1)
            torch.testing.assert_close(torch.cat([shard for _, shard in shards]), rows, rtol=0, atol=0)


def _tp_slice(key: str, full: torch.Tensor, ep_rank: int, tp_rank: int) -> torch.Tensor:
    """This (ep rank, tp rank)'s slice of a Mixtral experts tensor of the checkpoint: of gate_up_proj
    [E, 2I, H] its gate rows and its up rows of this tp rank's half of the I units, of down_proj
    [E, H, I] those columns; the ep rank's half of the experts."""
    local = full.shape[0] // 2
    rows = full[ep_rank * local:(ep_rank + 1) * local]
    if key.endswith("down_proj"):
        n = rows.shape[2] // 2
        return rows.narrow(2, tp_rank * n, n)
    units = rows.shape[1] // 2
    n = units // 2
    return torch.cat([rows.narrow(1, tp_rank * n, n), rows.narrow(1, units + tp_rank * n, n)], dim=1)


@pytest.mark.parametrize("name", TP_RUNS)
def test_experts_sliced_over_tp_match_the_whole_built_model(name, tp_runs, checkpoints):
    state = checkpoints[name][1]
    q = state["model.layers.1.self_attn.q_proj.weight"]
    for rank, result in enumerate(tp_runs):
        whole, init = result[(name, False)], result[(name, True)]
        assert init["partitioned"] and not whole["partitioned"]
        torch.testing.assert_close(init["logits"], whole["logits"], rtol=1e-5, atol=1e-5)
        assert init["losses"] == pytest.approx(whole["losses"], rel=1e-5, abs=1e-6)
        # the experts' and the split layers' zero.Init groups were never gathered: each rank received its slices
        assert not [g for g in init["gathered"] if g.endswith("Experts") and g != "init:EPExperts"], init["gathered"]
        assert "init:ColumnParallelLinear" in init["gathered"] and "init:RowParallelLinear" in init["gathered"]
        ep_rank, tp_rank = rank // 2, rank % 2  # tp innermost; ep is the dp coordinate (one rank per ep rank)
        assert init["experts"].keys() == whole["experts"].keys() and len(init["experts"]) == 4  # 2 blocks
        for key, (shape, shard) in init["experts"].items():
            expected = _tp_slice(key, state[key], ep_rank, tp_rank)
            assert shape == tuple(expected.shape) == whole["experts"][key][0], key
            torch.testing.assert_close(shard, expected.reshape(-1), rtol=0, atol=0)
            torch.testing.assert_close(shard, whole["experts"][key][1], rtol=0, atol=0)
        assert init["split"][0] == whole["split"][0] == (q.shape[0] // 2, q.shape[1])
        torch.testing.assert_close(init["split"][1], whole["split"][1], rtol=0, atol=0)
    # the column-parallel q_proj: each tp rank's rows, ZeRO-3 sharded over the two ranks of that tp rank
    rows = q.shape[0] // 2
    for tp_rank in range(2):
        shards = [tp_runs[r][(name, True)]["split"][1] for r in (tp_rank, tp_rank + 2)]
        torch.testing.assert_close(torch.cat(shards), q[tp_rank * rows:(tp_rank + 1) * rows].reshape(-1), rtol=0,
                                   atol=0)
