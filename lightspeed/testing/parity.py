"""Parity helpers: step an engine and a plain-PyTorch reference side by side on the same batches."""
from __future__ import annotations

import math
from typing import Iterable

import torch


def train_alongside(engine, ref_model: torch.nn.Module, ref_opt: torch.optim.Optimizer,
                    batches: Iterable[tuple[torch.Tensor, torch.Tensor]], *, rtol: float = 1e-6,
                    atol: float = 1e-7) -> None:
    """Train `engine` and `ref_model`/`ref_opt` on each (x, y) of `batches`; every step's loss and the
    final parameters (the engine's full-precision module state) must agree within rtol / atol."""
    for x, y in batches:
        loss = ref_model(x, y)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        got = engine(x, y)
        engine.backward(got)
        engine.step()
        assert math.isclose(got.item(), loss.item(), rel_tol=rtol), (got.item(), loss.item())
    state = engine.strategy.module_state_dict()
    for k, v in ref_model.state_dict().items():
        torch.testing.assert_close(state[k], v, rtol=rtol, atol=atol)
