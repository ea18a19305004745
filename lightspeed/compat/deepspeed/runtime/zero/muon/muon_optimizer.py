"""`deepspeed.runtime.zero.muon.muon_optimizer`: DeepSpeed's engine-facing MuonWithAuxAdam, which is
lightspeed.optim.muon.Muon. `adam_optimizer` (DeepSpeed steps the Adam groups with it, FusedAdam by
default) is not used: lightspeed's Muon steps them with its own Adam, FusedAdam's formula."""

from __future__ import annotations

from lightspeed.optim.muon import Muon

__all__ = ["MuonWithAuxAdam"]


class MuonWithAuxAdam(Muon):
    def __init__(self, param_groups, adam_optimizer=None, adam_optimizer_kwargs=None, adam_w_mode=True,
                 fallback_to_inline=False):
        super().__init__(param_groups, adam_w_mode=adam_w_mode)
