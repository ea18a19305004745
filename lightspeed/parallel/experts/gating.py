"""DeepSpeed's mixture-of-experts gates: which experts each token goes to, at which slot of the expert's
capacity buffer, with which weight, and the load-balancing loss.

Owns: the capacity rule (`expert_capacity`), the gate noise (`multiplicative_jitter`, `gumbel_noise`),
`top1gating`, `top2gating` and `topkgating` (each returning `Routes`, or DeepSpeed's dense
`(l_aux, combine_weights, dispatch_mask, exp_counts)` through `dense_routes`), and `TopKGate`, the
module holding the gate's linear layer. Must not: move tokens (layer.py dispatches them), or
communicate beyond the capacity agreement of `drop_tokens=False` (an all-reduce MAX over the
expert-parallel group the caller gives; None there means no expert parallelism, never the world).

Note: [exact numerics] Every decision is DeepSpeed 0.19.8's, computed with the same tensor operations
in the same order, so the same logits (and the same random generator state) give bit-identical routes,
gates, l_aux and counts; tests/fixtures/deepspeed_moe holds DeepSpeed's own outputs. The capacity is
computed in float32 (`ceil(tokens / experts * capacity_factor)`, floored at `min_capacity`) as DeepSpeed
computes it, not in Python floats, so a product at a float32 rounding edge rounds the same way.

Note: [random draws] noise comes from the default torch generator, drawn in DeepSpeed's order and
through the same torch.distributions samplers: 'RSample' draws Gumbel noise over the logits before
anything else, random token selection (`use_rts`) one uniform per (token, expert) after the l_aux,
top-2's second-expert sampling Gumbel noise after the first choice, and 'Jitter' a uniform factor in
[1 - 1e-2, 1 + 1e-2] per input element before the gate's linear layer (training only).

Note: [routes] `Routes.indices`, `.locations` and `.gates` are [k, tokens]: route j of token s goes to
expert `indices[j, s]` at slot `locations[j, s]` of its capacity buffer, weighted `gates[j, s]`; a route
dropped by the capacity limit has index -1. Top-1's gate is the softmax probability itself; top-2 and
top-k renormalise the kept routes' probabilities to sum to one (a token that lost all its routes keeps
weight 0 everywhere).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lightspeed.comm import api
from lightspeed.parallel.experts.errors import MoEArgumentError

NOISY_GATE_POLICIES = (None, "None", "Jitter", "RSample")
DROP_POLICIES = ("probs", "position")


@dataclass
class Routes:
    """A gate's decisions for one batch of tokens (the Note on routes)."""

    l_aux: torch.Tensor
    capacity: int
    num_experts: int
    indices: torch.Tensor  # [k, s] int32, -1 where dropped
    locations: torch.Tensor  # [k, s] int32
    gates: torch.Tensor  # [k, s] float32
    exp_counts: torch.Tensor  # [e]: tokens routed to each expert before the capacity limit

    @property
    def k(self) -> int:
        return self.indices.shape[0]

    def dense(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """DeepSpeed's dense form: (l_aux, combine_weights [s, e, c], dispatch_mask [s, e, c], exp_counts)."""
        s = self.indices.shape[1]
        combine = self.gates.new_zeros(s, self.num_experts, self.capacity)
        kept = self.indices >= 0
        tokens = torch.arange(s, device=self.indices.device).expand_as(self.indices)
        combine = combine.index_put((tokens[kept], self.indices[kept].long(), self.locations[kept].long()),
                                    self.gates[kept])
        return self.l_aux, combine, combine.bool(), self.exp_counts


def multiplicative_jitter(x: torch.Tensor, epsilon: float = 1e-2) -> torch.Tensor:
    """`x` times a uniform factor in [1 - epsilon, 1 + epsilon] per element (the 'Jitter' policy)."""
    if epsilon == 0:
        return x
    low = torch.tensor(1.0 - epsilon, device=x.device)
    high = torch.tensor(1.0 + epsilon, device=x.device)
    return x * torch.distributions.uniform.Uniform(low=low, high=high).rsample(x.shape)


def gumbel_noise(shape, device: torch.device) -> torch.Tensor:
    """Standard Gumbel samples of `shape`."""
    zero, one = torch.tensor(0.0, device=device), torch.tensor(1.0, device=device)
    return torch.distributions.gumbel.Gumbel(zero, one).rsample(shape)


def _uniform(shape, device: torch.device) -> torch.Tensor:
    low, high = torch.tensor(0.0, device=device), torch.tensor(1.0, device=device)
    return torch.distributions.uniform.Uniform(low=low, high=high).rsample(shape)


def expert_capacity(num_tokens: int, num_experts: int, capacity_factor: float, min_capacity: int) -> torch.Tensor:
    """Slots per expert: ceil(tokens / experts x capacity_factor) in float32, at least `min_capacity`
    (a 0-dim int64 tensor; the Note on exact numerics)."""
    capacity = torch.ceil((num_tokens / num_experts) * torch.tensor(capacity_factor)).to(torch.int64)
    return torch.maximum(capacity, torch.tensor(min_capacity).to(torch.int64))


def _agreed_capacity(exp_counts: torch.Tensor, ep_group, tp_size: int = 1) -> torch.Tensor:
    """`drop_tokens=False`: the largest expert load, the maximum over the expert-parallel group (so the
    all-to-all buffers agree), rounded up to a multiple of the dense layers' tensor-parallel size (each
    tp rank takes capacity / tp slots: layer.py's Note on tensor parallelism)."""
    capacity = torch.max(exp_counts).to(exp_counts.device)
    if ep_group is not None and api.is_initialized() and api.get_world_size(ep_group) > 1:
        api.all_reduce(capacity, op=api.ReduceOp.MAX, group=ep_group)
    if tp_size > 1:
        capacity = torch.ceil(capacity / tp_size).mul(tp_size).to(capacity.dtype)
    return capacity


def _routes(indices, locations, gates) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[s, k] per-route tensors as the [k, s] blocks `Routes` holds."""
    return (indices.t().contiguous().to(torch.int32), locations.t().contiguous().to(torch.int32),
            gates.t().contiguous())


def top1gating(logits: torch.Tensor, capacity_factor: float, min_capacity: int, used_token: torch.Tensor = None,
               noisy_gate_policy: str | None = None, drop_tokens: bool = True, use_rts: bool = True,
               ep_group=None, *, tp_size: int = 1) -> Routes:
    """Each token to its most probable expert (with 'RSample', the argmax of the Gumbel-noised logits),
    the experts' overflow dropped: with `use_rts` a random choice of the tokens kept, else the first by
    `torch.topk` order; l_aux = E x sum_e(mean gate_e x fraction routed to e)."""
    if noisy_gate_policy == "RSample":
        noisy = logits + gumbel_noise(logits.shape, device=logits.device)
    gates = F.softmax(logits, dim=1)
    num_tokens, num_experts = logits.shape[0], int(gates.shape[1])
    capacity = expert_capacity(num_tokens, num_experts, capacity_factor, min_capacity)
    indices = torch.argmax(noisy if noisy_gate_policy == "RSample" else gates, dim=1)
    mask = F.one_hot(indices, num_classes=num_experts)
    if used_token is not None:
        mask = torch.einsum("s,se->se", used_token, mask)
    exp_counts = torch.sum(mask, dim=0).detach().to(logits.device)
    if not drop_tokens:
        capacity = torch.minimum(_agreed_capacity(exp_counts, ep_group, tp_size),
                                 torch.tensor(num_tokens).to(logits.device))
    l_aux = torch.sum(torch.mean(gates, dim=0) * torch.mean(mask.float(), dim=0)) * num_experts
    ranked = mask * _uniform(mask.shape, logits.device) if use_rts else mask
    if num_tokens < min_capacity:
        raise MoEArgumentError(f"top-1 gating: {num_tokens} tokens, fewer than min_capacity={min_capacity} (lower "
                               "min_capacity or raise the batch size)")
    selection = min(int(capacity), num_tokens)
    kept_rows = torch.topk(ranked, k=selection, dim=0)[1]
    mask = mask * torch.zeros_like(mask).scatter_(0, kept_rows, 1)
    indices = torch.min(indices, mask.sum(dim=1) * num_experts - 1)  # -1 where the token was dropped
    locations = torch.sum((torch.cumsum(mask, dim=0) - 1) * mask, dim=1)
    gate = (gates * mask).sum(dim=1)
    return Routes(l_aux, int(capacity), num_experts, *_routes(indices.unsqueeze(1), locations.unsqueeze(1),
                                                               gate.unsqueeze(1)), exp_counts)


def top2gating(logits: torch.Tensor, capacity_factor: float, min_capacity: int, drop_tokens: bool = True,
               ep_group=None, top2_2nd_expert_sampling: bool = True, *, tp_size: int = 1) -> Routes:
    """Each token to its two most probable experts (the second drawn with Gumbel noise when
    `top2_2nd_expert_sampling`), the capacity 2 x capacity_factor per expert with first choices placed
    before second ones; the two gates renormalised to sum to one; l_aux = E^2 x mean_e(mean gate_e x
    fraction whose first choice is e)."""
    gates = F.softmax(logits, dim=1)
    num_experts = int(gates.shape[1])
    indices1 = torch.argmax(gates, dim=1)
    mask1 = F.one_hot(indices1, num_classes=num_experts)
    if top2_2nd_expert_sampling:
        logits = logits + gumbel_noise(logits.shape, device=logits.device)
    indices2 = torch.argmax(logits.masked_fill(mask1.bool(), float("-inf")), dim=1)
    mask2 = F.one_hot(indices2, num_classes=num_experts)
    locations1 = torch.cumsum(mask1, dim=0) - 1
    locations2 = torch.cumsum(mask2, dim=0) - 1 + torch.sum(mask1, dim=0, keepdim=True)
    l_aux = torch.mean(torch.mean(gates, dim=0) * torch.mean(mask1.float(), dim=0)) * num_experts * num_experts
    exp_counts = torch.sum(mask1 + mask2, dim=0).detach().to(logits.device)
    if drop_tokens:
        capacity = expert_capacity(logits.shape[0], num_experts, capacity_factor * 2, min_capacity)
        mask1 = mask1 * torch.lt(locations1, capacity)
        mask2 = mask2 * torch.lt(locations2, capacity)
    else:
        capacity = _agreed_capacity(exp_counts, ep_group, tp_size)
    locations1_s = torch.sum(locations1 * mask1, dim=1)
    locations2_s = torch.sum(locations2 * mask2, dim=1)
    gates1 = torch.einsum("se,se->s", gates, mask1.float())
    gates2 = torch.einsum("se,se->s", gates, mask2.float())
    denom = torch.clamp(gates1 + gates2, min=torch.finfo(gates1.dtype).eps)
    gates1, gates2 = gates1 / denom, gates2 / denom
    indices1 = torch.where(mask1.any(dim=1), indices1, torch.full_like(indices1, -1))
    indices2 = torch.where(mask2.any(dim=1), indices2, torch.full_like(indices2, -1))
    return Routes(l_aux, int(capacity), num_experts, *_routes(torch.stack([indices1, indices2], 1),
                                                               torch.stack([locations1_s, locations2_s], 1),
                                                               torch.stack([gates1, gates2], 1)), exp_counts)


def topkgating(logits: torch.Tensor, k: int, capacity_factor: float, min_capacity: int, drop_tokens: bool = True,
               ep_group=None, drop_policy: str = "probs", *, tp_size: int = 1) -> Routes:
    """Each token to its k most probable experts, the capacity k x capacity_factor per expert; with
    `drop_policy` "probs" an expert keeps its most probable routes, with "position" its first ones; the
    kept gates renormalised to sum to one; l_aux = E^2 / k x mean_e(mean gate_e x fraction routed to e)."""
    if drop_policy not in DROP_POLICIES:
        raise MoEArgumentError(f"topkgating: drop_policy must be one of {DROP_POLICIES} (got {drop_policy!r})")
    gates = F.softmax(logits, dim=1)
    num_experts = int(gates.shape[1])
    top_gate, top_idx = torch.topk(gates, k=k, dim=1)
    mask = torch.zeros_like(gates, dtype=torch.bool).scatter_(1, top_idx, 1)
    exp_counts = torch.sum(mask, dim=0).detach().to(logits.device)
    l_aux = torch.mean(torch.mean(gates, dim=0) * torch.mean(mask.float(), dim=0)) * num_experts * num_experts / k
    if drop_tokens:
        capacity = expert_capacity(logits.shape[0], num_experts, capacity_factor * k, min_capacity)
        if drop_policy == "probs":
            ranked = torch.zeros_like(gates).scatter(1, top_idx, top_gate)
            selection = min(int(capacity), gates.size(0))
            _, kept_rows = torch.topk(ranked, k=selection, dim=0, sorted=False)
            mask = mask & torch.zeros_like(gates, dtype=torch.bool).scatter_(0, kept_rows, True)
            locations = torch.cumsum(mask, dim=0) - 1
        else:
            locations = torch.cumsum(mask, dim=0) - 1
            mask = mask * torch.lt(locations, capacity)
    else:
        capacity = _agreed_capacity(exp_counts, ep_group, tp_size)
        locations = torch.cumsum(mask, dim=0) - 1
    masked = gates * mask
    masked = masked / torch.clamp(torch.sum(masked, dim=-1, keepdim=True), min=torch.finfo(masked.dtype).eps)
    kept = mask.gather(1, top_idx)
    indices = torch.where(kept, top_idx, torch.full_like(top_idx, -1))
    return Routes(l_aux, int(capacity), num_experts,
                  *_routes(indices, locations.gather(1, top_idx) * kept, masked.gather(1, top_idx)), exp_counts)


class TopKGate(nn.Module):
    """The gate: a bias-free linear layer `wg` [hidden -> experts] in float32, then top-1, top-2 or top-k
    gating (`k`); `capacity_factor` in training, `eval_capacity_factor` in eval mode, where the noise
    policy is off. `routes(input [tokens, hidden], used_token=None)` -> Routes (also its forward; the
    deepspeed.moe.sharded_moe class returns DeepSpeed's tuples from forward instead)."""

    def __init__(self, model_dim: int, num_experts: int, k: int = 1, capacity_factor: float = 1.0,
                 eval_capacity_factor: float = 1.0, min_capacity: int = 8, noisy_gate_policy: str | None = None,
                 drop_tokens: bool = True, use_rts: bool = True, ep_group=None,
                 top2_2nd_expert_sampling: bool = True) -> None:
        super().__init__()
        if noisy_gate_policy not in NOISY_GATE_POLICIES:
            raise MoEArgumentError(f"noisy_gate_policy: unsupported {noisy_gate_policy!r} (use None, 'Jitter' or "
                                   "'RSample')")
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= num_experts:
            raise MoEArgumentError(f"k: must be an integer from 1 to num_experts={num_experts} (got {k!r})")
        self.wg = nn.Linear(model_dim, num_experts, bias=False)
        self.ep_group = ep_group
        self.k = k
        self.capacity_factor = capacity_factor
        self.eval_capacity_factor = eval_capacity_factor
        self.min_capacity = min_capacity
        self.noisy_gate_policy = noisy_gate_policy
        self.drop_tokens = drop_tokens
        self.use_rts = use_rts
        self.top2_2nd_expert_sampling = top2_2nd_expert_sampling
        self.tp_size = 1  # the dense layers' tensor-parallel size, bound with the layer's groups

    def _set_ep_group(self, ep_group) -> None:
        self.ep_group = ep_group

    def forward(self, input: torch.Tensor, used_token: torch.Tensor | None = None) -> Routes:
        return self.routes(input, used_token)

    def routes(self, input: torch.Tensor, used_token: torch.Tensor | None = None) -> Routes:
        x = input.float()
        if self.noisy_gate_policy == "Jitter" and self.training:
            x = multiplicative_jitter(x)
        logits = F.linear(x, weight=self.wg.weight.float(), bias=None)
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        if self.k == 1:
            return top1gating(logits, factor, self.min_capacity, used_token,
                              self.noisy_gate_policy if self.training else None, self.drop_tokens, self.use_rts,
                              self.ep_group, tp_size=self.tp_size)
        if self.k == 2:
            return top2gating(logits, factor, self.min_capacity, self.drop_tokens, self.ep_group,
                              self.top2_2nd_expert_sampling, tp_size=self.tp_size)
        return topkgating(logits, self.k, factor, self.min_capacity, self.drop_tokens, self.ep_group,
                          tp_size=self.tp_size)
