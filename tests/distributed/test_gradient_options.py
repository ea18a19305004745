"""Gradient options on one world of two gloo processes.

``gradient_allreduce_op``: "sum" adds the ranks' gradients, "mean" (the default) averages them, at
ZeRO stages 0, 1 and 2 on two gloo processes; with "sum" neither prescale_gradients nor
gradient_predivide_factor scales anything (DeepSpeed tests `gradient_average` first). One SGD step at
lr 1 makes the update the reduced gradient itself, which is compared with the sum of both ranks'
local gradients. Stage 3 refuses "sum", as DeepSpeedConfig does.

``data_types.grad_accum_dtype``: every (model dtype, accumulation dtype) pair DeepSpeed 0.19 accepts
with ZeRO (all of them, at stages 1-3) trains: the gradients accumulate over two micro-batches in
buffers of the accumulation dtype, and two SGD steps land within `ACCUM_ATOL` = 5e-3 of fp32 training
of the same batches: about one bf16 ulp of a parameter near 1 (2**-8), the coarsest rounding here
(measured at most 1.2e-3, against parameter changes of 0.06). Stage 0 accepts only the model's dtype, as DeepSpeed.

``managed_gradient_accumulation`` false: step() is the accumulation boundary (stages 0-3).

``sparse_gradients``: embedding gradients all-gathered as rows equal the dense all-reduce (stage 0).
"""

from __future__ import annotations

import pytest
import torch

from lightspeed.testing.run_world import run_world

pytestmark = [pytest.mark.dist, pytest.mark.timeout(120)]


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def _update(stage: int, op: str, extra: dict):
    import torch.distributed as dist

    import lightspeed

    model = _model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_allreduce_op": op, "zero_optimization": {"stage": stage},
           "gradient_clipping": 0.0, **extra}  # the expected updates are unclipped (DeepSpeed's default clips)
    engine, *_ = lightspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                                       config=cfg)
    x = torch.randn(2, 6, generator=torch.Generator().manual_seed(dist.get_rank()))
    engine.backward(engine(x).square().sum())
    engine.step()
    after = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
    return {n: before[n] - after[n] for n in before}


def _local_sum():
    import torch.distributed as dist

    model = _model()
    x = torch.randn(2, 6, generator=torch.Generator().manual_seed(dist.get_rank()))
    model(x).square().sum().backward()
    out = {}
    for n, p in model.named_parameters():
        dist.all_reduce(p.grad)
        out[n] = p.grad
    return out


def _world():
    import lightspeed
    from lightspeed.config.errors import ConfigError

    total = _local_sum()
    for stage in (0, 1, 2):
        for op, extra, factor in (("mean", {}, 0.5), ("sum", {}, 1.0),
                                  ("SUM", {"prescale_gradients": stage == 0, "gradient_predivide_factor": 4.0}, 1.0)):
            update = _update(stage, op, extra)
            for name, value in update.items():
                torch.testing.assert_close(value, total[name] * factor, atol=1e-6, rtol=1e-5,
                                           msg=f"stage {stage} {op} {extra} {name}")
    _accumulation(total)
    _unmanaged()
    _sparse()
    model = _model()
    with pytest.raises(ConfigError, match='gradient_allreduce_op: "sum" is not supported with zero_optimization.stage 3'):
        lightspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                              config={"train_micro_batch_size_per_gpu": 2, "gradient_allreduce_op": "sum",
                                      "zero_optimization": {"stage": 3}})
    return True


ACCUM_ATOL = 5e-3
PAIRS = (("fp32", "bf16"), ("fp32", "fp16"), ("bf16", "fp32"), ("bf16", "fp16"), ("fp16", "fp32"), ("fp16", "bf16"))
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _fp32_reference(steps: int = 2, micro: int = 2):
    import torch.distributed as dist

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        for m in range(micro):
            x = torch.randn(2, 6, generator=torch.Generator().manual_seed(10 * step + m + 100 * dist.get_rank()))
            (model(x).square().sum() / micro).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        opt.step()
        opt.zero_grad()
    return {n: p.detach() for n, p in model.named_parameters()}


def _accumulation(_total):
    import torch.distributed as dist

    import lightspeed
    from lightspeed.config.errors import ConfigError

    want = _fp32_reference()
    for stage in (1, 2, 3):
        for model_dtype, accum in PAIRS:
            model = _model()
            cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 0.0,
                   "data_types": {"grad_accum_dtype": accum},
                   "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
            if model_dtype != "fp32":
                cfg[model_dtype] = {"enabled": True, **({"loss_scale": 1.0} if model_dtype == "fp16" else {})}
            engine, *_ = lightspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                               config=cfg)
            grads = engine.strategy.shards if stage < 3 else [g for g in engine.strategy.groups if g.trainable]
            assert {(s.grad if stage < 3 else s.grad_shard).dtype for s in grads} == {DTYPES[accum]}
            for step in range(2):
                for m in range(2):
                    x = torch.randn(2, 6, generator=torch.Generator().manual_seed(10 * step + m + 100 * dist.get_rank()))
                    engine.backward(engine(x.to(DTYPES[model_dtype])).float().square().sum())
                    engine.step()
            from lightspeed.zero.param_access import safe_get_full_fp32_param

            for n, p in engine.module.named_parameters():
                torch.testing.assert_close(safe_get_full_fp32_param(p), want[n], atol=ACCUM_ATOL, rtol=0,
                                           msg=f"stage {stage} {model_dtype} accumulating in {accum}: {n}")
            engine.destroy()
    model = _model()
    with pytest.raises(ConfigError, match="data_types.grad_accum_dtype: without ZeRO"):
        lightspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                              config={"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
                                      "data_types": {"grad_accum_dtype": "fp32"}})


def _unmanaged():
    """managed_gradient_accumulation false: three backwards then step() equal the managed window of three
    micro-steps exactly (each backward still divides by gradient_accumulation_steps, as DeepSpeed's); the
    samples count the backwards actually run."""
    import torch.distributed as dist

    import lightspeed
    from lightspeed.runtime.errors import UsageAssertionError

    rank = dist.get_rank()
    for stage in (0, 1, 2, 3):
        params = {}
        for managed in (True, False):
            model = _model()
            cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3, "gradient_clipping": 0.0,
                   "managed_gradient_accumulation": managed,
                   "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
            engine, *_ = lightspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                               config=cfg)
            for m in range(3):
                x = torch.randn(2, 6, generator=torch.Generator().manual_seed(m + 100 * rank))
                assert engine.is_gradient_accumulation_boundary() == (managed and m == 2)
                engine.backward(engine(x).square().sum())
                if managed:
                    engine.step()
            if not managed:
                engine.step()
                with pytest.raises(UsageAssertionError, match="managed_gradient_accumulation"):
                    engine.set_gradient_accumulation_boundary(True)
            assert (engine.global_steps, engine.global_samples) == (1, 12)
            from lightspeed.zero.param_access import safe_get_full_fp32_param

            params[managed] = [safe_get_full_fp32_param(p) for p in engine.module.parameters()]
            engine.destroy()
        for a, b in zip(params[True], params[False]):
            assert torch.equal(a, b), stage


class _Tokens(torch.nn.Module):
    def __init__(self, sparse: bool):
        super().__init__()
        torch.manual_seed(5)
        self.embed = torch.nn.Embedding(20, 4, sparse=sparse)
        self.out = torch.nn.Linear(4, 3)

    def forward(self, tokens):
        return self.out(self.embed(tokens)).square().mean()


def _sparse():
    """Embedding gradients all-gathered as rows (sparse_gradients, or an Embedding(sparse=True)) equal the
    dense all-reduce exactly at stage 0, for "mean" and "sum"; ZeRO 1-3 refuse sparse_gradients."""
    import torch.distributed as dist

    import lightspeed

    rank = dist.get_rank()
    for op in ("mean", "sum"):
        params = {}
        for flag, sparse in ((False, False), (True, False), (False, True)):
            model = _Tokens(sparse)
            cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "sparse_gradients": flag,
                   "gradient_allreduce_op": op, "gradient_clipping": 0.0}
            engine, *_ = lightspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
                                               config=cfg)
            assert len(engine.strategy._sparse_flats) == int(flag or sparse)
            for step in range(4):  # each rank touches its own few rows
                tokens = torch.randint(0, 20, (2, 3), generator=torch.Generator().manual_seed(step + 10 * rank))
                engine.backward(engine(tokens))
                engine.step()
            params[(flag, sparse)] = [p.detach().clone() for p in engine.module.parameters()]
            engine.destroy()
        for variant in ((True, False), (False, True)):
            for a, b in zip(params[(False, False)], params[variant]):
                assert torch.equal(a, b), (op, variant)
    model = _Tokens(False)
    with pytest.raises(NotImplementedError, match="sparse_gradients at zero_optimization.stage 1"):
        lightspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
                              config={"train_micro_batch_size_per_gpu": 2, "sparse_gradients": True,
                                      "zero_optimization": {"stage": 1}})


def test_gradient_options():
    assert run_world(_world, 2) == [True, True]
