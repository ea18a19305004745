"""optimizer.cuda_graph (zero/graphed_step.py): the fused ZeRO step's launches captured once and replayed.

On CPU the graph is tests/unit/zero/graph_standin.py's stand-in over the Triton kernels run by
TRITON_INTERPRET=1: at ZeRO stages 0-3, one process, bf16 with a warm-up/decay LR schedule and active
clipping, the option on gives the option off's parameters and losses bitwise, captures once and replays
the rest; a checkpoint load makes the next steps capture again, still bitwise. The refusals name the key.
On CUDA (skipped without) the real torch.cuda.CUDAGraph path against the uncaptured step.
"""
from __future__ import annotations

import os

import pytest
import torch

import lightspeed
from lightspeed.config.errors import ConfigError

from tests.unit.zero.graph_standin import StandinGraph, use_standin

STEPS = 5
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
needs_kernels = pytest.mark.skipif(not INTERPRET, reason="the Triton kernels need TRITON_INTERPRET=1 on CPU")


def _config(stage: int, graphed: bool, **extra) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 8, "gradient_clipping": 0.05, "bf16": {"enabled": True},
           "zero_optimization": {"stage": stage}, "steps_per_print": 1000,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}, "cuda_graph": graphed},
           "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 2e-2,
                                                               "warmup_num_steps": 3, "total_num_steps": 12}}}
    cfg.update(extra)
    return cfg


def _engine(cfg: dict, device: str = "cpu"):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2)).to(device)
    engine, *_ = lightspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg,
                                       dist_init_required=False)
    return engine


def _train(engine, steps: range, device: str = "cpu") -> list[float]:
    losses = []
    dtype = next(engine.module.parameters()).dtype
    for step in steps:
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 8, generator=gen), torch.randn(8, 2, generator=gen)
        loss = torch.nn.functional.mse_loss(engine(x.to(device, dtype)).float(), y.to(device))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _params(engine) -> list[torch.Tensor]:
    return [p.detach().float().cpu().clone() for p in engine.module.parameters()]


@needs_kernels
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_captured_step_is_the_uncaptured_step_bitwise(stage, monkeypatch, tmp_path):
    use_standin(monkeypatch)
    runs = {}
    for graphed in (False, True):
        engine = _engine(_config(stage, graphed))
        lrs = []
        for step in range(STEPS):
            lrs.append(engine.optimizer.param_groups[0]["lr"])
            runs.setdefault(graphed, []).extend(_train(engine, range(step, step + 1)))
        runs[graphed] = (runs[graphed], lrs, _params(engine))
        if graphed:
            # a layout's first step runs eagerly, its second captures; every step after replays
            assert len(StandinGraph.made) == 1 and StandinGraph.made[0].replays == STEPS - 1
    (losses, lrs, params), (ref_losses, ref_lrs, ref_params) = runs[True], runs[False]
    assert losses == ref_losses and lrs == ref_lrs and len(set(lrs)) >= 3  # the schedule moved
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params))


@needs_kernels
@pytest.mark.parametrize("family", ["adam", "adamw", "lion", "adagrad"])
def test_each_family_replayed_is_its_step(family, monkeypatch):
    """GraphedStep straight on a fused optimizer (two parameters, one with a bf16 copy to write): with the
    lr, the coefficient and the step count changing, the replays give `step()`'s bits."""
    from lightspeed.ops.adagrad import FusedAdagrad
    from lightspeed.ops.adam import FusedAdam
    from lightspeed.ops.lion import FusedLion
    from lightspeed.zero.graphed_step import GraphedStep

    use_standin(monkeypatch)
    make = {"adam": lambda p: FusedAdam(p, lr=1e-2, weight_decay=0.1, adam_w_mode=False),
            "adamw": lambda p: FusedAdam(p, lr=1e-2, weight_decay=0.1), "lion": lambda p: FusedLion(p, lr=1e-2),
            "adagrad": lambda p: FusedAdagrad(p, lr=1e-2, lr_decay=0.1, weight_decay=0.1)}[family]
    torch.manual_seed(0)
    params = [[torch.randn(37), torch.randn(300)] for _ in range(2)]
    params[1] = [p.clone() for p in params[0]]
    outs = [{ps[1]: [(0, torch.zeros(300, dtype=torch.bfloat16))]} for ps in params]
    grads = [torch.randn(37).bfloat16(), torch.randn(300).bfloat16()]
    eager, captured = make(params[0]), make(params[1])
    graphed = GraphedStep(captured)
    for step in range(STEPS):
        for opt in (eager, captured):
            opt.param_groups[0]["lr"] = 1e-2 / (step + 1)
        coef = torch.tensor(0.5 + step)
        eager.step(grads=dict(zip(params[0], grads)), grad_scale=coef, lowp_out=outs[0])
        graphed.step(dict(zip(params[1], grads)), outs[1], coef, torch.device("cpu"))
        assert all(torch.equal(a, b) for a, b in zip(params[0], params[1]))
        assert torch.equal(outs[0][params[0][1]][0][1], outs[1][params[1][1]][0][1])
    assert StandinGraph.made[0].replays == STEPS - 1


@needs_kernels
def test_fp16_overflow_skips_before_the_replay(monkeypatch):
    """fp16 with a loss scale that overflows at first: the skipped steps are decided on the host before
    anything is replayed, and the run is the uncaptured one bitwise."""
    use_standin(monkeypatch)
    runs = {}
    for graphed in (False, True):
        engine = _engine(_config(2, graphed, bf16={"enabled": False},
                                 fp16={"enabled": True, "initial_scale_power": 19, "hysteresis": 1}))
        losses = _train(engine, range(STEPS + 3))
        runs[graphed] = (losses, engine.skipped_steps, _params(engine))
    assert 0 < runs[False][1] < STEPS and runs[True][:2] == runs[False][:2]
    assert all(torch.equal(a, b) for a, b in zip(runs[True][2], runs[False][2]))
    assert StandinGraph.made[0].replays == STEPS + 3 - runs[True][1] - 1


@needs_kernels
def test_a_checkpoint_load_captures_again(monkeypatch, tmp_path):
    use_standin(monkeypatch)
    runs = {}
    for graphed in (False, True):
        engine = _engine(_config(2, graphed))
        _train(engine, range(3))
        engine.save_checkpoint(tmp_path / str(graphed), tag="t")
        first = _train(engine, range(3, STEPS))
        engine.load_checkpoint(tmp_path / str(graphed), tag="t")
        runs[graphed] = (first + _train(engine, range(3, STEPS)), _params(engine))
    assert runs[True][0] == runs[False][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[True][1], runs[False][1]))
    # captured at step 2; the load rebuilt the optimizer's launches and state: warm-up, then a new capture
    assert len(StandinGraph.made) == 2
    assert StandinGraph.made[0].replays == STEPS - 1 and StandinGraph.made[1].replays == STEPS - 3 - 1


def _world_two() -> dict:
    """One rank of a world of two (run_world): stages 2 and 3, the option off and on, each rank its own data."""
    import torch.distributed as dist

    from lightspeed.zero import graphed_step
    from tests.unit.zero.graph_standin import StandinGraph

    os.environ["LIGHTSPEED_OPS_BACKEND"] = "triton"
    graphed_step.GRAPH, graphed_step.GRAPH_DEVICE_TYPES = StandinGraph, frozenset({"cpu"})
    rank, out = dist.get_rank(), {}
    for stage in (2, 3):
        for graphed in (False, True):
            engine = _engine(_config(stage, graphed))
            assert engine.dp_world_size == 2
            out[stage, graphed] = (_train(engine, range(rank * 10, rank * 10 + STEPS)), _params(engine))
    out["replays"] = [g.replays for g in StandinGraph.made]
    return out


@needs_kernels
@pytest.mark.dist
def test_world_of_two_matches_bitwise():
    from lightspeed.testing.run_world import run_world

    for out in run_world(_world_two, 2):
        assert out["replays"] == [STEPS - 1, STEPS - 1]
        for stage in (2, 3):
            (losses, params), (ref_losses, ref_params) = out[stage, True], out[stage, False]
            assert losses == ref_losses and all(torch.equal(a, b) for a, b in zip(params, ref_params))


@pytest.mark.parametrize("extra, words", [
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}, "offload"),
    ({"optimizer": {"type": "Lamb", "params": {"lr": 1e-3}, "cuda_graph": True}}, "FusedLamb"),
    ({"bf16": {"enabled": True, "stochastic_rounding": True, "bf16_master_weights_and_grads": True,
               "bf16_optimizer_states": True}},
     "stochastic_rounding"),
    ({"optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}, "cuda_graph": True}}, "fused"),
    ({"optimizer": {"type": "Muon", "params": {"lr": 1e-3}, "cuda_graph": True}}, "Muon"),
    ({"zero_optimization": {"stage": 0}, "bf16": {"enabled": False},
      "optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3, "freeze_step": 2}, "cuda_graph": True}}, "OneBitAdam"),
])
def test_refusals_name_the_key(extra, words, monkeypatch):
    use_standin(monkeypatch)
    with pytest.raises(ConfigError, match=rf"optimizer\.cuda_graph.*{words}"):
        _engine(_config(2, True, **extra))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the engine takes the GPU")
def test_refused_off_cuda():
    with pytest.raises(ConfigError, match=r"optimizer\.cuda_graph: needs a CUDA device"):
        _engine(_config(1, True))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the real CUDA graph needs CUDA")
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_cuda_graph_matches_the_uncaptured_step(stage, monkeypatch):
    """On a GPU: torch.cuda.CUDAGraph capture and replay, bitwise the uncaptured fused step over STEPS
    steps with a changing learning rate and clipping."""
    from lightspeed.zero import graphed_step

    replays = []

    class Counted(graphed_step.CudaGraph):
        def replay(self):
            replays.append(self)
            super().replay()

    monkeypatch.setattr(graphed_step, "GRAPH", Counted)
    runs = {}
    for graphed in (False, True):
        engine = _engine(_config(stage, graphed), device="cuda")
        lrs = []
        for step in range(STEPS):
            lrs.append(engine.optimizer.param_groups[0]["lr"])
            runs.setdefault(graphed, []).extend(_train(engine, range(step, step + 1), "cuda"))
        runs[graphed] = (runs[graphed], lrs, _params(engine))
    assert len(replays) == STEPS - 1 and len(set(map(id, replays))) == 1  # one capture, replayed
    (losses, lrs, params), (ref_losses, ref_lrs, ref_params) = runs[True], runs[False]
    assert losses == ref_losses and lrs == ref_lrs and len(set(lrs)) >= 3
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params))
