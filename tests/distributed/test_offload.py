"""ZeRO-Offload / ZeRO-Infinity on real gloo processes: the offloaded runs against the plain ones.

The host buffers, the device<->host movers and the NVMe swapper (on a temporary directory) all run
on a CPU-only machine: the "device" is then the CPU too, with separate buffers. Cases are grouped so
one `run_world` call (a process start per rank) runs many engines.
"""

from __future__ import annotations

import copy
import os
import tempfile

import pytest
import torch
import torch.distributed as dist

import lightspeed
from lightspeed.testing.models import TinyMLP, regression_data
from lightspeed.testing.run_world import run_world
from tests.distributed.test_data_parallel import GLOBAL_BATCH, STEPS, _config, reference_losses

pytestmark = pytest.mark.dist

SMALL = {"reduce_bucket_size": 50, "allgather_bucket_size": 50, "stage3_param_persistence_threshold": 0}
OPT_CPU = {"offload_optimizer": {"device": "cpu", "pin_memory": True}}
PARAM_CPU = {"offload_param": {"device": "cpu", "pin_memory": True}}


def _zero(stage: int, **extra) -> dict:
    z = {"stage": stage, **{k: v for k, v in SMALL.items() if stage == 3 or not k.startswith("stage3")}}
    z.update(copy.deepcopy(extra))
    return z


def _nvme(block: str, path: str) -> dict:
    return {block: {"device": "nvme", "nvme_path": path}}


def train(steps: int, config: dict, engine_out: list | None = None):
    """As test_data_parallel.engine_losses, with the module state gathered by the strategy (stage 3)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    model = TinyMLP()
    engine, _, _, _ = lightspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    gas, micro = engine.gradient_accumulation_steps(), engine.train_micro_batch_size_per_gpu()
    x, y = regression_data(GLOBAL_BATCH * steps)
    x = x.to(engine.policy.param_dtype)
    losses = []
    for s in range(steps):
        step_loss = torch.zeros(())
        for m in range(gas):
            base = s * GLOBAL_BATCH + m * micro * world + rank * micro
            loss = engine(x[base:base + micro], y[base:base + micro])
            engine.backward(loss)
            engine.step()
            step_loss += loss.detach().float() / gas
        dist.all_reduce(step_loss)
        losses.append((step_loss / world).item())
    state = {k: v.float().cpu().clone() for k, v in engine.strategy.module_state_dict().items()}
    if engine_out is not None:
        engine_out.append(engine)
    return losses, state, engine.get_global_grad_norm()


def _cases_worker(cases: list[tuple[dict, int]], tmp: str) -> list:
    """Each case: (config, steps); `{tmp}` in an nvme_path is this run's temporary directory."""
    out = []
    for cfg, steps in cases:
        cfg = copy.deepcopy(cfg)
        for block in ("offload_optimizer", "offload_param"):
            b = cfg.get("zero_optimization", {}).get(block)
            if b and b.get("nvme_path"):
                b["nvme_path"] = b["nvme_path"].format(tmp=tmp)
        out.append(train(steps, cfg))
    return out


def _run(world: int, cases: list[dict]) -> list:
    with tempfile.TemporaryDirectory(prefix="offload_test_") as tmp:
        results = run_world(_cases_worker, world, [(c, STEPS) for c in cases], tmp)
        leftovers = [f for _, _, files in os.walk(tmp) for f in files]
    assert not leftovers, f"swap files left behind: {leftovers}"
    return results[0]


def _assert_matches(got, ref, ref_state, rel=1e-5):
    losses, state, _ = got
    assert losses == pytest.approx(ref, rel=rel, abs=1e-7)
    for k, v in ref_state.items():
        torch.testing.assert_close(state[k], v, rtol=rel, atol=1e-6)


def _nvme_cases(world: int) -> list[dict]:
    path = "{tmp}"
    cases = [_config(world, zero_optimization=_zero(s, **_nvme("offload_optimizer", path))) for s in (1, 2, 3)]
    cases.append(_config(world, zero_optimization=_zero(3, **_nvme("offload_optimizer", path),
                                                        **_nvme("offload_param", path))))
    cases.append(_config(world, zero_optimization=_zero(3, **OPT_CPU, offload_param={
        "device": "nvme", "nvme_path": path, "max_in_cpu": 40})))
    return cases


@pytest.mark.parametrize("world", [1, 2, 4])
def test_offloaded_fp32_runs_equal_the_reference(world):
    """CPU optimizer offload (stages 1-3), parameter offload, Offload++, and (world sizes 1 and 2) NVMe
    for both, with accumulation and clipping: the losses and final parameters of the reference."""
    ref, ref_state = reference_losses(STEPS)
    clip_ref, clip_state = reference_losses(STEPS, clip=0.05)
    cases = [_config(world, zero_optimization=_zero(s, **OPT_CPU)) for s in (1, 2, 3)]
    cases.append(_config(world, zero_optimization=_zero(3, **OPT_CPU, **PARAM_CPU)))
    cases.append(_config(world, zero_optimization=_zero(3, **PARAM_CPU)))
    # Offload++: part of the optimizer state stays on the device
    cases.append(_config(world, zero_optimization=_zero(3, offload_optimizer={"device": "cpu", "ratio": 0.5})))
    if world < 4:
        cases += _nvme_cases(world)
    # accumulation and clipping (the micro-batch must divide the global batch)
    gas = 3 if world != 4 else 2
    clipped = [_config(world, gas=gas, gradient_clipping=0.05, zero_optimization=_zero(s, **OPT_CPU)) for s in (2, 3)]
    results = _run(world, cases + clipped)
    for got in results[:len(cases)]:
        _assert_matches(got, ref, ref_state)
    for got in results[len(cases):]:
        _assert_matches(got, clip_ref, clip_state)
        assert got[2] > 0.05


def _early_worker():
    out = {}
    for name, cfg in {"early": _config(2, gas=2, zero_optimization=_zero(2, **OPT_CPU)),
                      "stage1": _config(2, zero_optimization=_zero(1, **OPT_CPU)),
                      "stage3": _config(2, gas=2, zero_optimization=_zero(3, **OPT_CPU)),
                      "stage3-param": _config(2, zero_optimization=_zero(3, **OPT_CPU, **PARAM_CPU)),
                      "clipped": _config(2, gas=2, gradient_clipping=0.05, zero_optimization=_zero(2, **OPT_CPU)),
                      "overlap-after-4": _config(2, zero_optimization=_zero(2, offload_optimizer={
                          "device": "cpu", "overlap_step": True, "overlap_step_warmup": 4}))}.items():
        engines: list = []
        losses, state, norm = train(STEPS, cfg, engines)
        out[name] = (losses, state, norm, engines[0].strategy._runner.early_ranges)
    return out


def test_without_clipping_the_cpu_optimizer_steps_during_backward():
    """Optimizer offload, stages 1-3, no clipping and no loss scaling: from the second step on, each
    bucket's range (stage 3: each group's pieces) is stepped as its gradients reach the host
    (offload/early_step.py), with the reference's losses and parameters (accumulation, parameter
    offload included); with clipping the step waits. And `overlap_step_warmup`'s synchronous steps."""
    ref, ref_state = reference_losses(STEPS)
    clip_ref, clip_state = reference_losses(STEPS, clip=0.05)
    out = run_world(_early_worker, 2)[0]
    for name in ("early", "stage1", "stage3", "stage3-param"):
        losses, state, norm, ranges = out[name]
        _assert_matches((losses, state, norm), ref, ref_state)
        assert ranges >= STEPS - 1, name  # each step after the first stepped during backward
    losses, state, norm, ranges = out["clipped"]
    _assert_matches((losses, state, norm), clip_ref, clip_state)
    assert ranges == 0
    # overlap_step_warmup: the first 4 steps synchronous (the 5th loss still sees all 4 updates), then
    # one step behind
    losses = out["overlap-after-4"][0]
    assert losses[:5] == pytest.approx(ref[:5], rel=1e-5, abs=1e-7)
    assert losses[5] != pytest.approx(ref[5], rel=1e-5, abs=1e-7)


def _bf16_and_overlap_worker(tmp: str):
    bf16 = {"bf16": {"enabled": True}}
    out = {}
    for name, zero in [("plain2", _zero(2)), ("opt2", _zero(2, **OPT_CPU)), ("plain3", _zero(3)),
                       ("opt3", _zero(3, **OPT_CPU, **PARAM_CPU)),
                       ("nvme3", _zero(3, **_nvme("offload_optimizer", tmp), **_nvme("offload_param", tmp)))]:
        out[name] = train(STEPS, _config(2, zero_optimization=zero, **bf16))[0]
    # the one-step-delayed update: different losses, the same descent
    out["overlap2"] = train(STEPS, _config(2, zero_optimization=_zero(2, offload_optimizer={
        "device": "cpu", "overlap_step": True})))[0]
    out["overlap3"] = train(STEPS, _config(2, zero_optimization=_zero(3, offload_optimizer={
        "device": "cpu", "overlap_step": True})))[0]
    # where the state lives, by memory_breakdown
    engines: list = []
    train(2, _config(2, zero_optimization=_zero(3, **_nvme("offload_optimizer", tmp), offload_param={
        "device": "nvme", "nvme_path": tmp, "max_in_cpu": 0})), engines)
    out["memory"] = engines[0].memory_breakdown()
    # DeepSpeed's rule for a client optimizer that is not a CPU one
    cfg = _config(2, zero_optimization=_zero(2, **OPT_CPU))
    del cfg["optimizer"]
    for force in (True, False):
        model = TinyMLP()
        try:
            lightspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()),
                                  config={**cfg, "zero_force_ds_cpu_optimizer": force})
            out[f"force={force}"] = "built"
        except Exception as err:
            out[f"force={force}"] = str(err)
    return out


def test_bf16_offload_tracks_bf16_and_overlapped_step_converges():
    ref, _ = reference_losses(STEPS)
    with tempfile.TemporaryDirectory(prefix="offload_test_") as tmp:
        out = run_world(_bf16_and_overlap_worker, 2, tmp)[0]
    # bf16: the offloaded step reads the same bf16 gradients and steps an fp32 master (on the host)
    assert out["opt2"] == pytest.approx(out["plain2"], rel=2e-2, abs=1e-2)
    assert out["opt3"] == pytest.approx(out["plain3"], rel=2e-2, abs=1e-2)
    assert out["nvme3"] == pytest.approx(out["opt3"], rel=1e-6)
    assert set(out["memory"]["nvme"]) == {"lp_params", "master_params", "optimizer_state"}
    assert "grads" in out["memory"]["cpu"]
    assert out["force=True"].startswith("zero_force_ds_cpu_optimizer: the optimizer is offloaded")
    assert out["force=False"] == "built"
    for key in ("overlap2", "overlap3"):
        losses = out[key]
        assert losses[0] == pytest.approx(ref[0], rel=1e-5)  # step 2's forward still sees the initial values
        assert losses != pytest.approx(ref, rel=1e-5)
        assert losses[-1] < losses[0]


def _checkpoint_worker(save_root: str, pairs: list[tuple[dict, dict]]):
    """For each (first, second): train `first` 4 steps and save; load into `second` and train 4 more.
    Returns, per pair, the losses of `first` continuing and those of `second` after the load."""
    out = []
    for i, (first, second) in enumerate(pairs):
        save_dir = os.path.join(save_root, f"ckpt{i}")
        engines: list = []
        train(4, first, engines)
        engines[0].save_checkpoint(save_dir, tag="t")
        cont = _continue(engines[0], 4)
        model = TinyMLP(seed=5)  # other initial values: everything must come from the checkpoint
        engine, *_ = lightspeed.initialize(model=model, model_parameters=model.parameters(), config=second)
        engine.load_checkpoint(save_dir, tag="t")
        out.append((cont, _continue(engine, 4)))
    return out


def _continue(engine, steps: int) -> list[float]:
    world, rank = dist.get_world_size(), dist.get_rank()
    x, y = regression_data(GLOBAL_BATCH * 8)
    micro = engine.train_micro_batch_size_per_gpu()
    losses = []
    for s in range(4, 4 + steps):
        base = s * GLOBAL_BATCH + rank * micro
        loss = engine(x[base:base + micro], y[base:base + micro])
        engine.backward(loss)
        engine.step()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append((t / world).item())
    return losses


def test_checkpoints_load_across_offload_settings():
    pairs = [(_zero(2, **OPT_CPU), _zero(3)), (_zero(3), _zero(3, **OPT_CPU, **PARAM_CPU)),
             (_zero(3, **OPT_CPU), _zero(1, **_nvme("offload_optimizer", "{tmp}")))]
    with tempfile.TemporaryDirectory(prefix="offload_test_") as tmp:
        for a, b in pairs:
            for z in (a, b):
                for block in z.values():
                    if isinstance(block, dict) and "nvme_path" in block:
                        block["nvme_path"] = tmp
        configs = [(_config(2, zero_optimization=a), _config(2, zero_optimization=b)) for a, b in pairs]
        results = run_world(_checkpoint_worker, 2, tmp, configs)[0]
    for (a, b), (cont, loaded) in zip(pairs, results):
        assert loaded == pytest.approx(cont, rel=1e-5), (a, b)


def _fp16_overflow_traces(zeros: list[dict], inject_at: set[int]):
    """Per ZeRO section: (scale used, scale after, skipped steps, the engine's global norm) per step,
    the last rank's loss made inf at `inject_at`."""
    world, rank = dist.get_world_size(), dist.get_rank()
    out = []
    for zero in zeros:
        model = TinyMLP()
        cfg = _config(world, zero_optimization=zero, fp16={"enabled": True, "initial_scale_power": 8,
                                                           "loss_scale_window": 2, "hysteresis": 1})
        engine, *_ = lightspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        micro = engine.train_micro_batch_size_per_gpu()
        x, y = regression_data(GLOBAL_BATCH * 6)
        trace = []
        for s in range(6):
            base = s * GLOBAL_BATCH + rank * micro
            loss = engine(x[base:base + micro].half(), y[base:base + micro])
            if s in inject_at and rank == world - 1:
                loss = loss * float("inf")
            engine.backward(loss)
            used = engine.loss_scale
            engine.step()
            trace.append((used, engine.loss_scale, engine.skipped_steps, round(engine.get_global_grad_norm(), 4)))
        out.append(trace)
    return out


def test_fp16_overflow_skips_the_offloaded_step_on_every_rank():
    zeros = [_zero(2), _zero(2, **OPT_CPU), _zero(3, **OPT_CPU, **PARAM_CPU)]
    traces = run_world(_fp16_overflow_traces, 2, zeros, {2, 3})
    assert traces[0] == traces[1]
    plain, *offloaded = traces[0]
    assert [t[2] for t in plain][-1] == 2
    for trace in offloaded:
        assert [t[:3] for t in trace] == [t[:3] for t in plain]
        assert [t[3] for t in trace] == pytest.approx([t[3] for t in plain], rel=1e-3)
