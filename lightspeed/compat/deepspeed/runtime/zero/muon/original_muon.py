"""`deepspeed.runtime.zero.muon.original_muon`: DeepSpeed's Muon functions and classes under their names.

The Newton-Schulz iterations and `muon_update` are lightspeed.ops.muon's (DeepSpeed's numbers); the
optimizers are lightspeed.optim.muon.Muon, which steps every parameter whole on the rank that calls
it, the result DeepSpeed's distributed classes reach by round-robin and all-gather. Per-head Muon
(`num_heads`) is not built.
"""

from __future__ import annotations

import torch

from lightspeed.ops.muon import NS_METHODS as _METHODS
from lightspeed.ops.muon import muon_update as _muon_update
from lightspeed.ops.muon import newton_schulz, ns_compute_dtype as _ns_compute_dtype
from lightspeed.optim.muon import Muon as _Muon

__all__ = ["NS_METHODS", "ns_compute_dtype", "zeropower_via_newtonschulz5", "zeropower_via_gram_newtonschulz",
           "muon_update", "adam_update", "Muon", "SingleDeviceMuon", "MuonWithAuxAdam", "SingleDeviceMuonWithAuxAdam"]

NS_METHODS = set(_METHODS)


def ns_compute_dtype(ns_method: str = "gram") -> torch.dtype:
    return _ns_compute_dtype(ns_method, "cuda" if torch.cuda.is_available() else "cpu")


def zeropower_via_newtonschulz5(G: torch.Tensor, steps: int) -> torch.Tensor:
    return newton_schulz(G, steps, "standard")


def zeropower_via_gram_newtonschulz(G: torch.Tensor, steps: int) -> torch.Tensor:
    return newton_schulz(G, steps, "gram")


def muon_update(grad, momentum, beta=0.95, ns_steps=5, nesterov=True, ns_method="gram", is_expert_group=False,
                num_heads=None):
    if num_heads is not None:
        raise NotImplementedError("muon_update(num_heads=...): per-head Muon (optimizer.params.per_head_muon) is "
                                  "not built in lightspeed")
    return _muon_update(grad, momentum, beta=beta, ns_steps=ns_steps, nesterov=nesterov, ns_method=ns_method)


def adam_update(grad, buf1, buf2, step, betas, eps):
    buf1.lerp_(grad, 1 - betas[0])
    buf2.lerp_(grad.square(), 1 - betas[1])
    return (buf1 / (1 - betas[0] ** step)) / ((buf2 / (1 - betas[1] ** step)).sqrt() + eps)


class Muon(_Muon):
    """Muon alone: one `use_muon` group over `params` (DeepSpeed's Muon / SingleDeviceMuon)."""

    def __init__(self, params, lr=0.02, weight_decay=0, momentum=0.95, ns_method="gram"):
        super().__init__([{"params": list(params), "use_muon": True, "lr": lr, "weight_decay": weight_decay,
                           "momentum": momentum, "ns_method": ns_method}])


SingleDeviceMuon = Muon


class MuonWithAuxAdam(_Muon):
    """DeepSpeed's MuonWithAuxAdam / SingleDeviceMuonWithAuxAdam: groups with `use_muon` True or False."""

    def __init__(self, param_groups):
        super().__init__(param_groups)


SingleDeviceMuonWithAuxAdam = MuonWithAuxAdam
