"""``torch_autocast`` at ZeRO stages 0-3 on one world of two gloo processes, against plain autocast
training of the same model computed in one process.

The engine keeps fp32 parameters, runs the forward under ``torch.autocast`` (bf16 on CPU) and reduces
the gradients of the lower-precision-safe modules (``torch.nn.Linear`` by default) in bf16, the
others (LayerNorm) in fp32, as DeepSpeed does (stage 0 reduces all in fp32, within the same tolerance). The reference computes each rank's micro-batch under
``torch.autocast`` in this process, averages the two gradients (the Linear ones rounded to bf16 before
the sum, as sent) and takes the same SGD steps. Tolerance: the sum of two bf16 gradients is rounded
once more to bf16 on the wire (relative 2**-8 of a gradient), so after three steps at lr 0.1 the
parameters agree within `ATOL` = 1e-3 (gradients here are below 1). Also: an explicit
``lower_precision_safe_modules`` list (LayerNorm only) moves the bf16 reduction to those parameters,
and fp16 autocast is refused with its key.
"""

from __future__ import annotations

import pytest
import torch

from lightspeed.testing.run_world import run_world

pytestmark = [pytest.mark.dist, pytest.mark.timeout(120)]

LR, STEPS, ATOL = 0.1, 3, 1e-3


def _model():
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.LayerNorm(8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _batch(step: int, rank: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 6, generator=g), torch.randn(4, 2, generator=g)


def _loss(out, y):
    return torch.nn.functional.mse_loss(out.float(), y)


def _reference(world: int):
    model = _model()
    for step in range(STEPS):
        grads = []
        for rank in range(world):
            model.zero_grad()
            x, y = _batch(step, rank)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(x)
            _loss(out, y).backward()
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        with torch.no_grad():
            for n, p in model.named_parameters():
                linear = p.dim() == 2 or n.startswith(("0.", "3."))
                sent = [g[n].bfloat16().float() if linear else g[n] for g in grads]
                p -= LR * sum(sent) / world
    return {n: p.detach() for n, p in model.named_parameters()}


def _engine(stage: int, section: dict):
    import lightspeed

    model = _model()
    cfg = {"train_micro_batch_size_per_gpu": 4, "torch_autocast": section, "gradient_clipping": 0.0,
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    engine, *_ = lightspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR), config=cfg)
    return engine


def _reduce_dtypes(engine) -> dict[str, torch.dtype]:
    """Parameter name -> the dtype the strategy reduces its gradient in."""
    s = engine.strategy
    names = {id(p): n for n, p in engine.module.named_parameters()}
    if hasattr(s, "shards"):
        return {names[id(p)]: sh.reduce.reduce_dtype for sh in s.shards for p in sh.flat.params}
    return {names[id(p)]: g.comm_dtype for g in s.groups for p in g.params if g.trainable}


def _world():
    import torch.distributed as dist

    rank = dist.get_rank()
    want = _reference(2)
    for stage in (0, 1, 2, 3):
        engine = _engine(stage, {"enabled": True, "dtype": "bfloat16"})
        dtypes = _reduce_dtypes(engine) if stage else None  # stage 0 reduces every gradient in fp32
        assert stage == 0 or dtypes == {"0.weight": torch.bfloat16, "0.bias": torch.bfloat16, "1.weight": torch.float32,
                          "1.bias": torch.float32, "3.weight": torch.bfloat16, "3.bias": torch.bfloat16}, (stage, dtypes)
        for step in range(STEPS):
            x, y = _batch(step, rank)
            out = engine(x)
            assert out.dtype == torch.bfloat16  # the forward ran under autocast
            engine.backward(_loss(out, y))
            engine.step()
        from lightspeed.zero.param_access import safe_get_full_fp32_param

        for n, p in engine.module.named_parameters():
            full = safe_get_full_fp32_param(p)
            assert full.dtype == torch.float32
            torch.testing.assert_close(full, want[n], atol=ATOL, rtol=0, msg=f"stage {stage} {n}")
        if stage != 3:
            assert all(p.dtype == torch.float32 for p in engine.module.parameters())
        engine.destroy()
    engine = _engine(2, {"enabled": True, "lower_precision_safe_modules": ["torch.nn.LayerNorm"]})
    dtypes = _reduce_dtypes(engine)
    assert {n for n, d in dtypes.items() if d == torch.bfloat16} == {"1.weight", "1.bias"}, dtypes
    engine.destroy()  # without a backward: nothing to reduce, the released gradient buffers stay untouched
    with pytest.raises(NotImplementedError, match="torch_autocast.dtype=fp16"):
        _engine(1, {"enabled": True, "dtype": "fp16"})
    return True


def test_torch_autocast():
    assert run_world(_world, 2) == [True, True]
