"""DeepSpeed-style `MoE` layers inside a `PipelineModule`, trained with `train_batch` on real gloo
processes (one world of 4) against one process running every layer and every expert: the loss each
step returns within 1e-5 in float32, and every rank's final parameters (experts by global index).

The model is four LayerSpecs (linear -> MoE block -> MoE block -> head, or linear -> linear -> MoE
block -> head: a first stage without MoE layers still builds the ep mesh), MSE loss; each MoE block
is `x + MoE(x)`, top-1 (or top-2) gating with tokens dropped by the capacity limit. Inside the
pipeline each MoE layer adds `aux_loss_coeff x l_aux` to its micro-batch's loss through
parallel/experts/aux_loss.py (nothing sent to the last stage); the reference adds the same term to
each micro-batch's loss by hand. Cases: pp2 x ep2 at ZeRO-1 with gradient clipping (the norm over
both kinds of parameter and both stages), the same at coefficient 0 (its trajectory differs, and
matches its own reference), pp2 x ep2 at ZeRO-2 with the MoE on the second pipeline rank only under
the ZBV zero-bubble schedule (two stages a rank, split input and weight backward), pp2 x dp2 (ep 1)
at ZeRO-1 with top-2, and pp2 x ep2 in fp16 at static loss scales 1 and 1024 (the aux loss's
gradient scaled with the micro-batch's loss). The ep and expert-data-parallel groups the layers bind
are the stage's own. Also: a pp2 x ep2 ZeRO-2 checkpoint resumed at pp2 and at pp1 x ep2 x edp2, and
stages whose MoE layers ask for different ep sizes refused. The aux-loss function's scaling itself is
unit-tested in tests/unit/parallel/test_moe_aux_loss.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightspeed.testing.models import distinct_experts
from lightspeed.testing.run_world import run_world

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

D, SEQ, MICRO, GAS, STEPS, EXPERTS, HIDDEN = 8, 4, 2, 2, 3, 4, 16
LR = 0.02
WORLD, PP = 4, 2
# name: (ep size, layout, MoE arguments, aux_loss_coeff, ZeRO stage, gradient clipping, schedule, fp16 loss scale)
CASES = {
    "ep2_z1_clip": (2, "both", dict(k=1), 0.5, 1, 0.3, "1f1b", None),
    "ep2_z1_clip_coeff0": (2, "both", dict(k=1), 0.0, 1, 0.3, "1f1b", None),
    "ep2_z2_late_zbv": (2, "late", dict(k=1), 0.5, 2, 0.0, "zbv_zero_bubble", None),
    "dp2_z1_top2": (1, "both", dict(k=2), 0.5, 1, 0.0, "1f1b", None),
    "ep2_fp16_scale1": (2, "both", dict(k=1), 0.5, 1, 0.0, "1f1b", 1),
    "ep2_fp16_scale1024": (2, "both", dict(k=1), 0.5, 1, 0.0, "1f1b", 1024),
}
FP32 = [name for name, case in CASES.items() if case[7] is None]
PARTS = {"1f1b": [0, 2, 4], "zbv_zero_bubble": [0, 1, 2, 3, 4]}


class Inp(nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.fc = nn.Linear(D, D)

    def forward(self, x):
        return torch.tanh(self.fc(x.to(self.fc.weight.dtype)))  # fp16 cases: the float inputs cast


class Head(nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.fc = nn.Linear(D, 1)

    def forward(self, x):
        return self.fc(x).squeeze(-1).float()


class MoEBlock(nn.Module):
    """x + MoE(x). Global expert g is the template expert scaled by 1 + 0.1 g, so the experts differ and a
    misplaced one shows."""

    def __init__(self, seed: int, ep_size: int, ep_rank: int, coeff, **moe):
        from lightspeed.parallel.experts import MoE

        super().__init__()
        torch.manual_seed(seed)
        expert = nn.Sequential(nn.Linear(D, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, D))
        self.moe = MoE(D, expert, num_experts=EXPERTS, ep_size=ep_size, min_capacity=0, capacity_factor=1.0,
                       use_rts=False, top2_2nd_expert_sampling=False, aux_loss_coeff=coeff, **moe)
        distinct_experts(self.moe, ep_rank)  # experts differ by their global index
        self.dropped = 0

    def forward(self, x):
        out, _l_aux, counts = self.moe(x)
        gate = self.moe.deepspeed_moe.gate
        if gate.k == 1:  # top-1's counts are the loads before the capacity limit
            from lightspeed.parallel.experts import expert_capacity

            cap = int(expert_capacity(MICRO * SEQ, EXPERTS, gate.capacity_factor, gate.min_capacity))
            self.dropped += int(torch.clamp(counts - cap, min=0).sum())
        return x + out


def layer_specs(spec, ep_size: int, ep_rank: int, layout: str, moe: dict, coeff):
    """The four layers as `spec(cls, *args)` (LayerSpec in the pipeline, a build in the reference)."""
    second = spec(MoEBlock, 1, ep_size, ep_rank, coeff, **moe) if layout == "both" else spec(Inp, 1)
    return [spec(Inp, 0), second, spec(MoEBlock, 2, ep_size, ep_rank, coeff, **moe), spec(Head, 3)]


def _data():
    """[step][global micro-batch] -> (x, y); data-parallel rank r reads micro-batches r x GAS ... r x GAS + GAS - 1."""
    gen = torch.Generator().manual_seed(11)
    return [[(torch.randn(MICRO, SEQ, D, generator=gen), torch.randn(MICRO, SEQ, generator=gen))
             for _ in range(WORLD // PP * GAS)] for _ in range(STEPS)]


def reference(name: str):
    """One process, every layer and expert: per step the mean over all micro-batches (each gated alone)
    of MSE + coeff x the MoE layers' l_aux; returns (the MSE means, final state by global name, dropped)."""
    _ep, layout, moe, coeff, _stage, clip, _schedule, _fp16 = CASES[name]
    layers = layer_specs(lambda cls, *a, **k: cls(*a, **k), 1, 0, layout, moe, None)
    params = [p for layer in layers for p in layer.parameters()]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.0)
    moes = [layer for layer in layers if isinstance(layer, MoEBlock)]
    losses = []
    for batch in _data():
        total, mse = 0.0, []
        for x, y in batch:
            for layer in layers:
                x = layer(x)
            task = F.mse_loss(x, y)
            mse.append(float(task.detach()))
            total = total + task + coeff * sum(m.moe.deepspeed_moe.l_aux for m in moes)
        (total / len(batch)).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        opt.zero_grad()
        losses.append(sum(mse) / len(mse))
    state = {f"{i}.{k}": v.clone() for i, layer in enumerate(layers) for k, v in layer.state_dict().items()}
    return losses, state, sum(m.dropped for m in moes)


def _train(name: str):
    import torch.distributed as dist

    import lightspeed
    from lightspeed.parallel.pipeline import LayerSpec, PipelineModule

    ep, layout, moe, coeff, stage, clip, schedule, fp16 = CASES[name]
    rank = dist.get_rank()
    ep_rank = rank % ep  # mesh pp, dp_replicate, edp_shard, ep, sp, tp: ep the innermost of a stage's ranks
    net = PipelineModule(layer_specs(LayerSpec, ep, ep_rank, layout, moe, coeff), num_stages=PP,
                         loss_fn=lambda out, y: F.mse_loss(out, y), partition_method="uniform")
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "steps_per_print": 1000,
              "gradient_clipping": 0.0,  # the reference clips only when asked (DeepSpeed's default does)
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
              "zero_optimization": {"stage": stage},
              "pipeline": {"schedule": schedule, **({"virtual_stages": 2} if schedule != "1f1b" else {})}}
    if clip:
        config["gradient_clipping"] = clip
    if fp16 is not None:
        config["fp16"] = {"enabled": True, "loss_scale": fp16}
    engine, *_ = lightspeed.initialize(model=net, config=config)
    dp_rank = engine.groups.dp_rank
    losses = [float(engine.train_batch(iter(batch[dp_rank * GAS:(dp_rank + 1) * GAS]))) for batch in _data()]
    topology = engine.groups.topology
    ranks = dist.get_process_group_ranks
    out = {"losses": losses, "parts": net.parts, "ep": topology.size("ep"),
           "edp_group": ranks(topology.group("edp_sp")) if topology.size("edp_sp") > 1 else [rank],
           "ep_groups": [ranks(m.moe.deepspeed_moe.ep_group) if m.moe.deepspeed_moe.ep_group is not None else [rank]
                         for m in net.modules() if isinstance(m, MoEBlock)],
           "placements": {n: (p.sharded_over, p.reduced_over) for n, p in engine.placements.items()
                          if "deepspeed_experts.1.0.weight" in n},
           "state": {k: v.detach().clone() for k, v in net.state_dict().items()}}
    return out


def _mixed_ep_sizes() -> str:
    """initialize() of a PipelineModule whose stages' MoE layers ask for different ep sizes: refused on
    every rank (the sizes are agreed over the world before the mesh is built)."""
    import lightspeed
    from lightspeed.parallel.experts import MoEArgumentError
    from lightspeed.parallel.pipeline import LayerSpec, PipelineModule

    specs = [LayerSpec(Inp, 0), LayerSpec(MoEBlock, 1, 2, 0, None), LayerSpec(MoEBlock, 2, 1, 0, None),
             LayerSpec(Head, 3)]
    net = PipelineModule(specs, num_stages=PP, loss_fn=lambda out, y: F.mse_loss(out, y), partition_method="uniform")
    try:
        lightspeed.initialize(model=net, config={"train_micro_batch_size_per_gpu": MICRO,
                                                 "optimizer": {"type": "SGD", "params": {"lr": LR}}})
    except MoEArgumentError as err:
        return str(err)
    return "not refused"


def _resume(path: str):
    """pp2 x ep2 at ZeRO-2: train two steps, save, take the third step; then a new
    pp2 x ep2 engine and a pp1 x ep2 x edp2 one (one stage, data parallel 4, one micro-batch a rank) load
    the tag and take the same third step: the three losses agree (the same weights, the same global
    micro-batches)."""
    import torch.distributed as dist

    import lightspeed
    from lightspeed.parallel.pipeline import LayerSpec, PipelineModule

    rank, data = dist.get_rank(), _data()

    def engine(stages: int, gas: int):
        net = PipelineModule(layer_specs(LayerSpec, 2, rank % 2, "both", dict(k=1), 0.5), num_stages=stages,
                             loss_fn=lambda out, y: F.mse_loss(out, y), partition_method="uniform")
        built, *_ = lightspeed.initialize(model=net, config={
            "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas, "steps_per_print": 1000,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
            "zero_optimization": {"stage": 2}, "gradient_clipping": 0.0})
        return built

    def step(built, batch, gas):
        dp_rank = built.groups.dp_rank
        return float(built.train_batch(iter(batch[dp_rank * gas:(dp_rank + 1) * gas])))

    first = engine(PP, GAS)
    for batch in data[:2]:
        step(first, batch, GAS)
    first.save_checkpoint(path, tag="two")
    out = [step(first, data[2], GAS)]
    for stages, gas in ((PP, GAS), (1, 1)):  # pp1: data parallel 4, so one micro-batch a rank
        again = engine(stages, gas)
        again.load_checkpoint(path, tag="two")
        out.append(step(again, data[2], gas))
    return out


def _world(path: str):
    return {"mixed_ep": _mixed_ep_sizes(), "resume": _resume(path), **{name: _train(name) for name in CASES}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_world(_world, WORLD, str(tmp_path_factory.mktemp("moe_pipeline")))


def _global_name(key: str, ep: int, ep_rank: int) -> str:
    marker = ".experts.deepspeed_experts."
    if marker not in key:
        return key
    head, tail = key.split(marker)
    local, rest = tail.split(".", 1)
    return f"{head}{marker}{ep_rank * (EXPERTS // ep) + int(local)}.{rest}"


@pytest.mark.parametrize("name", FP32)
def test_moe_pipeline_matches_one_process(name, runs):
    ep, layout, _moe, _coeff, _stage, _clip, schedule, _fp16 = CASES[name]
    ref_losses, ref_state, dropped = reference(name)
    assert dropped > 0 or CASES[name][2]["k"] == 2, "the case must drop tokens"
    held = set()
    for rank, result in enumerate(runs):
        got = result[name]
        pp_rank, ep_rank = rank // 2, rank % ep
        assert got["parts"] == PARTS[schedule] and got["ep"] == ep
        assert got["losses"] == pytest.approx(ref_losses, rel=1e-5, abs=1e-6), rank
        stage_ranks = [2 * pp_rank, 2 * pp_rank + 1]  # the data-parallel ranks of this rank's stages
        # the groups the layers bind are the stage's own: ep (ep2) or none (ep1) and expert data parallel
        moe_layers_here = 0 if layout == "late" and pp_rank == 0 else 1  # zbv: pp rank 1 holds layers 1 and 2
        assert got["ep_groups"] == [stage_ranks if ep == 2 else [rank]] * moe_layers_here
        assert got["edp_group"] == ([rank] if ep == 2 else stage_ranks)
        assert len(got["placements"]) == moe_layers_here
        for placed in got["placements"].values():
            assert placed == (("ep", "pp"), ("dp_replicate", "edp_shard", "sp"))
        for key, value in got["state"].items():
            key = _global_name(key, ep, ep_rank)
            held.add(key)
            # parameters: atol 2e-5 of the 0.06 three AdamW steps may move them; Adam's step normalises a
            # near-zero gradient (an expert few tokens reach), so summation-order noise there shows in full
            torch.testing.assert_close(value, ref_state[key], rtol=1e-5, atol=2e-5,
                                       msg=lambda m: f"{name} rank {rank} {key}: {m}")
    assert held == set(ref_state)  # every parameter of the reference is held by some rank


def test_aux_loss_coefficient_changes_the_trajectory(runs):
    with_aux = runs[0]["ep2_z1_clip"]["losses"]
    without = runs[0]["ep2_z1_clip_coeff0"]["losses"]
    assert with_aux[0] == without[0]  # the first loss is before any step
    assert abs(with_aux[-1] - without[-1]) > 1e-4, (with_aux, without)


def test_aux_loss_gradient_follows_the_fp16_loss_scale(runs):
    """fp16 at a static loss scale of 1024 follows scale 1 (the aux loss's gradient is scaled, then
    unscaled, with the micro-batch loss's); an aux term left unscaled would be 1024 times too weak
    there. Both track the fp32 reference within fp16 rounding."""
    unit, scaled = runs[0]["ep2_fp16_scale1"]["losses"], runs[0]["ep2_fp16_scale1024"]["losses"]
    assert scaled == pytest.approx(unit, rel=1e-5, abs=1e-5)
    fp32 = reference("ep2_fp16_scale1")[0]  # the same model and aux coefficient in fp32
    assert scaled == pytest.approx(fp32, abs=2e-2) and scaled != pytest.approx(fp32, abs=1e-6)
    for result in runs:
        assert result["ep2_fp16_scale1024"]["losses"] == scaled


def test_stages_asking_for_different_ep_sizes_are_refused(runs):
    for result in runs:
        assert result["mixed_ep"].startswith("MoE layers with different ep_size over the pipeline stages ([1, 2])")


def test_checkpoint_of_experts_in_stages_resumes_at_pp2_and_pp1(runs):
    for result in runs:
        straight, resumed, one_stage = result["resume"]
        assert resumed == straight
        assert one_stage == pytest.approx(straight, rel=1e-6)
