"""A DeepSpeed-style MoE model (dense layer, `MoE` layer of 4 experts, dense head) trained through
`lightspeed.initialize` with expert parallelism on real gloo processes, against one process holding
every expert: each rank's losses and final parameters (its experts against the reference's experts
of the same global index) within 1e-5 in float32.

The reference runs the MoE model with ep_size 1 on each rank's share of the global batch separately
(the gate decides capacity and drops per rank's tokens, as DeepSpeed's does) and steps on the mean of
those losses: what data parallelism computes. World 2 (ep2, every expert-data-parallel group a single
rank): ZeRO stages 0-3, top-1 with tokens dropped by the capacity limit and top-2 without drops,
gradient clipping (the global norm counting each expert once), DeepSpeed's MoE optimizer groups
(`split_params_into_different_moe_groups_for_optimizer`), and the expert parameters' placements and
bound group (and deepspeed.utils.groups' expert groups agreeing with it); the experts run batched
(parallel/experts/batched.py) except at ZeRO-3, whose per-expert hooks keep the loop, and run batched
again at ZeRO-3 with the MoE layer a leaf module (gathered whole). World 4 (ep2 x dp2): ZeRO stage 1, and
ZeRO-2 with top-2 and clipping through a Megatron-style mpu (the expert groups cut from its data-parallel
group by DeepSpeed's rule)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightspeed.testing.models import distinct_experts
from lightspeed.testing.run_world import run_world

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

D, SEQ, MICRO, STEPS, EXPERTS = 8, 4, 2, 3, 4
LR = 0.02
# (name, world, MoE arguments, ZeRO stage, gradient clipping, DeepSpeed's MoE optimizer groups, more
# zero_optimization keys)
LEAF = {"leaf_module": {"classes": ["MoE"]}}  # ZeRO-3 gathers the MoE layer whole: its experts run batched
CASES = {
    "top1_drop_stage0": (2, dict(k=1, capacity_factor=1.0), 0, 0.0, False, {}),
    "top1_drop_stage1_groups": (2, dict(k=1, capacity_factor=1.0), 1, 0.0, True, {}),
    "top2_stage2_clip": (2, dict(k=2, capacity_factor=1.0, drop_tokens=False), 2, 0.05, False, {}),
    "top1_drop_stage3": (2, dict(k=1, capacity_factor=1.0), 3, 0.0, False, {}),
    "top1_drop_stage3_leaf": (2, dict(k=1, capacity_factor=1.0), 3, 0.0, False, LEAF),
    "top1_drop_ep2_dp2_stage1": (4, dict(k=1, capacity_factor=1.0), 1, 0.0, False, {}),
    "top2_ep2_dp2_stage2_clip_mpu": (4, dict(k=2, capacity_factor=1.0, drop_tokens=False), 2, 0.05, False, {}),
}
# cases that pass initialize() a Megatron-style mpu (data parallelism over the world, no tp): the expert
# groups then come from the mpu's data-parallel group by DeepSpeed's rule, the same groups as the mesh's
WITH_MPU = {"top2_ep2_dp2_stage2_clip_mpu"}


class MoENet(nn.Module):
    """Linear -> tanh -> MoE -> linear head; MSE plus 0.01 x l_aux. Expert g (global index) is the
    template expert scaled by 1 + 0.1 g, so the experts differ and a misplaced one shows."""

    def __init__(self, ep_size: int, ep_rank: int, **moe):
        from lightspeed.parallel.experts import MoE

        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(D, D)
        expert = nn.Sequential(nn.Linear(D, 16), nn.GELU(), nn.Linear(16, D))
        self.moe = MoE(D, expert, num_experts=EXPERTS, ep_size=ep_size, min_capacity=0, use_rts=False,
                       top2_2nd_expert_sampling=False, **moe)
        self.head = nn.Linear(D, 1)
        distinct_experts(self.moe, ep_rank)  # experts differ by their global index
        self.dropped = 0

    def forward(self, x, y):
        out, l_aux, counts = self.moe(torch.tanh(self.inp(x)))
        if self.moe.deepspeed_moe.gate.k == 1:  # top-1's counts are the loads before the capacity limit
            self.dropped += int(torch.clamp(counts - self._capacity(), min=0).sum())
        return F.mse_loss(self.head(out).squeeze(-1), y) + 0.01 * l_aux

    def _capacity(self) -> int:
        from lightspeed.parallel.experts import expert_capacity

        gate = self.moe.deepspeed_moe.gate
        return int(expert_capacity(MICRO * SEQ, EXPERTS, gate.capacity_factor, gate.min_capacity))


def _data(world: int):
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(STEPS, world * MICRO, SEQ, D, generator=gen)
    y = torch.randn(STEPS, world * MICRO, SEQ, generator=gen)
    return x, y


def reference(world: int, moe: dict, clip: float):
    """One process, every expert: per step the mean of the ranks' shard losses (each shard gated alone)."""
    model = MoENet(1, 0, **moe)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    x, y = _data(world)
    losses = []
    for s in range(STEPS):
        shard = [model(x[s, r * MICRO:(r + 1) * MICRO], y[s, r * MICRO:(r + 1) * MICRO]) for r in range(world)]
        torch.stack(shard).mean().backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append([float(v.detach()) for v in shard])
    return losses, {k: v.clone() for k, v in model.state_dict().items()}, model.dropped


class _WorldMpu:
    """Megatron's data-parallel names over the whole world (a group made for it, not the default one)."""

    def __init__(self):
        import torch.distributed as dist

        self.group = dist.new_group(list(range(dist.get_world_size())))

    def get_data_parallel_group(self):
        return self.group

    def get_data_parallel_rank(self):
        import torch.distributed as dist

        return dist.get_rank()

    def get_data_parallel_world_size(self):
        import torch.distributed as dist

        return dist.get_world_size()


def _run(world_expected: int, moe: dict, stage: int, clip: float, groups: bool, zero: dict, mpu: bool = False):
    import torch.distributed as dist

    import lightspeed
    from lightspeed.compat.deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
    from lightspeed.compat.deepspeed.utils import groups as ds_groups
    from lightspeed.parallel.experts.batched import batched_experts

    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == world_expected
    model = MoENet(2, rank % 2, **moe)
    config = {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 1000,
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
              "zero_optimization": {"stage": stage, **zero}}
    config["gradient_clipping"] = clip or 0.0  # the reference clips only when asked (DeepSpeed's default does)
    params = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()),
                                                                   "name": "dense"}) if groups else None
    engine, *_ = lightspeed.initialize(model=model, model_parameters=params, config=config,
                                       mpu=_WorldMpu() if mpu else None)
    x, y = _data(world)
    losses, batched = [], []
    experts = engine.module.moe.deepspeed_moe.experts  # which path its forward takes, parameters as it sees them
    experts.register_forward_pre_hook(lambda m, inputs: batched.append(
        batched_experts(m.deepspeed_experts, inputs[0]) is not None))
    for s in range(STEPS):
        loss = engine(x[s, rank * MICRO:(rank + 1) * MICRO], y[s, rank * MICRO:(rank + 1) * MICRO])
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    layer = engine.module.moe.deepspeed_moe
    placement = engine.placements["moe.deepspeed_moe.experts.deepspeed_experts.1.0.weight"]
    ranks = dist.get_process_group_ranks
    out = {"losses": losses, "batched": batched, "ep_group": ranks(layer.ep_group),
           "deepspeed_groups": (ranks(ds_groups._get_expert_parallel_group("ep_size_2")),
                                ranks(ds_groups._get_expert_data_parallel_group("ep_size_2")),
                                ds_groups._get_expert_parallel_rank("ep_size_2"),
                                ds_groups._get_expert_data_parallel_world_size("ep_size_2")),
           "placement": (placement.global_shape, placement.boxes, placement.sharded_over, placement.reduced_over),
           "optimizer_groups": [g.get("name") for g in engine.optimizer.param_groups] if groups else None,
           "from_mpu": engine.groups.topology.from_mpu}
    if stage < 3:  # stage 3's module holds released placeholders
        out["state"] = {k: v.clone() for k, v in engine.module.state_dict().items()}
    return out


def _world(names):
    return {name: _run(*CASES[name], mpu=name in WITH_MPU) for name in names}


@pytest.fixture(scope="module")
def runs():
    out = {}
    for world in (2, 4):
        names = [n for n, case in CASES.items() if case[0] == world]
        out[world] = run_world(_world, world, names)
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_expert_parallel_training_matches_one_process(name, runs):
    world, moe, stage, clip, groups, zero = CASES[name]
    ref_losses, ref_state, dropped = reference(world, moe, clip)
    if moe["k"] == 1:
        assert dropped > 0, "the case must drop tokens"
    for rank, result in enumerate(runs[world]):
        got = result[name]
        ep_rank = rank % 2
        assert got["losses"] == pytest.approx([step[rank] for step in ref_losses], rel=1e-5, abs=1e-6), rank
        # ZeRO-3 gathers each expert in its own hooks: the loop; elsewhere the experts run batched
        assert got["batched"] == [not (stage == 3 and not zero)] * STEPS, rank
        assert got["ep_group"] == [rank - ep_rank, rank - ep_rank + 1]
        edp = list(range(ep_rank, world, 2))  # deepspeed.utils.groups answers the same groups
        assert got["deepspeed_groups"] == (got["ep_group"], edp, ep_rank, world // 2)
        g = 2 * ep_rank + 1  # local expert 1's global index
        assert got["placement"] == ((EXPERTS * 16, D), (((16 * g, 16 * g + 16), (0, D)),), ("ep",),
                                    ("dp_replicate", "edp_shard", "sp"))
        if groups:
            assert got["optimizer_groups"] == ["dense", "ep_size_2"]
        assert got["from_mpu"] == (name in WITH_MPU)
        for key, value in got.get("state", {}).items():
            prefix = "moe.deepspeed_moe.experts.deepspeed_experts."
            if key.startswith(prefix):
                local, rest = key[len(prefix):].split(".", 1)
                key = f"{prefix}{2 * ep_rank + int(local)}.{rest}"
            torch.testing.assert_close(value, ref_state[key], rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{name} rank {rank} {key}: {m}")
