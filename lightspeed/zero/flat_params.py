"""FlatParams: the trainable parameters of one dtype laid end to end, with their gradients and fp32
master copy in flat buffers of the same layout.

Owns: the three flat buffers and the views into them; re-pointing each parameter's storage at its
view of `lp_flat`. Must not: communicate, or know which ZeRO stage uses it.

Note (buffer order): parameters are laid out in REVERSE registration order, since backward visits
them roughly in that order; so gradient buckets (consecutive ranges of `grad_flat`) fill one after
another from the start of the buffer and can be reduced while backward goes on.
"""

from __future__ import annotations

from typing import Sequence

import torch

from lightspeed._utils.flat import FlatLayout, flat_views, flatten_into
from lightspeed.zero.partition import Range, plan_flat


class FlatParams:
    """Parameters of one dtype in flat buffers.

    lp_flat      [padded_numel] param dtype: the model's parameters (each `p.data` is a view of it)
    grad_flat    [padded_numel] grad_accum dtype: accumulated gradients (None when `full_grads` is off)
    master_flat  [padded_numel] fp32, or None when the params are fp32 (then lp_flat is the master)

    The buffer is cut into buckets (`plan_flat`), each padded to a multiple of `world_size`; the
    sharded stages give rank r the r-th chunk of every bucket.
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], grad_dtype: torch.dtype, *, keep_master: bool,
                 bucket_numel: int = 0, world_size: int = 1, names: Sequence[str] | None = None,
                 full_grads: bool = True):
        assert params, "FlatParams needs at least one parameter"
        dtypes = {p.dtype for p in params}
        assert len(dtypes) == 1, f"one FlatParams per dtype (got {dtypes})"
        self.params = list(reversed(params))
        self.names = list(reversed(names)) if names is not None else [f"param{i}" for i in range(len(params))][::-1]
        self.dtype = self.params[0].dtype
        self.device = self.params[0].device
        self.world_size = world_size
        offsets, self.buckets, total = plan_flat([p.numel() for p in self.params], bucket_numel, world_size)
        self.layout = FlatLayout(tuple(p.shape for p in self.params), tuple(offsets),
                                 sum(p.numel() for p in self.params), total)
        self.lp_flat = flatten_into(self.params, self.layout, dtype=self.dtype, device=self.device)
        self.lp_views = flat_views(self.lp_flat, self.layout)
        for p, view in zip(self.params, self.lp_views):
            p.data = view
        self.grad_dtype = grad_dtype
        # Stage 2 keeps no full-size gradient buffer: gradients pass through per-bucket staging.
        self.grad_flat = torch.zeros(total, dtype=grad_dtype, device=self.device) if full_grads else None
        self.grad_views = flat_views(self.grad_flat, self.layout) if full_grads else None
        self.master_flat = self.lp_flat.float() if keep_master and self.dtype != torch.float32 else None
        self.master_views = flat_views(self.master_flat, self.layout) if self.master_flat is not None else None
        self.index = {id(p): i for i, p in enumerate(self.params)}

    @property
    def has_master(self) -> bool:
        return self.master_flat is not None

    @property
    def grads_alias_autograd(self) -> bool:
        """True when autograd can accumulate straight into `grad_flat` (same dtype as the params)."""
        return self.grad_dtype == self.dtype

    def param_range(self, index: int) -> Range:
        return Range(*self.layout.range_of(index))

    def optimizer_view(self, param: torch.nn.Parameter) -> torch.Tensor:
        """The tensor the optimizer steps for `param`: its fp32 master view, or the param itself."""
        return self.master_views[self.index[id(param)]] if self.master_views is not None else param

    def copy_master_to_params(self) -> None:
        if self.master_flat is not None:
            self.lp_flat.copy_(self.master_flat)

    def copy_params_to_master(self) -> None:
        if self.master_flat is not None:
            self.master_flat.copy_(self.lp_flat)

    def nbytes(self) -> dict[str, int]:
        out = {"lp_params": self.lp_flat.numel() * self.lp_flat.element_size()}
        if self.grad_flat is not None:
            out["grads"] = self.grad_flat.numel() * self.grad_flat.element_size()
        if self.master_flat is not None:
            out["master_params"] = self.master_flat.numel() * 4
        return out
