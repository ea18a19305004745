"""One-bit compressed communication on real gloo worlds: the compressed all-reduce against the exact
one, the optimizers' warm-up against Adam / LAMB, the bytes on the wire, the gradient reduction the
strategy leaves to the optimizer, stage and backend refusals, and checkpoint resume."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import lightspeed
from lightspeed.testing.run_world import run_world

pytestmark = pytest.mark.dist


# ---------------------------------------------------------------------------------------------- codec
def _codec_trace(n: int, calls: int):
    from lightspeed.comm.collectives import Communicator
    from lightspeed.comm.onebit import OneBitAllReduce

    comm = Communicator()
    codec = OneBitAllReduce(comm)
    world, rank = comm.world_size, comm.rank
    worker, server = codec.error_buffers(n)
    g = torch.Generator().manual_seed(rank)
    sum_out, sum_exact = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    first_err = None
    for t in range(calls):
        x = torch.randn(n, generator=g) * (1 + t % 3)
        exact = x.clone()
        dist.all_reduce(exact)
        exact /= world
        out = x.clone()
        codec(out, worker, server)
        if first_err is None:
            first_err = float((out - exact).norm() / exact.norm())
        sum_out += out.double()
        sum_exact += exact.double()
    # telescoping identity of error feedback: sum(out) = sum(exact) - mean_r(worker_r) - server (gathered)
    w_all = torch.empty(world * worker.numel())
    dist.all_gather_into_tensor(w_all, worker)
    s_all = torch.empty(world * server.numel())
    dist.all_gather_into_tensor(s_all, server)
    carried = (w_all.view(world, -1).double().mean(0) + s_all.double())[:n]
    same = torch.empty(world * n)
    dist.all_gather_into_tensor(same, sum_out.float())
    return {"identity": float((sum_out + carried - sum_exact).abs().max()),
            "scale": float(sum_exact.abs().max()),
            "drift": float((sum_out - sum_exact).norm() / sum_exact.norm()), "first": first_err,
            "identical_on_ranks": all(torch.equal(r, same.view(world, -1)[0]) for r in same.view(world, -1)),
            "padding_error": float(worker[n:].abs().max()) if worker.numel() > n else 0.0,
            "bytes": comm.stats.bytes["onebit_all_reduce"], "wire": codec.wire_bytes(n)}


@pytest.mark.parametrize("world,n", [(2, 1000), (4, 4099)])
def test_compressed_all_reduce_within_the_error_feedback_bound(world, n):
    calls = 30
    for r in run_world(_codec_trace, world, n, calls):
        # what the compressed sums miss is exactly what the error buffers carry (up to fp32 rounding)
        assert r["identity"] < 1e-4 * r["scale"]
        assert r["identical_on_ranks"] and r["padding_error"] == 0.0
        # one call is coarse; error feedback makes the running sum converge to the exact one
        assert r["drift"] < r["first"] / 2
        assert r["bytes"] == calls * r["wire"] and r["wire"] * 16 < 4 * n


# ---------------------------------------------------------------------------------------------- engine runs
class _Model(torch.nn.Module):
    def __init__(self, width: int = 64):
        super().__init__()
        g = torch.Generator().manual_seed(7)
        self.l1, self.l2, self.l3 = (torch.nn.Linear(16, width), torch.nn.Linear(width, width),
                                     torch.nn.Linear(width, 4))
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)

    def forward(self, x, y):
        h = torch.tanh(self.l2(torch.tanh(self.l1(x))))
        return torch.nn.functional.mse_loss(self.l3(h).float(), y.float())


def _data(n: int):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, 16, generator=g)
    return x, torch.sin(x[:, :4] * 2) + 0.05 * torch.randn(n, 4, generator=g)


def _config(optimizer: dict, **extra) -> dict:
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "steps_per_print": 10_000,
            "optimizer": optimizer, **extra}


def _train(config: dict, steps: int, *, engine=None, start: int = 0, save: str | None = None, save_at: int = -1):
    world, rank = dist.get_world_size(), dist.get_rank()
    if engine is None:
        engine, *_ = lightspeed.initialize(model=_Model(), config=config)
    x, y = _data(4 * world * (start + steps))
    dtype = next(engine.module.parameters()).dtype
    losses, wire, reduce_bytes = [], [], []
    for i in range(start, start + steps):
        if i == save_at:
            engine.save_checkpoint(save, tag="t")
        b = (i * world + rank) * 4
        engine.comm.stats.reset()
        loss = engine(x[b:b + 4].to(dtype), y[b:b + 4])
        engine.backward(loss)
        engine.step()
        t = loss.detach().float().clone()
        dist.all_reduce(t)
        losses.append((t / world).item())
        wire.append(engine.comm.stats.total_bytes())
        reduce_bytes.append(engine.comm.stats.bytes.get("all_reduce", 0))
    return {"losses": losses, "bytes": wire, "all_reduce_bytes": reduce_bytes, "engine": None}


WARMUP = {
    "onebit-adam": ({"type": "OneBitAdam", "params": {"lr": 3e-3, "freeze_step": 100, "weight_decay": 0.01}},
                    {"type": "Adam", "params": {"lr": 3e-3, "bias_correction": False, "weight_decay": 0.01}}),
    "zero-one-adam": ({"type": "ZeroOneAdam", "params": {"lr": 3e-3, "var_freeze_step": 100,
                                                         "var_update_scaler": 100}},
                      {"type": "Adam", "params": {"lr": 3e-3, "bias_correction": False}}),
    "onebit-lamb": ({"type": "OneBitLamb", "params": {"lr": 3e-3, "freeze_step": 100, "weight_decay": 0.01}},
                    {"type": "Lamb", "params": {"lr": 3e-3, "bias_correction": False, "weight_decay": 0.01}}),
}


def _warmup_pairs(prec: dict, steps: int):
    return {name: (_train(_config(onebit, **prec), steps)["losses"], _train(_config(ref, **prec), steps)["losses"])
            for name, (onebit, ref) in WARMUP.items()}


PRECISIONS = {"fp32": {}, "bf16": {"bf16": {"enabled": True}}}


def _warmup_pairs_all(steps: int):
    return {key: _warmup_pairs(prec, steps) for key, prec in PRECISIONS.items()}


@pytest.fixture(scope="module")
def warmup_pairs():
    return run_world(_warmup_pairs_all, 2, 8)[0]  # both precisions in one world


@pytest.mark.parametrize("prec", list(PRECISIONS))
def test_warmup_is_the_uncompressed_optimizer(prec, warmup_pairs):
    """Before compression starts: Adam (LAMB) without bias correction, the gradients all-reduced exactly."""
    for name, (got, want) in warmup_pairs[prec].items():
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6), name


BYTES = {
    "onebit-adam": ({"type": "OneBitAdam", "params": {"lr": 3e-3, "freeze_step": 4}}, 5),
    "zero-one-adam": ({"type": "ZeroOneAdam", "params": {"lr": 3e-3, "var_freeze_step": 4, "var_update_scaler": 2,
                                                         "local_step_scaler": 2, "local_step_clipper": 4}}, 16),
    "onebit-lamb": ({"type": "OneBitLamb", "params": {"lr": 3e-3, "freeze_step": 4}}, 5),
}


def _bytes_cases(steps: int):
    out = {"adam": _train(_config({"type": "Adam", "params": {"lr": 3e-3}}), steps)}
    out.update({name: _train(_config(opt), steps) for name, (opt, _) in BYTES.items()})
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_bytes_on_the_wire_after_warmup(world):
    steps, after = 16, 8  # warm-up (and 0/1 Adam's variance phase) is over by step 8
    runs = run_world(_bytes_cases, world, steps)[0]
    adam = runs["adam"]
    adam_per_step = sum(adam["bytes"][after:]) / (steps - after)
    for name, (_, factor) in BYTES.items():
        comp = runs[name]
        comp_per_step = sum(comp["bytes"][after:]) / (steps - after)
        assert comp_per_step * factor <= adam_per_step, (name, comp_per_step, adam_per_step)
        assert sum(comp["all_reduce_bytes"][after:]) == 0, name  # the strategy reduces no gradient
        assert comp["bytes"][0] == adam["bytes"][0], name  # the first step is exact: the same all-reduce
        assert all(b * 5 < adam_per_step for b in comp["bytes"][after:]), name
        assert all(torch.isfinite(torch.tensor(comp["losses"]))), name


def _fp16_cases():
    fp16 = {"enabled": True, "initial_scale_power": 8}
    return {name: _train(_config(opt, fp16=fp16), 12)["losses"] for name, (opt, _) in BYTES.items()}


def test_fp16_runs_past_warmup():
    ranks = run_world(_fp16_cases, 2)
    for name, losses in ranks[0].items():
        assert ranks[1][name] == losses and all(torch.isfinite(torch.tensor(losses))), name


# ---------------------------------------------------------------------------------------------- refusals
def _refused(config: dict):
    try:
        lightspeed.initialize(model=_Model(), config=config)
    except Exception as err:  # noqa: BLE001 (the message is the result)
        return f"{type(err).__name__}: {err}"
    return None


REFUSAL_CONFIGS = {
    **{f"stage{stage}": _config({"type": "OneBitAdam", "params": {}}, zero_optimization={"stage": stage})
       for stage in (1, 2, 3)},
    "nccl_on_gloo": _config({"type": "ZeroOneAdam", "params": {"comm_backend_name": "nccl"}}),
    "compressed": _config({"type": "OneBitLamb", "params": {"comm_backend_name": "compressed"}}),
}


def _refusals():
    return {name: _refused(cfg) for name, cfg in REFUSAL_CONFIGS.items()}


@pytest.fixture(scope="module")
def refusals():
    return run_world(_refusals, 2)[0]  # every configuration in one world


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_other_zero_stages_are_refused(stage, refusals):
    msg = refusals[f"stage{stage}"]
    assert msg and "zero_optimization.stage" in msg and "stage 0 only" in msg


def test_backend_names(refusals):
    on_gloo = refusals["nccl_on_gloo"]
    assert on_gloo and "comm_backend_name" in on_gloo and "'gloo'" in on_gloo
    assert refusals["compressed"] is None


# ---------------------------------------------------------------------------------------------- checkpoints
RESUME = {
    "onebit-adam": {"type": "OneBitAdam", "params": {"lr": 3e-3, "freeze_step": 3}},
    "zero-one-adam": {"type": "ZeroOneAdam", "params": {"lr": 3e-3, "var_freeze_step": 3, "var_update_scaler": 1,
                                                        "local_step_scaler": 2}},
    "onebit-lamb": {"type": "OneBitLamb", "params": {"lr": 3e-3, "freeze_step": 3, "weight_decay": 0.01}},
}


def _resume(path: str, prec: dict):
    out = {}
    for name, optimizer in RESUME.items():
        config = _config(optimizer, **prec)
        full = _train(config, 12, save=f"{path}/{name}", save_at=7)
        engine, *_ = lightspeed.initialize(model=_Model(), config=config)
        engine.load_checkpoint(f"{path}/{name}", tag="t")
        resumed = _train(config, 5, engine=engine, start=7)
        out[name] = (full["losses"][7:], resumed["losses"])
    return out


@pytest.mark.parametrize("prec", [{}, {"fp16": {"enabled": True, "initial_scale_power": 8}}], ids=["fp32", "fp16"])
def test_resume_at_the_same_world_size_is_bitwise(prec, tmp_path):
    for name, (full, resumed) in run_world(_resume, 2, str(tmp_path), prec)[0].items():
        assert resumed == full, name


def _save_only(optimizer: dict, path: str):
    return _train(_config(optimizer), 8, save=path, save_at=7)["losses"]


def _load_other_world(optimizer: dict, path: str):
    engine, *_ = lightspeed.initialize(model=_Model(), config=_config(optimizer))
    engine.load_checkpoint(path, tag="t")
    reset = engine.optimizer._errors is None
    return _train(_config(optimizer), 4, engine=engine, start=7)["losses"], reset


def test_resume_at_another_world_size_restarts_error_feedback(tmp_path):
    path = str(tmp_path / "ckpt")
    run_world(_save_only, 2, RESUME["onebit-adam"], path)
    losses, reset = run_world(_load_other_world, 4, RESUME["onebit-adam"], path)[0]
    assert reset and all(torch.isfinite(torch.tensor(losses)))


# ---------------------------------------------------------------------------------------------- 0/1 Adam's schedule
def _zero_one_schedule():
    opt = {"type": "ZeroOneAdam", "params": {"lr": 3e-3, "var_freeze_step": 8, "var_update_scaler": 2,
                                             "local_step_scaler": 2, "local_step_clipper": 4}}
    run = _train(_config(opt), 16)
    kinds = []
    for total, reduce in zip(run["bytes"], run["all_reduce_bytes"]):
        kinds.append("E" if reduce and total == reduce else "C" if total and not reduce else "L" if not total else "?")
    return "".join(kinds)


def test_zero_one_adam_follows_deepspeeds_schedule():
    # steps 1-9: the variance is updated on exact steps (E: the strategy all-reduces), every step while the
    # interval is 1, then every 2nd, then every 4th (var_update_scaler 2); the others compress the
    # gradients (C). From step 10 the variance is frozen: local steps (L) with a compressed
    # synchronization (C) every 1, 1, then 2, then 4 steps (local_step_scaler 2, clipper 4)
    assert run_world(_zero_one_schedule, 2)[0] == "EECECECEC" + "CCCLLLC"
