"""DeepSpeed's parameter accessors (`safe_get_full_*`, `safe_set_full_*`, `safe_get_local_*`,
`safe_update_full_grad_vectorized`) at every ZeRO stage on 2 gloo ranks, against stage 0 (where every
rank holds everything) and plain PyTorch."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import lightspeed
from lightspeed.testing.models import TinyMLP, regression_data
from lightspeed.testing.run_world import run_world

pytestmark = [pytest.mark.dist, pytest.mark.timeout(180)]

OPT = {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}}


def _stage(stage: int, bf16: bool):
    from lightspeed.zero import param_access as f

    world, rank = dist.get_world_size(), dist.get_rank()
    cfg = {"train_batch_size": 4 * world, "gradient_accumulation_steps": 2, "optimizer": OPT,
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
           "bf16": {"enabled": bf16}}
    model = TinyMLP()
    engine, *_ = lightspeed.initialize(model=model, config=cfg)
    x, y = regression_data(8 * world)
    x = x.to(torch.bfloat16 if bf16 else torch.float32)
    out = {"grads": {}, "fp32": {}, "exp_avg": {}, "local": None}
    for step in range(2):
        for micro in range(2):
            lo = ((step * 2 + micro) * world + rank) * 2
            engine.backward(engine(x[lo:lo + 2], y[lo:lo + 2]))
            if step == 1 and micro == 1:  # after the boundary's backward, before the step
                out["grads"] = {n: f.safe_get_full_grad(p).float().clone() for n, p in model.named_parameters()
                                if p.requires_grad}
                f.safe_set_full_grad(model.fc2.bias, torch.full((5,), 0.25))  # written where the step reads
                out["set_grad"] = f.safe_get_full_grad(model.fc2.bias).float().clone()
                # the vectorized update: each full gradient through the function, written back
                f.safe_update_full_grad_vectorized([model.fc2.bias, model.tiny], lambda g, p: g * 2 + 1)
                out["updated"] = [f.safe_get_full_grad(p).float().clone() for p in (model.fc2.bias, model.tiny)]
                out["tiny_grad"] = out["grads"]["tiny"]
                if stage == 3:
                    out["local_grad"] = f.safe_get_local_grad(model.fc1.weight).numel()
            engine.step()
    # after the step the sharded stages' gradient buffers are released until the next backward: the
    # gradient accessors say so (DeepSpeed's raise at stages 1-2 too); stage 0 keeps zeroed gradients
    out["after_step"] = [_raises(f.safe_get_full_grad, p) for p in model.parameters() if p.requires_grad]
    for n, p in model.named_parameters():
        out["fp32"][n] = f.safe_get_full_fp32_param(p)
        if p.requires_grad:
            out["exp_avg"][n] = f.safe_get_full_optimizer_state(p, "exp_avg")
    assert f.safe_get_full_fp32_param(torch.nn.Parameter(torch.ones(2))) is None  # not managed
    with pytest.raises(ValueError, match="not found"):
        f.safe_get_full_optimizer_state(model.fc1.weight, "momentum_buffer")
    # writes: the full value lands in the fp32 copy and in the parameters the model computes with
    w = model.fc1.weight
    f.safe_set_full_fp32_param(w, torch.full((37, 13), 0.5))
    f.safe_set_full_optimizer_state(w, torch.full((37, 13), 2.0), "exp_avg_sq")
    out["set"] = (f.safe_get_full_fp32_param(w), f.safe_get_full_optimizer_state(w, "exp_avg_sq"),
                  engine.strategy.module_state_dict()["fc1.weight"].float())
    if stage == 3:
        local = f.safe_get_local_fp32_param(w)
        n = torch.tensor([local.numel()])
        dist.all_reduce(n)
        f.safe_set_local_optimizer_state(w, torch.full((local.numel(),), 3.0), "exp_avg")
        f.safe_set_local_fp32_param(w, torch.full((local.numel(),), 0.75))
        out["local"] = (int(n), bool((f.safe_get_local_fp32_param(w) == 0.75).all()),
                        out["local_grad"] == local.numel() and _raises(f.safe_get_local_grad, w),
                        bool((f.safe_get_local_optimizer_state(w, "exp_avg_sq") == 2.0).all()),
                        bool((f.safe_get_full_optimizer_state(w, "exp_avg") == 3.0).all()),
                        bool((f.safe_get_full_fp32_param(w) == 0.75).all()))
    else:
        with pytest.raises(ValueError, match="ZeRO-3"):
            f.safe_get_local_fp32_param(w)
    return out


def _raises(fn, param) -> bool:
    try:
        fn(param)
    except ValueError as err:
        return "between the backward" in str(err)
    return False


def _worker(bf16: bool):
    return {stage: _stage(stage, bf16) for stage in (0, 1, 2, 3)}


def _both():
    return {bf16: _worker(bf16) for bf16 in (False, True)}


@pytest.fixture(scope="module")
def both():
    return run_world(_both, 2)  # fp32 and bf16 in one world


@pytest.mark.parametrize("bf16", [False, True])
def test_accessors_agree_at_every_stage(bf16, both):
    results = [rank[bf16] for rank in both]
    for r in results:
        ref = r[0]
        assert set(ref["grads"]) == {"fc1.weight", "fc1.bias", "norm.weight", "norm.bias", "fc2.weight", "fc2.bias",
                                     "tiny"}
        tol = {"rtol": 2e-2, "atol": 1e-3} if bf16 else {"rtol": 1e-5, "atol": 1e-6}
        for stage in (1, 2, 3):
            got = r[stage]
            for key in ("grads", "fp32", "exp_avg"):
                for n, v in ref[key].items():
                    if n == "frozen":  # None at every stage, as DeepSpeed (stage 3 keeps it, but trains nothing)
                        assert v is None and got[key][n] is None
                        continue
                    assert got[key][n].dtype == torch.float32 or key == "grads"
                    torch.testing.assert_close(got[key][n].float(), v.float(), **tol,
                                               msg=lambda m, s=stage, k=key, n=n: f"stage {s} {k} {n}: {m}")
        for stage in (0, 1, 2, 3):
            fp32, state, lp = r[stage]["set"]
            assert torch.equal(fp32, torch.full((37, 13), 0.5)) and torch.equal(state, torch.full((37, 13), 2.0))
            assert torch.equal(lp, torch.full((37, 13), 0.5)), stage
        assert r[3]["local"] == (37 * 13, True, True, True, True, True)
        assert not any(r[0]["after_step"])  # stage 0 keeps (zeroed) gradients
        for stage in (1, 2, 3):
            assert all(r[stage]["after_step"]), stage
        for stage in (0, 1, 2, 3):
            torch.testing.assert_close(r[stage]["set_grad"], torch.full((5,), 0.25), msg=f"stage {stage}")
            bias, tiny = r[stage]["updated"]
            torch.testing.assert_close(bias, torch.full((5,), 0.25 * 2 + 1), msg=f"stage {stage}")
            torch.testing.assert_close(tiny, r[stage]["tiny_grad"].float() * 2 + 1, msg=f"stage {stage}")
    assert torch.equal(results[0][3]["fp32"]["fc1.weight"], results[1][3]["fp32"]["fc1.weight"])


def _grad_worker():
    from lightspeed.zero.param_access import safe_get_full_grad

    world, rank = dist.get_world_size(), dist.get_rank()
    model = TinyMLP()
    cfg = {"train_batch_size": 4 * world, "gradient_accumulation_steps": 2, "optimizer": OPT,
           "zero_optimization": {"stage": 3}}
    engine, *_ = lightspeed.initialize(model=model, config=cfg)
    x, y = regression_data(8 * world)
    for micro in range(2):
        lo = (micro * world + rank) * 2
        engine.backward(engine(x[lo:lo + 2], y[lo:lo + 2]))
    return {n: safe_get_full_grad(p).clone() for n, p in model.named_parameters() if p.requires_grad}


def test_full_grad_is_the_averaged_accumulated_gradient():
    got = run_world(_grad_worker, 2)[0]
    model = TinyMLP()
    x, y = regression_data(16)
    for micro in range(2):
        for rank in range(2):
            lo = (micro * 2 + rank) * 2
            (model(x[lo:lo + 2], y[lo:lo + 2]) / 4).backward()
    for n, p in model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(got[n], p.grad, rtol=1e-5, atol=1e-6)
