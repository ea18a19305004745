"""ZenFlow (`zero_optimization.zenflow`, zero/zenflow.py) on real gloo processes against a reference
written in plain PyTorch from the paper and DeepSpeed's schedule; with every column selected it is
the plain offloaded step; its checkpoints load into a run without ZenFlow. Config rules: DeepSpeed's.
"""

from __future__ import annotations

import copy
import tempfile

import pytest
import torch
import torch.distributed as dist

import lightspeed
from lightspeed.config.errors import ConfigError
from lightspeed.offload.zenflow_config import ZenFlowOptions
from lightspeed.testing.models import TinyMLP, regression_data
from lightspeed.testing.run_world import run_world
from tests.distributed.test_data_parallel import GLOBAL_BATCH, _config

STEPS = 9
LR, BETAS, EPS, WD = 0.01, (0.9, 0.99), 1e-8, 0.01
SMALL = {"reduce_bucket_size": 50, "allgather_bucket_size": 50}


def _adamw(p, g, m, v, step):
    m.mul_(BETAS[0]).add_(g, alpha=1 - BETAS[0])
    v.mul_(BETAS[1]).addcmul_(g, g, value=1 - BETAS[1])
    denom = (v.sqrt() / (1 - BETAS[1] ** step) ** 0.5).add_(EPS)
    p.mul_(1 - LR * WD).addcdiv_(m, denom, value=-LR / (1 - BETAS[0] ** step))


def zenflow_reference(zf: dict, clip: float = 0.0, steps: int = STEPS):
    """ZenFlow on the whole global batch in one process (DeepSpeed's schedule; see zero/zenflow.py)."""
    torch.manual_seed(0)
    model = TinyMLP()
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = dict(model.named_parameters())
    master = {n: params[n].detach().clone() for n in names}
    hm, hv = ({n: torch.zeros_like(master[n]) for n in names} for _ in range(2))
    acc = {n: torch.zeros_like(master[n]) for n in names}
    w, u, s = zf.get("full_warm_up_rounds", 0), zf["update_interval"], zf["select_interval"]
    ratio, overlap = zf["topk_ratio"], zf.get("overlap_step", False)
    masks, dev, k, count, pending = None, None, 0, 0, False
    auto = u == "auto"  # DeepSpeed's adaptive update: the next step updates once enough weights call for it
    flag, interval, sums, tops, updates = False, 0, {}, {}, 0

    def write(names_vals):
        with torch.no_grad():
            for n, val in names_vals:
                params[n].copy_(val)

    def sync():  # the host masters take the device values; an update in flight reaches the parameters
        nonlocal pending
        if pending:
            write((n, master[n]) for n in names)
            pending = False
        if dev is not None:
            for n in names:
                master[n][masks[n]] = dev[n][0]
            write((n, torch.where(masks[n], master[n], params[n].detach())) for n in names)

    x, y = regression_data(GLOBAL_BATCH * steps)
    losses = []
    for m in range(steps):
        loss = model(x[m * GLOBAL_BATCH:(m + 1) * GLOBAL_BATCH], y[m * GLOBAL_BATCH:(m + 1) * GLOBAL_BATCH])
        grads = dict(zip(names, torch.autograd.grad(loss, [params[n] for n in names])))
        losses.append(loss.item())
        norm = torch.stack([g.norm() for g in grads.values()]).norm()
        coef = min(1.0, clip / (float(norm) + 1e-6)) if clip > 0 else 1.0
        for n in names:
            acc[n] += grads[n]
        count += 1
        selective = m >= w
        flagged, flag = flag, False
        if auto:
            update = bool(s and (m + 1) % s == 0) or m + 1 <= w or flagged
        else:
            update = m + 1 < w or (m + 1 - w) % u == 0 or bool(s and (m + 1) % s == 0)
        if selective and (dev is None or m == w or (s and m % s == 0)):
            sync()
            masks = {}
            for n in names:
                g = grads[n]
                if g.dim() == 2:
                    top = tops[n] = torch.topk(g.abs().sum(0), int(ratio * g.shape[1])).indices
                    masks[n] = torch.zeros_like(g, dtype=torch.bool)
                    masks[n][:, top] = True
                else:
                    masks[n] = torch.ones_like(g, dtype=torch.bool)
            dev = {n: [master[n][masks[n]].clone(), None, None] for n in names}
            for n in names:  # the moments start again, their step count goes on
                dev[n][1:] = [torch.zeros_like(dev[n][0]), torch.zeros_like(dev[n][0])]
        if selective and auto:
            if flagged:
                interval = 0
                for v in sums.values():
                    v[1] = 0.0
            interval += 1
            need = 0
            for n in tops:
                col = grads[n].abs().sum(0)
                total, critic = float(col.sum()), float(col[tops[n]].sum())
                v = sums.setdefault(n, [0.0, 0.0])
                v[0] = (v[0] * (interval - 1) + critic) / interval / (ratio * 10)
                v[1] += (total - critic) / ((1 - ratio) * 10)
                need += v[1] >= v[0]
            flag = need >= int(zf.get("auto_ratio", 0.99) * len(tops))
        if update:
            updates += 1
            sync()
            mean = {n: acc[n] / count for n in names}
            mnorm = float(torch.stack([g.norm() for g in mean.values()]).norm())
            c = min(1.0, clip / (mnorm + 1e-6)) if clip > 0 else 1.0
            for n in names:
                _adamw(master[n], mean[n] * c, hm[n], hv[n], m + 1)
                acc[n].zero_()
            count = 0
            if overlap and selective:
                pending = True
            else:
                write((n, master[n]) for n in names)
        if selective:
            k += 1
            for n in names:
                val, mo, ve = dev[n]
                _adamw(val, grads[n][masks[n]] * coef, mo, ve, k)
                new = params[n].detach().clone()
                new[masks[n]] = val
                write([(n, new)])
    sync()
    return losses, {n: v.detach().clone() for n, v in model.state_dict().items()}, updates


def _zero(zf: dict | None, small: bool = True) -> dict:
    z = {"stage": 2, **(SMALL if small else {}), "offload_optimizer": {"device": "cpu"}}
    if zf is not None:
        z["zenflow"] = copy.deepcopy(zf)
    return z


def _train(cfg: dict, steps: int = STEPS, save: str | None = None, load: str | None = None, split: bool = False):
    """`split`: fc2.weight in an optimizer group of its own (the same hyperparameters): at stage 3 over two
    ranks one rank then holds none of that group's elements (stage3/zenflow_shards.py's Note)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    model = TinyMLP()
    params = model.parameters()
    if split:
        params = [{"params": [model.fc2.weight]}, {"params": [p for n, p in model.named_parameters() if n != "fc2.weight"]}]
    engine, *_ = lightspeed.initialize(model=model, model_parameters=params, config=cfg)
    if load is not None:
        engine.load_checkpoint(load)
    micro = engine.train_micro_batch_size_per_gpu()
    x, y = regression_data(GLOBAL_BATCH * steps)
    losses = []
    for s in range(steps):
        base = s * GLOBAL_BATCH + rank * micro
        loss = engine(x[base:base + micro], y[base:base + micro])
        engine.backward(loss)
        engine.step()
        loss = loss.detach().clone()
        dist.all_reduce(loss)
        losses.append((loss / world).item())
    state = {k: v.float().clone() for k, v in engine.strategy.module_state_dict().items()}
    extra = engine.strategy._runner.zenflow.updates if engine.strategy._runner.zenflow is not None else None
    if save is not None:
        engine.save_checkpoint(save, tag="zf")
        zf = engine.strategy._runner.zenflow
        extra = [(s.idx_host.clone(), s.exp_avg.clone()) for s in zf._sel]
    return losses, state, extra


CASES = {
    "seq": {"topk_ratio": 0.3, "select_strategy": "step", "select_interval": 4, "update_interval": 2},
    "warm-overlap": {"topk_ratio": 0.3, "select_strategy": "step", "select_interval": 6, "update_interval": 3,
                     "full_warm_up_rounds": 2, "overlap_step": True},
    "all": {"topk_ratio": 1.0, "select_strategy": "step", "select_interval": 0, "update_interval": 2},
    "auto": {"topk_ratio": 0.3, "select_strategy": "step", "select_interval": 0, "update_interval": "auto",
             "auto_ratio": 0.5},
}


def _worker(tmp: str):
    world = dist.get_world_size()
    # one bucket ("warm-overlap"): some weights lie wholly on one rank
    out = {name: _train(_config(world, gradient_clipping=0.5 if name == "seq" else 0.0,
                                zero_optimization=_zero(zf, small=name != "warm-overlap")))
           for name, zf in CASES.items()}
    out["stage1"] = _train(_config(world, gradient_clipping=0.5, zero_optimization={
        **_zero(CASES["seq"]), "stage": 1}))
    out["plain"] = _train(_config(world, zero_optimization=_zero(None)))
    stage3 = {"stage": 3, "stage3_param_persistence_threshold": 0}
    # the selected elements' moments in host memory: the same arithmetic
    out["seq-offload"] = _train(_config(world, gradient_clipping=0.5,
                                        zero_optimization=_zero({**CASES["seq"], "offload": True})))
    out["stage3"] = _train(_config(world, gradient_clipping=0.5, zero_optimization={**_zero(CASES["seq"]), **stage3}),
                           split=True)
    out["stage3-overlap"] = _train(_config(world, zero_optimization={**_zero(CASES["warm-overlap"], small=False),
                                                                     **stage3}))
    # a ZenFlow checkpoint, loaded by a run without ZenFlow
    saved = _train(_config(world, zero_optimization=_zero(CASES["seq"])), steps=3, save=tmp)
    model = TinyMLP()
    engine, *_ = lightspeed.initialize(model=model, model_parameters=model.parameters(),
                                       config=_config(world, zero_optimization=_zero(None)))
    engine.load_checkpoint(tmp, tag="zf")
    loaded = {k: v.float().clone() for k, v in engine.strategy.module_state_dict().items()}
    shard = engine.strategy.shards[0]
    state = engine.optimizer.state[shard.master]
    out["ckpt"] = (saved[1], loaded, saved[2][0][0], saved[2][0][1], state["exp_avg"].clone(), state["step"])
    # and into a ZenFlow run, which selects again and goes on
    model = TinyMLP()
    engine, *_ = lightspeed.initialize(model=model, model_parameters=model.parameters(),
                                       config=_config(world, zero_optimization=_zero(CASES["seq"])))
    engine.load_checkpoint(tmp, tag="zf")
    again = {k: v.float().clone() for k, v in engine.strategy.module_state_dict().items()}
    x, y = regression_data(GLOBAL_BATCH)
    micro = engine.train_micro_batch_size_per_gpu()
    engine.backward(engine(x[dist.get_rank() * micro:][:micro], y[dist.get_rank() * micro:][:micro]))
    engine.step()
    out["ckpt-zf"] = (again, engine.strategy._runner.zenflow._sel is not None)
    # stage 3: the device values of the selected elements reach the checkpoint, which loads at stage 2
    saved3 = _train(_config(world, zero_optimization={**_zero(CASES["seq"]), **stage3}), steps=3, save=tmp + "/s3")
    model = TinyMLP()
    engine, *_ = lightspeed.initialize(model=model, model_parameters=model.parameters(),
                                       config=_config(world, zero_optimization=_zero(None)))
    engine.load_checkpoint(tmp + "/s3", tag="zf")
    out["ckpt-stage3"] = (saved3[1], {k: v.float().clone() for k, v in engine.strategy.module_state_dict().items()})
    return out


@pytest.mark.dist
@pytest.mark.parametrize("world", [1, 2])
def test_zenflow_against_the_reference(world):
    with tempfile.TemporaryDirectory(prefix="zenflow_test_") as tmp:
        out = run_world(_worker, world, tmp)[0]
    for name in ("seq", "stage1", "warm-overlap", "auto", "stage3", "stage3-overlap"):
        case = CASES[{"stage1": "seq", "stage3": "seq", "stage3-overlap": "warm-overlap"}.get(name, name)]
        ref_losses, ref_state, ref_updates = zenflow_reference(case, clip=0.5 if name in ("seq", "stage1", "stage3")
                                                               else 0.0)
        losses, state, updates = out[name]
        assert updates == ref_updates, name
        if name == "auto":  # the rule both waited and fired
            assert 1 < updates < STEPS - 1, updates
        assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-7), name
        for k, v in ref_state.items():
            torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name} {k}: {m}")
    # every column selected: the plain offloaded step (the same kernel, elements in other SIMD lanes)
    losses, state, _ = out["all"]
    assert losses == pytest.approx(out["plain"][0], rel=1e-6, abs=1e-7)
    for k, v in out["plain"][1].items():
        torch.testing.assert_close(state[k], v, rtol=1e-6, atol=1e-7)
    # selection changed the trajectory: the reference is not the plain step
    assert out["seq"][0] != pytest.approx(out["plain"][0], rel=1e-4)
    saved, loaded, idx, dev_avg, host_avg, step = out["ckpt"]
    for k, v in saved.items():
        assert torch.equal(loaded[k], v), k
    assert step == 3  # the steps taken, whatever the last CPU update counted
    assert torch.equal(host_avg[idx], dev_avg)  # the device moments of the selected elements
    again, selected = out["ckpt-zf"]
    for k, v in saved.items():
        assert torch.equal(again[k], v), k
    assert selected
    assert out["seq-offload"][0] == out["seq"][0]
    for k, v in out["seq"][1].items():
        assert torch.equal(out["seq-offload"][1][k], v), k
    saved, loaded = out["ckpt-stage3"]
    for k, v in saved.items():
        assert torch.equal(loaded[k], v), k


def test_zenflow_config_follows_deepspeed():
    d = ZenFlowOptions.from_dict({})
    assert (d.topk_ratio, d.select_strategy, d.select_interval, d.update_interval, d.full_warm_up_rounds,
            d.overlap_step, d.offload, d.auto_ratio, d.pt_reserved_cores_perc) == (
        0.1, "auto", "auto", "auto", 0, False, False, 0.99, 0.5)
    sch = d.schedule(None)  # "auto": once per epoch; without an epoch length, once
    assert (sch.select_interval, sch.update_interval) == (0, 0)
    assert d.schedule(7).select_interval == 7
    step = ZenFlowOptions.from_dict({"select_strategy": "step", "select_interval": 4, "update_interval": 2})
    sch = step.schedule(None)
    assert [m for m in range(9) if sch.updates(m)] == [1, 3, 5, 7]
    assert [m for m in range(9) if sch.selects(m)] == [0, 4, 8]
    for bad, key in [({"topk_ratio": 1.5}, "topk_ratio"), ({"select_strategy": "x"}, "select_strategy"),
                     ({"select_interval": "x"}, "select_interval"), ({"update_interval": "every"}, "update_interval"),
                     ({"select_interval": 3}, "select_interval"),
                     ({"select_strategy": "step"}, "select_interval"),
                     ({"select_strategy": "step", "select_interval": 1, "update_interval": 4}, "select_interval"),
                     ({"full_warm_up_rounds": 1.5}, "full_warm_up_rounds"), ({"topk": 0.1}, "topk")]:
        with pytest.raises(ConfigError, match=key):
            ZenFlowOptions.from_dict(bad)


@pytest.mark.parametrize("zero,match", [
    ({"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}, "zenflow": {}},
     "zenflow with zero_optimization.offload_param"),
    ({"stage": 2, "zenflow": {}}, "zero_optimization.zenflow"),
])
def test_zenflow_refusals_name_their_key(zero, match):
    from lightspeed import config as config_mod
    from lightspeed.offload.policy import OffloadPolicy
    cfg = config_mod.load(_config(1, zero_optimization=zero), world_size=1)
    with pytest.raises((ConfigError, NotImplementedError), match=match):
        OffloadPolicy.from_config(cfg)

