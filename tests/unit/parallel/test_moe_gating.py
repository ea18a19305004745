"""lightspeed's MoE gates and layer against DeepSpeed 0.19.8's own outputs (tests/fixtures/deepspeed_moe,
written by DeepSpeed's `top1gating` / `top2gating` / `topkgating` and `MoE` on the same inputs and the
same seeded random draws): routes, capacity, dropped tokens, l_aux and expert counts bit for bit; the
layer's output, l_aux, counts and gradients within float32 rounding. Also the arguments refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from lightspeed.parallel.experts import MoE, MoEArgumentError, expert_capacity, top1gating, top2gating, topkgating

FIXTURE = torch.load(Path(__file__).parents[2] / "fixtures" / "deepspeed_moe" / "expected.pt", weights_only=False)
HIDDEN = 6


def _gate(kind: str, logits: torch.Tensor, kwargs: dict):
    if kind == "top1":
        return top1gating(logits, **kwargs)
    if kind == "top2":
        return top2gating(logits, **kwargs)
    return topkgating(logits, **kwargs)


@pytest.mark.parametrize("name", sorted(FIXTURE["gating"]))
def test_gating_matches_deepspeed(name):
    case = FIXTURE["gating"][name]
    for form in ("sparse", "dense"):
        if case["seed"] is not None:
            torch.manual_seed(case["seed"])
        routes = _gate(case["kind"], case["logits"].clone(), case["kwargs"])
        if form == "sparse":
            want = case["sparse"]
            assert routes.capacity == want["capacity"] and routes.num_experts == want["num_experts"]
            for key in ("indices", "locations", "gates", "exp_counts"):
                got = getattr(routes, key)
                assert got.dtype == want[key].dtype and torch.equal(got, want[key]), (name, key, got, want[key])
            assert torch.equal(routes.l_aux, want["l_aux"]), (name, routes.l_aux, want["l_aux"])
        else:
            l_aux, combine, dispatch, counts = routes.dense()
            want = case["dense"]
            assert torch.equal(l_aux, want["l_aux"]) and torch.equal(counts, want["exp_counts"])
            assert torch.equal(combine, want["combine_weights"]), name
            assert torch.equal(dispatch, want["dispatch_mask"]), name


def test_fixture_covers_drops_and_randomness():
    """The cases exercise what they are named for: tokens dropped, none dropped, the two drop policies
    differing, and random draws that decide routes (another seed gives other routes, so matching
    DeepSpeed's means drawing as it draws)."""
    g = FIXTURE["gating"]
    assert (g["top1_drop"]["sparse"]["indices"] < 0).any() and (g["top2_drop"]["sparse"]["indices"] < 0).any()
    assert (g["top3_probs"]["sparse"]["indices"] < 0).any()
    assert not (g["top1_nodrop"]["sparse"]["indices"] < 0).any()
    assert not torch.equal(g["top3_probs"]["sparse"]["indices"], g["top3_position"]["sparse"]["indices"])
    for name in ("top1_rts", "top1_rsample", "top2_sampled"):
        torch.manual_seed(1)
        routes = _gate(g[name]["kind"], g[name]["logits"].clone(), g[name]["kwargs"])
        assert not torch.equal(routes.locations, g[name]["sparse"]["locations"]), name


def _expert() -> nn.Module:
    return nn.Sequential(nn.Linear(HIDDEN, 8), nn.GELU(), nn.Linear(8, HIDDEN))


@pytest.mark.parametrize("name", sorted(FIXTURE["layers"]))
def test_moe_layer_matches_deepspeed(name):
    case = FIXTURE["layers"][name]
    layer = MoE(HIDDEN, _expert(), **case["kwargs"])
    assert set(layer.state_dict()) == set(case["state"])  # DeepSpeed's module and parameter names
    layer.load_state_dict(case["state"])
    layer.train(case["train"])
    x = case["x"].clone().requires_grad_(True)
    torch.manual_seed(case["seed"])
    output, l_aux, counts = layer(x)
    (output.square().sum() + l_aux).backward()
    torch.testing.assert_close(output, case["output"], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(l_aux, case["l_aux"], rtol=1e-6, atol=1e-7)
    assert torch.equal(counts, case["exp_counts"])
    torch.testing.assert_close(x.grad, case["x_grad"], rtol=1e-5, atol=1e-6)
    grads = {n: p.grad for n, p in layer.named_parameters() if p.grad is not None}
    assert set(grads) == set(case["grads"])
    for n, g in grads.items():
        torch.testing.assert_close(g, case["grads"][n], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name} {n}: {m}")


def test_expert_parameters_are_marked():
    layer = MoE(HIDDEN, _expert(), num_experts=4, ep_size=2, use_residual=True)
    experts = dict(layer.deepspeed_moe.experts.named_parameters())
    assert len(layer.deepspeed_moe.experts.deepspeed_experts) == 2
    assert all(p.allreduce is False and p.group_name == "ep_size_2" for p in experts.values())
    dense = [p for n, p in layer.named_parameters() if not n.startswith("deepspeed_moe.experts.")]
    assert dense and not any(hasattr(p, "allreduce") for p in dense)  # the gate, residual mlp, coefficient


def test_capacity_rounds_in_float32():
    assert int(expert_capacity(12, 4, 1.0, 4)) == 4 and int(expert_capacity(12, 4, 1.0, 1)) == 3
    assert int(expert_capacity(10, 4, 1.0, 0)) == 3 and int(expert_capacity(8, 4, 0.3, 0)) == 1


def test_refusals():
    with pytest.raises(NotImplementedError, match="use_tutel"):
        MoE(HIDDEN, _expert(), num_experts=2, use_tutel=True)
    with pytest.raises(AssertionError, match="num_experts=3 is not divisible by ep_size=2"):
        MoE(HIDDEN, _expert(), num_experts=3, ep_size=2)
    with pytest.raises(MoEArgumentError, match="noisy_gate_policy"):
        MoE(HIDDEN, _expert(), num_experts=2, noisy_gate_policy="Gaussian")
    with pytest.raises(MoEArgumentError, match="min_capacity=4"):
        top1gating(torch.randn(3, 2), 1.0, 4)
    unbound = MoE(HIDDEN, _expert(), num_experts=2, ep_size=2)
    with pytest.raises(RuntimeError, match="no expert-parallel group is bound"):
        unbound(torch.randn(8, HIDDEN))


def test_deepspeed_sharded_moe_returns_deepspeeds_tuples():
    from lightspeed.compat.deepspeed.moe import sharded_moe

    case = FIXTURE["gating"]["top2_drop"]
    sparse = sharded_moe.top2gating(case["logits"].clone(), sparse_routes=True, **case["kwargs"])
    want = case["sparse"]
    assert int(sparse[1]) == want["capacity"] and sparse[2] == want["num_experts"]
    for got, key in zip(sparse[3:], ("indices", "locations", "gates", "exp_counts")):
        assert torch.equal(got, want[key]), key
    dense = sharded_moe.top2gating(case["logits"].clone(), **case["kwargs"])
    assert torch.equal(dense[1], case["dense"]["combine_weights"]) and torch.equal(dense[2],
                                                                                   case["dense"]["dispatch_mask"])
    gate = sharded_moe.TopKGate(HIDDEN, 4, k=1, min_capacity=1, use_rts=False)
    assert len(gate(torch.randn(8, HIDDEN))) == 4 and len(gate(torch.randn(8, HIDDEN), sparse_routes=True)) == 7
    with pytest.raises(NotImplementedError, match="use_tutel"):
        sharded_moe.top1gating(case["logits"], 1.0, 1, use_tutel=True)


def test_one_expert_parallel_size_per_model():
    from lightspeed.comm.topology import Topology
    from lightspeed.parallel.experts import expert_parallel_size, expert_placements

    model = nn.ModuleDict({"a": MoE(HIDDEN, _expert(), num_experts=2, ep_size=1),
                           "b": MoE(HIDDEN, _expert(), num_experts=2, ep_size=2)})
    with pytest.raises(MoEArgumentError, match="a.deepspeed_moe ep_size=1, b.deepspeed_moe ep_size=2"):
        expert_parallel_size(model)
    assert expert_parallel_size(nn.Linear(2, 2)) == 1
    single = MoE(HIDDEN, _expert(), num_experts=3)
    assert expert_parallel_size(single) == 1
    placements = {p.name: p for p in expert_placements(single, Topology.build())}
    p = placements["deepspeed_moe.experts.deepspeed_experts.2.2.weight"]  # expert 2's second linear [6, 8]
    assert p.global_shape == (18, 8) and p.box == ((12, 18), (0, 8)) and p.sharded_over == ("ep",)
    assert len(placements) == 12  # 3 experts x 2 linear layers x (weight, bias)


@pytest.mark.parametrize("kind", ["top1", "top2", "topk"])
def test_no_drop_capacity_pads_to_a_multiple_of_tp(kind):
    """Beside tensor-parallel dense layers (each tp rank takes capacity / tp slots) `drop_tokens=False`
    pads the agreed capacity up to a multiple of tp, as DeepSpeed's gates do; the routes are unchanged."""
    logits = torch.tensor([[3.0, 0, 0, 0]] * 3 + [[0, 3.0, 0, 0]] * 2 + [[0, 0, 0, 3.0]] * 2)  # loads 3, 2, 0, 2
    kwargs = dict(capacity_factor=1.0, min_capacity=0, drop_tokens=False)
    if kind == "top1":
        kwargs["use_rts"] = False
    elif kind == "top2":
        kwargs["top2_2nd_expert_sampling"] = False
    else:
        kwargs["k"] = 1
    plain = _gate(kind, logits, kwargs)
    padded = _gate(kind, logits, {**kwargs, "tp_size": 2})
    assert padded.capacity % 2 == 0 and padded.capacity == plain.capacity + plain.capacity % 2
    for key in ("indices", "locations", "gates", "exp_counts"):
        assert torch.equal(getattr(padded, key), getattr(plain, key)), key


def test_split_expert_over_tp():
    """`enable_expert_tensor_parallelism=True`: an expert's nn.Linear layers become column-parallel, the
    last row-parallel, with this rank's slices; experts that cannot be sliced so are refused by name."""
    from lightspeed.comm.collectives import Communicator
    from lightspeed.parallel.experts.layer import split_expert
    from lightspeed.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    comm = Communicator(None, 2)  # rank 0 of 2: slicing only, no collective
    expert = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    whole = [p.detach().clone() for p in expert.parameters()]
    split_expert(expert, comm)
    assert isinstance(expert[0], ColumnParallelLinear) and isinstance(expert[2], RowParallelLinear)
    torch.testing.assert_close(expert[0].weight, whole[0][:8], rtol=0, atol=0)
    torch.testing.assert_close(expert[0].bias, whole[1][:8], rtol=0, atol=0)
    torch.testing.assert_close(expert[2].weight, whole[2][:, :8], rtol=0, atol=0)
    torch.testing.assert_close(expert[2].bias, whole[3], rtol=0, atol=0)  # whole: added once after the sum
    with pytest.raises(MoEArgumentError, match=r"nn.Linear layers only.*\['1.weight'"):
        split_expert(nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 8)), comm)
    with pytest.raises(MoEArgumentError, match="at least two"):
        split_expert(nn.Sequential(nn.Linear(8, 8)), comm)
    with pytest.raises(MoEArgumentError, match=r"expert.0 has 15 output features, which do not divide by the "
                                               r"tensor-parallel size 2"):
        split_expert(nn.Sequential(nn.Linear(8, 15), nn.GELU(), nn.Linear(15, 8)), comm)
