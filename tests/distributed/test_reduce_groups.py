"""Parameters reduced over another group than data parallelism (zero/reduce_groups.py), on real gloo
processes: world 4 as dp4 = edp2 x ep2, a dense layer (reduced over all four ranks) and an expert-like
layer placed `sharded_over=("ep",)` and reduced over the expert-data-parallel group (ranks with the
same ep coordinate, which hold the same expert and see different data). At ZeRO stages 0 to 3, one
clipped SGD step must give each parameter its reference update: the dense gradient averaged over the
world, the expert's over its edp group, and the global norm counting the dense gradient once and each
ep coordinate's expert once. Also DeepSpeed's `deepspeed.utils.groups` functions answering from the
recorded topology (expert, expert-data-parallel, tensor- and data-parallel groups)."""

from __future__ import annotations

import pytest
import torch

from lightspeed.testing.run_world import run_world

pytestmark = [pytest.mark.dist, pytest.mark.timeout(180)]

LR, CLIP = 0.1, 0.5
EXPERT = ("dp_replicate", "edp_shard", "sp")  # an expert's data-parallel dims: without ep


class _Net(torch.nn.Module):
    def __init__(self, ep_rank: int):
        super().__init__()
        torch.manual_seed(0)
        self.dense = torch.nn.Linear(5, 3)
        torch.manual_seed(100 + ep_rank)  # each ep coordinate holds another expert
        self.expert = torch.nn.Linear(5, 4)

    def forward(self, x):
        return (self.dense(x) ** 2).sum() + (self.expert(x) ** 2).sum()


def _placements(model, ep_rank: int):
    from lightspeed.parallel.placement import Placement, PlacementTable

    rows = (4 * ep_rank, 4 * ep_rank + 4)  # the experts stacked along dim 0: this ep rank's rows
    return PlacementTable.for_module(model).placed([
        Placement("expert.weight", (8, 5), ((rows, (0, 5)),), ("ep",), EXPERT),
        Placement("expert.bias", (8,), ((rows,),), ("ep",), EXPERT)])


def _step(stage: int):
    import torch.distributed as dist

    from lightspeed.comm.collectives import Communicator
    from lightspeed.comm.topology import Topology
    from lightspeed.config import load
    from lightspeed.precision.policy import policy_from_config
    from lightspeed.runtime.strategy import select_strategy

    topology = Topology.build(ep=2)
    rank, ep_rank = dist.get_rank(), topology.rank("ep")
    cfg = load({"train_micro_batch_size_per_gpu": 2, "gradient_clipping": CLIP,
                "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}, world_size=4)
    model, reference = _Net(ep_rank), _Net(ep_rank)
    placements = _placements(model, ep_rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    comm = Communicator(topology.grad_reduce_group, topology.size("dp_sp"))
    strategy = select_strategy(cfg, model, optimizer, policy_from_config(cfg), comm, placements=placements,
                               topology=topology)
    strategy.use_placements(placements, topology)
    strategy.broadcast_from_rank0(model)
    x = torch.randn(2, 5, generator=torch.Generator().manual_seed(rank))
    strategy.backward_start(True)
    model(x).backward()
    strategy.backward_end()
    strategy.wait_gradients()
    result = strategy.step(None, CLIP)
    state = {k: v.detach().clone() for k, v in strategy.module_state_dict().items()}

    reference(x).backward()  # this rank's own gradients, gathered to form the reference update
    grads = torch.cat([p.grad.reshape(-1) for p in reference.parameters()])
    every = torch.zeros(4 * grads.numel())
    dist.all_gather_into_tensor(every, grads)
    every = every.view(4, -1)
    n_dense = sum(p.numel() for p in reference.dense.parameters())
    dense = every[:, :n_dense].mean(0)
    experts = [every[[r for r in range(4) if r % 2 == e], n_dense:].mean(0) for e in range(2)]
    norm = torch.sqrt(dense.square().sum() + sum(e.square().sum() for e in experts))
    coef = min(1.0, CLIP / (float(norm) + 1e-6))
    mine = torch.cat([dense, experts[ep_rank]])
    expected, pos = {}, 0
    for name, p in reference.named_parameters():
        expected[name] = p.detach() - LR * coef * mine[pos:pos + p.numel()].view(p.shape)
        pos += p.numel()
    return float(result.grad_norm), float(norm), state, expected


def _deepspeed_groups():
    """deepspeed.utils.groups' argument-less functions answer from the recorded topology."""
    import torch.distributed as dist

    from lightspeed.comm.topology import Topology, record_topology
    from lightspeed.compat.deepspeed.utils import groups

    def ranks(group):
        return dist.get_process_group_ranks(group)

    out = {}
    try:
        record_topology(Topology.build(ep=2))
        out["ep"] = (ranks(groups._get_expert_parallel_group("ep_size_2")),
                     ranks(groups._get_expert_data_parallel_group("ep_size_2")),
                     groups._get_expert_parallel_world_size("ep_size_2"), groups._get_expert_parallel_rank("ep_size_2"),
                     sorted(groups._get_expert_parallel_group_dict()))
        try:
            groups._get_expert_parallel_group("ep_size_4")
        except ValueError as error:
            out["ep_wrong"] = str(error)
        record_topology(Topology.build(tp=2))
        out["tp"] = (ranks(groups.get_tensor_model_parallel_group()), groups.get_tensor_model_parallel_world_size(),
                     groups.get_model_parallel_rank(), ranks(groups._get_data_parallel_group()),
                     groups._get_data_parallel_world_size(), groups.get_tensor_model_parallel_src_rank())
    finally:
        record_topology(None)
    return out


def _world():
    return {stage: _step(stage) for stage in (0, 1, 2, 3)}, _deepspeed_groups()


def test_experts_reduce_over_their_group_at_every_stage():
    for rank, (results, groups) in enumerate(run_world(_world, 4)):
        pair = [rank - rank % 2, rank - rank % 2 + 1]
        assert groups["ep"] == (pair, [rank % 2, rank % 2 + 2], 2, rank % 2, ["ep_size_2"])
        assert "no expert group ep_size_4: the run's expert-parallel size is 2" in groups["ep_wrong"]
        assert groups["tp"] == (pair, 2, rank % 2, [rank % 2, rank % 2 + 2], 2, pair[0])
        for stage, (norm, ref_norm, state, expected) in results.items():
            assert norm == pytest.approx(ref_norm, rel=1e-5), (rank, stage)
            assert ref_norm > CLIP  # the clip acts: the norm steers the update
            for name, value in expected.items():
                torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"rank {rank} stage {stage} {name}: {m}")
