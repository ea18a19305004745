"""`deepspeed.moe.sharded_moe`: DeepSpeed's gate functions and classes with its call signatures and
return values, over lightspeed.parallel.experts (the same routes, bit for bit).

`top1gating`, `top2gating` and `topkgating` return DeepSpeed's dense `(l_aux, combine_weights
[s, e, c], dispatch_mask, exp_counts)`, or with `sparse_routes=True` its `(l_aux, capacity,
num_experts, indices [k, s], locations [k, s], gates [k, s], exp_counts)`. `TopKGate.forward` returns
the same tuples; `MOELayer` takes either gate class. Tutel (`use_tutel=True`) is refused. As
DeepSpeed's read its recorded model-parallel groups, the functions read the tensor-parallel size of
the topology the last `initialize()` recorded (`drop_tokens=False` pads the capacity to a multiple of it).
"""

from __future__ import annotations

import torch

from lightspeed.comm.topology import current_topology
from lightspeed.parallel.experts import MOELayer, Routes
from lightspeed.parallel.experts import TopKGate as _TopKGate
from lightspeed.parallel.experts import gating
from lightspeed.parallel.experts.gating import gumbel_noise, multiplicative_jitter


def _tuple(routes: Routes, sparse_routes: bool) -> tuple:
    if not sparse_routes:
        return routes.dense()
    return (routes.l_aux, torch.tensor(routes.capacity), routes.num_experts, routes.indices, routes.locations,
            routes.gates, routes.exp_counts)


def _tp() -> int:
    topology = current_topology()
    return 1 if topology is None else topology.size("tp")


def _no_tutel(use_tutel: bool) -> None:
    if use_tutel:
        raise NotImplementedError("deepspeed.moe.sharded_moe: use_tutel=True (Tutel's kernels) is not implemented in "
                                  "lightspeed")


def top1gating(logits, capacity_factor, min_capacity, used_token=None, noisy_gate_policy=None, drop_tokens=True,
               use_rts=True, ep_group=None, sparse_routes=False, use_tutel=False):
    _no_tutel(use_tutel)
    return _tuple(gating.top1gating(logits, capacity_factor, min_capacity, used_token, noisy_gate_policy,
                                    drop_tokens, use_rts, ep_group, tp_size=_tp()), sparse_routes)


def top2gating(logits, capacity_factor, min_capacity, drop_tokens=True, ep_group=None, top2_2nd_expert_sampling=True,
               sparse_routes=False):
    return _tuple(gating.top2gating(logits, capacity_factor, min_capacity, drop_tokens, ep_group,
                                    top2_2nd_expert_sampling, tp_size=_tp()), sparse_routes)


def topkgating(logits, k, capacity_factor, min_capacity, drop_tokens=True, ep_group=None, drop_policy="probs",
               sparse_routes=False):
    return _tuple(gating.topkgating(logits, k, capacity_factor, min_capacity, drop_tokens, ep_group, drop_policy,
                                    tp_size=_tp()),
                  sparse_routes)


def gumbel_rsample(shape, device):
    return gumbel_noise(shape, device)


class TopKGate(_TopKGate):
    """DeepSpeed's gate module; forward returns DeepSpeed's tuples (`routes()` the Routes)."""

    def forward(self, input, used_token=None, sparse_routes=False, use_tutel=False):
        _no_tutel(use_tutel)
        return _tuple(self.routes(input, used_token), sparse_routes)


__all__ = ["MOELayer", "TopKGate", "gumbel_rsample", "multiplicative_jitter", "top1gating", "top2gating",
           "topkgating"]
