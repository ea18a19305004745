"""Mixture-of-experts layers beside tensor parallelism on the dense layers (DeepSpeed's default
`enable_expert_tensor_parallelism=False`), trained through `lightspeed.initialize` on one gloo world
of 4 ranks as tp2 x ep2 (ep carved from the two data-parallel ranks), against one process holding
every expert and no split: each data-parallel rank's losses and the global gradient norm of every step
within 1e-5 (fp32), and the final parameters.

A small model (a dense MLP split by AutoTP's partition_config specs, whose patterns also match the
experts' layers, which must stay whole; a DeepSpeed `MoE` layer of 4 experts; a head) at ZeRO 1 (top-1
with tokens dropped by the capacity), 2 (top-1 without drops: an odd capacity padded to a multiple of
tp; the norm clips) and 3 (top-2, dropped tokens), and a tiny Hugging Face Mixtral through AutoEP with
autotp_size 2 (its attention split, its experts and router whole; 7 tokens per rank, so the tp ranks
take 4 and 3) at ZeRO 2 and 3. The ZeRO-1 run and the ZeRO-2 Mixtral save a tag, which a fresh engine
at another stage resumes (its next step's loss and norm equal the saving engine's) and which
consolidates (`zero_to_fp32`, and `save_16bit_model`'s file) to the one-process model's names and
tensors. Also: the expert placements (sharded over ep, reduced over tp), a dense layer's tp placement,
and the error for a capacity that does not divide by tp.

Experts sliced over tp (`enable_expert_tensor_parallelism=True`: column-parallel fc1, row-parallel fc2)
at ZeRO 1 (top-1, dropped tokens), 2 (top-2, dropped tokens, the norm clips) and 3 (top-1 without drops,
an odd capacity padded), against the same one process: losses, norms, the final parameters (the slices joined), and placements sharded over (ep, tp)
with boxes, reduced over the expert-data-parallel dims only. Its ZeRO-1 tag resumes at ZeRO 2 in the
same mesh, consolidates to the one-process names, and resumes in this process at tp1 x ep1 (the next
step's losses and norm equal the saving ranks'). AutoEP's experts sliced over tp
(`expert_tensor_parallel_size` 2: each tp rank's gate and up rows of 4 of the 8 intermediate units) on
the Mixtral at ZeRO 1, against one process, its tag resumed at ZeRO 2 and consolidated."""

from __future__ import annotations

import copy
import functools
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightspeed.testing.models import distinct_experts
from lightspeed.testing.run_world import run_world

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

D, SEQ, MICRO, STEPS, EXPERTS, DP = 8, 4, 2, 3, 4, 2
LR = 0.02
SPECS = {"layer_specs": [{"patterns": [r".*\.0\.weight$"], "partition_type": "column"},
                         {"patterns": [r".*\.2\.weight$"], "partition_type": "row"}]}
# (name, MoE arguments or "mixtral", ZeRO stage, gradient clipping, optimizer)
CASES = {
    "top1_drop_stage1": (dict(k=1, capacity_factor=1.0), 1, 10.0, "AdamW"),
    "top1_nodrop_stage2_clip": (dict(k=1, capacity_factor=1.0, drop_tokens=False), 2, 0.05, "AdamW"),
    "top2_drop_stage3": (dict(k=2, capacity_factor=1.0), 3, 10.0, "AdamW"),
    # experts sliced over tp (DeepSpeed's enable_expert_tensor_parallelism=True)
    "etp_top1_drop_stage1": (dict(k=1, capacity_factor=1.0, enable_expert_tensor_parallelism=True), 1, 10.0, "AdamW"),
    "etp_top2_drop_stage2_clip": (dict(k=2, capacity_factor=1.0, enable_expert_tensor_parallelism=True), 2, 0.05,
                                  "AdamW"),
    "etp_top1_nodrop_stage3": (dict(k=1, capacity_factor=1.0, drop_tokens=False, enable_expert_tensor_parallelism=True),
                               3, 10.0, "AdamW"),
    # SGD: AdamW would move the parameters whose gradients are rounding noise by about lr (the router's
    # rows of experts no token reached), which changes later steps' norms at 2e-5
    "mixtral_autoep_stage2": ("mixtral", 2, 0.5, "SGD"),
    "mixtral_autoep_stage3": ("mixtral", 3, 0.5, "SGD"),
    # AutoEP's experts sliced over tp (expert_tensor_parallel_size = autotp_size = 2)
    "mixtral_autoep_etp_stage1": ("mixtral_etp", 1, 0.5, "SGD"),
}
EXPERT_PREFIX = "moe.deepspeed_moe.experts.deepspeed_experts."
SAVED = ("top1_drop_stage1", "mixtral_autoep_stage2", "etp_top1_drop_stage1", "mixtral_autoep_etp_stage1")


def _hf(moe) -> bool:
    """Whether the case trains the Hugging Face Mixtral through AutoEP ("mixtral", "mixtral_etp")."""
    return isinstance(moe, str)


class TPMoENet(nn.Module):
    """A dense MLP (split by the specs) -> MoE -> linear head; MSE plus 0.01 x l_aux. Expert g (global
    index) is the template scaled by 1 + 0.1 g, so a misplaced expert shows."""

    def __init__(self, ep_size: int, ep_rank: int, **moe):
        from lightspeed.parallel.experts import MoE

        super().__init__()
        torch.manual_seed(0)
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.Tanh(), nn.Linear(2 * D, D))
        expert = nn.Sequential(nn.Linear(D, 16), nn.GELU(), nn.Linear(16, D))
        self.moe = MoE(D, expert, num_experts=EXPERTS, ep_size=ep_size, min_capacity=0, use_rts=False,
                       top2_2nd_expert_sampling=False, **moe)
        self.head = nn.Linear(D, 1)
        distinct_experts(self.moe, ep_rank)  # experts differ by their global index
        self.dropped, self.loads = 0, []

    def forward(self, x, y):
        from lightspeed.parallel.experts import expert_capacity

        out, l_aux, counts = self.moe(self.mlp(x))
        gate = self.moe.deepspeed_moe.gate
        self.loads.append(int(counts.max()))  # the counts are the loads before the capacity limit
        if gate.drop_tokens:
            capacity = int(expert_capacity(MICRO * SEQ, EXPERTS, gate.capacity_factor * gate.k, gate.min_capacity))
            self.dropped += int(torch.clamp(counts - capacity, min=0).sum())
        return F.mse_loss(self.head(out).squeeze(-1), y) + 0.01 * l_aux


def _mixtral():
    import transformers as tf

    torch.manual_seed(0)
    return tf.MixtralForCausalLM(tf.MixtralConfig(
        vocab_size=32, hidden_size=8, intermediate_size=8, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, num_local_experts=EXPERTS, num_experts_per_tok=2, max_position_embeddings=16,
        initializer_range=0.2))


def _data():
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(STEPS, DP * MICRO, SEQ, D, generator=gen)
    y = torch.randn(STEPS, DP * MICRO, SEQ, generator=gen)
    ids = torch.randint(0, 32, (STEPS, DP, 7), generator=gen)  # Mixtral: one sample of 7 tokens per dp rank
    return x, y, ids


def _shard(moe, s: int, r: int, model):
    x, y, ids = _data()
    if _hf(moe):
        batch = ids[s, r:r + 1]
        return model(input_ids=batch, labels=batch).loss
    return model(x[s, r * MICRO:(r + 1) * MICRO], y[s, r * MICRO:(r + 1) * MICRO])


def _optimizer(params, name: str):
    if name == "SGD":
        return torch.optim.SGD(params, lr=LR)
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.0)


def _optimizer_config(name: str) -> dict:
    return {"type": name, "params": {"lr": LR} if name == "SGD" else {"lr": LR, "weight_decay": 0.0}}


@functools.lru_cache(maxsize=None)
def reference(name: str):
    """One process, every expert, nothing split: per step the mean of the dp ranks' shard losses (each
    shard gated alone, as each rank gates its own tokens), clipped AdamW."""
    moe, _stage, clip, optimizer = CASES[name]
    model = _mixtral() if _hf(moe) else TPMoENet(1, 0, **moe)
    opt = _optimizer(model.parameters(), optimizer)
    losses, norms = [], []
    for s in range(STEPS):
        shard = [_shard(moe, s, r, model) for r in range(DP)]
        torch.stack(shard).mean().backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
        losses.append([float(v.detach()) for v in shard])
    drops = (getattr(model, "dropped", None), getattr(model, "loads", None))
    return losses, norms, {k: v.clone() for k, v in model.state_dict().items()}, drops


def _engine(moe, stage: int, clip: float, optimizer: str):
    import torch.distributed as dist

    import lightspeed

    dp_rank = dist.get_rank() // 2  # tp innermost: ranks 0,1 | 2,3 are the tp groups; ep = the dp coordinate
    config = {"train_micro_batch_size_per_gpu": 1 if _hf(moe) else MICRO, "steps_per_print": 1000,
              "optimizer": _optimizer_config(optimizer), "zero_optimization": {"stage": stage},
              "gradient_clipping": clip,
              "tensor_parallel": {"autotp_size": 2}}
    if _hf(moe):
        model = _mixtral()
        config["expert_parallel"] = {"enabled": True, "autoep_size": 2,
                                     "expert_tensor_parallel_size": 2 if moe == "mixtral_etp" else 1}
    else:
        model = TPMoENet(2, dp_rank, **moe)
        config["tensor_parallel"]["partition_config"] = copy.deepcopy(SPECS)
    engine, *_ = lightspeed.initialize(model=model, config=config)
    return engine


def _step(engine, moe, s: int) -> tuple[float, float]:
    import torch.distributed as dist

    loss = _shard(moe, s, dist.get_rank() // 2, engine)
    engine.backward(loss)
    engine.step()
    return float(loss.detach()), float(engine.get_global_grad_norm())


def _run(moe, stage: int, clip: float, optimizer: str, save_dir: str | None, name: str):
    import torch.distributed as dist

    from lightspeed.comm.collectives import Communicator
    from lightspeed.parallel.experts import MoEArgumentError
    from lightspeed.parallel.tensor_parallel import gather_tp_state, tp_layouts

    dp_rank = dist.get_rank() // 2
    engine = _engine(moe, stage, clip, optimizer)
    topology = engine.groups.topology
    assert (topology.size("tp"), topology.size("ep"), topology.rank("ep")) == (2, 2, dp_rank)
    losses, norms = map(list, zip(*[_step(engine, moe, s) for s in range(STEPS)]))
    expert = ("model.layers.0.mlp.experts.gate_up_proj",) if _hf(moe) else tuple(
        EXPERT_PREFIX + n for n in ("1.0.weight", "1.2.weight", "1.2.bias"))
    dense = "model.layers.0.self_attn.q_proj.weight" if _hf(moe) else "mlp.0.weight"
    out = {"losses": losses, "norms": norms,
           "placements": {n: (p.global_shape, p.boxes, p.sharded_over, p.reduced_over)
                          for n, p in engine.placements.items() if n in expert + (dense,)},
           "fused": {n: p for n, p in engine.placements.items() if _hf(moe) and ".experts." in n}}
    state = {k: v.detach().float().clone() for k, v in engine.strategy.module_state_dict().items()}
    out["state"] = gather_tp_state(state, tp_layouts(engine.module),
                                   Communicator(topology.group("tp"), topology.size("tp")))
    if not _hf(moe) and stage == 1:  # 10 tokens, 4 experts: capacity 3, which two tp ranks cannot halve
        with pytest.raises(MoEArgumentError, match="capacity 3 does not divide by the tensor-parallel size 2"):
            engine.module.moe(torch.randn(10, D))
    if save_dir is not None:  # a tp2 x ep2 tag: a fresh engine (another ZeRO stage) resumes it exactly
        if name == "etp_top1_drop_stage1":  # DeepSpeed's layout of experts sliced over tp is not written
            engine.config.checkpoint.format = "deepspeed"
            with pytest.raises(NotImplementedError, match="experts sliced over tensor parallelism"):
                engine.save_checkpoint(save_dir, tag="refused")
            engine.config.checkpoint.format = "lightspeed"
        engine.save_checkpoint(save_dir, tag=name)
        engine.save_16bit_model(os.path.join(save_dir, f"{name}_16bit"))
        resumed = _engine(moe, 1 if stage == 2 else 2, clip, optimizer)
        resumed.load_checkpoint(save_dir, tag=name)
        out["resumed"] = (_step(engine, moe, 0), _step(resumed, moe, 0))
    return out


def _world(save_dir: str):
    return {name: _run(*CASES[name], save_dir if name in SAVED else None, name) for name in CASES}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    pytest.importorskip("transformers")
    save_dir = str(tmp_path_factory.mktemp("moe_tp"))
    return run_world(_world, 4, save_dir), save_dir


@pytest.mark.parametrize("name", list(CASES))
def test_tp_ep_training_matches_one_process(name, runs):
    runs, save_dir = runs
    moe, stage, clip, optimizer = CASES[name]
    ref_losses, ref_norms, ref_state, (dropped, loads) = reference(name)
    if not _hf(moe) and moe.get("drop_tokens", True):
        assert dropped > 0, "the case must drop tokens"
    elif not _hf(moe):  # the capacity (the largest load over the ep group) is odd in some step: padded to 2
        assert any(max(loads[2 * s:2 * s + 2]) % 2 for s in range(STEPS)), loads
    if clip < 1:
        assert ref_norms[0] > clip, "the clip must act, so the norm steers the step"
    for rank, result in enumerate(runs):
        got, dp_rank, tp_rank = result[name], rank // 2, rank % 2
        assert got["losses"] == pytest.approx([step[dp_rank] for step in ref_losses], rel=1e-5, abs=1e-6), rank
        assert got["norms"] == pytest.approx(ref_norms, rel=1e-5), rank
        if _hf(moe):
            expert, dense = "model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.self_attn.q_proj.weight"
            rows = (2 * dp_rank, 2 * dp_rank + 2)
            if moe == "mixtral_etp":  # the gate and up rows of this tp rank's 4 of the 8 intermediate units
                assert got["placements"][expert] == ((EXPERTS, 16, 8), ((rows, (4 * tp_rank, 4 * tp_rank + 4), (0, 8)),
                                                                        (rows, (8 + 4 * tp_rank, 12 + 4 * tp_rank),
                                                                         (0, 8))),
                                                     ("ep", "tp"), ("dp_replicate", "edp_shard", "sp"))
            else:
                assert got["placements"][expert] == ((EXPERTS, 16, 8), ((rows, (0, 16), (0, 8)),), ("ep",),
                                                     ("dp_replicate", "edp_shard", "sp", "tp"))
            assert got["placements"][dense] == ((8, 8), (((4 * tp_rank, 4 * tp_rank + 4), (0, 8)),), ("tp",),
                                                ("dp_replicate", "edp_shard", "ep", "sp"))
        else:
            g = 2 * dp_rank + 1  # local expert 1's global index
            if moe.get("enable_expert_tensor_parallelism"):  # this tp rank's 8 of the expert's 16 rows
                assert got["placements"][EXPERT_PREFIX + "1.0.weight"] == (
                    (EXPERTS * 16, D), (((16 * g + 8 * tp_rank, 16 * g + 8 * tp_rank + 8), (0, D)),), ("ep", "tp"),
                    ("dp_replicate", "edp_shard", "sp"))
                assert got["placements"][EXPERT_PREFIX + "1.2.weight"] == (
                    (EXPERTS * D, 16), (((D * g, D * g + D), (8 * tp_rank, 8 * tp_rank + 8)),), ("ep", "tp"),
                    ("dp_replicate", "edp_shard", "sp"))
                assert got["placements"][EXPERT_PREFIX + "1.2.bias"] == (
                    (EXPERTS * D,), (((D * g, D * g + D),),), ("ep",), ("dp_replicate", "edp_shard", "sp"))
            else:
                assert got["placements"][EXPERT_PREFIX + "1.0.weight"] == (
                    (EXPERTS * 16, D), (((16 * g, 16 * g + 16), (0, D)),), ("ep",),
                    ("dp_replicate", "edp_shard", "sp", "tp"))
            assert got["placements"]["mlp.0.weight"] == ((2 * D, D), (((D * tp_rank, D * tp_rank + D), (0, D)),),
                                                         ("tp",), ("dp_replicate", "edp_shard", "ep", "sp"))
        for key, value in got["state"].items():
            want_key = key
            if key.startswith(EXPERT_PREFIX):
                local, rest = key[len(EXPERT_PREFIX):].split(".", 1)
                want_key = f"{EXPERT_PREFIX}{2 * dp_rank + int(local)}.{rest}"
            want = ref_state[want_key]
            if _hf(moe) and ".experts." in key:  # this rank's rows (and, sliced over tp, its units)
                want = got["fused"][key].slice_of(want)
            # AdamW moves a parameter by about lr (2e-2) whatever its gradient's size: 1e-4 absolute still
            # catches a wrong gradient, while a gradient of rounding noise may move a weight 1e-5 apart
            atol = 1e-4 if optimizer == "AdamW" else 1e-6
            torch.testing.assert_close(value, want, rtol=1e-5, atol=atol,
                                       msg=lambda m: f"{name} rank {rank} {key}: {m}")


@pytest.mark.parametrize("name", SAVED)
def test_tp_ep_checkpoint_resumes_and_consolidates(name, runs):
    from lightspeed.checkpoint.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    runs, save_dir = runs
    for rank, result in enumerate(runs):
        kept, resumed = result[name]["resumed"]
        assert resumed == pytest.approx(kept, rel=1e-6), rank
    # the tag holds the unsplit model: every expert under its global index, the tp slices joined
    optimizer = CASES[name][3]
    ref_state = reference(name)[2]
    fp32 = get_fp32_state_dict_from_zero_checkpoint(save_dir, tag=name)
    weights = torch.load(os.path.join(save_dir, f"{name}_16bit", "pytorch_model.bin"), weights_only=True)
    assert set(fp32) == set(ref_state) == set(weights)
    for key, value in fp32.items():
        torch.testing.assert_close(weights[key], value, rtol=0, atol=0, msg=lambda m: f"{name} {key}: {m}")
        torch.testing.assert_close(value, ref_state[key], rtol=1e-5, atol=1e-4 if optimizer == "AdamW" else 1e-6,
                                   msg=lambda m: f"{name} {key}: {m}")


def test_expert_tp_tag_resumes_at_tp1_ep1(runs):
    """The tp2 x ep2 tag of experts sliced over tp, loaded by one process (tp1 x ep1, every expert whole):
    its next step (both dp shards' losses, the norm) equals the saving ranks' next step."""
    import lightspeed

    runs, save_dir = runs
    name = "etp_top1_drop_stage1"
    moe, _stage, clip, optimizer = CASES[name]
    config = {"train_micro_batch_size_per_gpu": DP * MICRO, "steps_per_print": 1000,
              "optimizer": _optimizer_config(optimizer), "zero_optimization": {"stage": 2},
              "gradient_clipping": clip}
    engine, *_ = lightspeed.initialize(model=TPMoENet(1, 0, **moe), dist_init_required=False, config=config)
    engine.load_checkpoint(save_dir, tag=name)
    shards = [_shard(moe, 0, r, engine) for r in range(DP)]
    engine.backward(torch.stack(shards).mean())
    engine.step()
    for rank, result in enumerate(runs):
        (loss, norm), _ = result[name]["resumed"]
        assert float(shards[rank // 2].detach()) == pytest.approx(loss, rel=1e-5), rank
        assert float(engine.get_global_grad_norm()) == pytest.approx(norm, rel=1e-5), rank
