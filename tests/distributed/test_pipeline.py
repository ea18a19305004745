"""Pipeline training on real gloo processes against real DeepSpeed 0.19.8's pipeline engine: the loss
`train_batch` returns at each step, for the runs of tests/fixtures/deepspeed_pipeline (made by that
DeepSpeed with its script, on the same seeds and data), and the weights after training.

The DeepSpeed trajectory is also the one-process reference: the model's numerics do not depend on how
it is split, so one process (pp1), pp2 and pp4, each schedule, ZeRO 1-3, data parallelism and tensor
parallelism all follow it (fp32; 1F1B bit for bit), ZeRO-3 also at pp2 x dp2 (its parameters
partitioned over dp). DeepSpeed's ZeRO-0 pipeline clips each stage by
its own gradient norm (the fixture README), lightspeed by the global one, so the trajectories compared
here are DeepSpeed's ZeRO-1 ones. Also: eval_batch, bf16, and what the pipeline engine refuses (also zero.Init over the stages)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from lightspeed.testing.run_world import run_world

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

FIXTURES = Path(__file__).parents[1] / "fixtures" / "deepspeed_pipeline"
TP_PLAN = {"autotp_size": 2, "partition_config": {"use_default_specs": False, "layer_specs": [
    {"patterns": [r".*\.fc1\.weight$", r".*\.fc1\.bias$"], "partition_type": "column"},
    {"patterns": [r".*\.fc2\.weight$"], "partition_type": "row"}]}}

Z3_RELEASE = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0}


def _expected(run: str) -> dict:
    return json.loads((FIXTURES / run / "expected.json").read_text())


def _train(run: str, *, pp: int | None = None, schedule: str = "1f1b", stage: int | None = None,
           virtual: int | None = None, extra: dict | None = None, eval_after: bool = False,
           engines: list | None = None):
    """Train fixture run `run` through lightspeed; returns (losses, parts, final state, eval loss); the
    engine is appended to `engines` when given."""
    sys.path.insert(0, str(FIXTURES))
    import model as M

    import lightspeed
    from lightspeed.parallel.pipeline import LayerSpec, PipelineModule, TiedLayerSpec

    exp = _expected(run)
    cfg = dict(exp["config"], pipeline={"schedule": schedule, **({"virtual_stages": virtual} if virtual else {})})
    if stage is not None:
        cfg["zero_optimization"] = {"stage": stage}
    cfg.update(extra or {})
    tied = exp["tied"]
    net = PipelineModule(M.layer_specs(LayerSpec, TiedLayerSpec, tied), num_stages=pp or exp["pipeline_stages"],
                         loss_fn=M.loss_fn(tied), partition_method=exp["partition_method"], seed_layers=True,
                         seed_fn=M.seed_layer, base_seed=M.BASE_SEED)
    engine, *_ = lightspeed.initialize(model=net, config=cfg,
                                       model_parameters=[p for p in net.parameters() if p.requires_grad])
    if engines is not None:
        engines.append(engine)
    dp_rank, gas = engine.groups.dp_rank, exp["gradient_accumulation_steps"]

    def data(step):
        return iter([M.batches(step, m, exp["micro_batch"], exp["data_seed"], dp_rank, tied) for m in range(gas)])

    losses = [float(engine.train_batch(data(step))) for step in range(exp["steps"])]
    evaluated = None
    if eval_after:
        step = exp["eval_batch_after_training"]["data_step"]
        per_micro = engine.eval_batch(data(step), reduce_output=None)  # the last stage's list, None elsewhere
        logits = engine.eval_batch(data(step), compute_loss=False)  # the last stage's outputs
        evaluated = (float(engine.eval_batch(data(step))), None if per_micro is None else [float(x) for x in per_micro],
                     None if logits is None else tuple(logits.shape))
    state = {k: v.detach().float().clone() for k, v in net.state_dict().items()}
    if extra and "fp16" in extra:
        return losses, engine.skipped_steps, state, None
    return losses, net.parts, state, evaluated


def _close(got, want, tol):
    assert len(got) == len(want)
    assert max(abs(a - b) for a, b in zip(got, want)) <= tol, (got, want)


def _final_params(run: str) -> dict:
    stages = torch.load(FIXTURES / run / "params.pt", weights_only=True)  # {"stage0": {"initial", "final"}, ...}
    return {k: v for stage in stages.values() for k, v in stage["final"].items()}


def _world2():
    import lightspeed
    from lightspeed.runtime.pipe_engine import PipelineError

    out = {}
    engines = []
    for schedule in ("1f1b", "gpipe", "interleaved_1f1b", "interleaved_zero_bubble", "zbv_zero_bubble"):
        losses, parts, state, ev = _train("A_pp2_z1", schedule=schedule, eval_after=schedule == "1f1b",
                                          engines=engines)
        out[schedule] = (losses, parts)
        if schedule == "1f1b":
            out["eval"], out["state"] = ev, state
    out["z2"] = _train("A_pp2_z1", stage=2)[0]
    out["z3"] = _train("A_pp2_z1", stage=3)[0]
    out["interleaved3"] = _train("A_pp2_z1", schedule="interleaved_1f1b", virtual=3, stage=2)[0]
    out["tied"] = _train("B_tied_pp2_z1")[0]
    out["tied_zbv"] = _train("B_tied_pp2_z1", schedule="zbv_zero_bubble")[0]
    out["bf16"] = _train("B_tied_pp2_z1", extra={"bf16": {"enabled": True}})[0]  # token inputs: no cast needed
    # fp16 from a loss scale that overflows: every stage skips the same steps (the decision is agreed over pp)
    losses, skipped, _, _ = _train("B_tied_pp2_z1", extra={"fp16": {"enabled": True, "initial_scale_power": 40}})
    out["fp16"] = (losses, skipped)
    out["checkpointed"] = _train("A_pp2_z1", extra={"pipeline": {"activation_checkpoint_interval": 1}})[0]
    # refused: the per-micro-batch API, and tied modules at ZeRO-2 (summed over stages inside every backward)
    sys.path.insert(0, str(FIXTURES))
    import model as M

    from lightspeed.parallel.pipeline import LayerSpec, PipelineModule, TiedLayerSpec

    net = PipelineModule(M.layer_specs(LayerSpec, TiedLayerSpec, False), num_stages=2, loss_fn=M.loss_fn(False))
    engine, *_ = lightspeed.initialize(model=net, config={"train_micro_batch_size_per_gpu": 2,
                                                          "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    errors = []
    for call in (lambda: engine(torch.zeros(2, 12)), lambda: engine.backward(torch.zeros(())), engine.step):
        try:
            call()
        except PipelineError as err:
            errors.append(str(err))
    try:
        engine.train_batch(iter([torch.zeros(2, 12)]))
    except ValueError as err:
        errors.append(str(err))
    tied = PipelineModule(M.layer_specs(LayerSpec, TiedLayerSpec, True), num_stages=2, loss_fn=M.loss_fn(True))
    try:
        lightspeed.initialize(model=tied, config={"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
                                                  "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    except NotImplementedError as err:
        errors.append(str(err))
    try:  # the ZBV engine's eval: torch's schedule would attempt its backward hand-offs
        engines[-1].eval_batch(iter([]))
    except NotImplementedError as err:
        errors.append(str(err))
    out["errors"] = errors
    return out


def _world4():
    out = {"dp2": _train("A_pp2_dp2_z1")[0], "dp2_z2": _train("A_pp2_dp2_z1", stage=2)[0],
           "tied_dp2": _train("B_tied_pp2_dp2_z1")[0],
           "pp4": _train("A_pp2_z1", pp=4)[:2], "pp4_zbv": _train("A_pp2_z1", pp=4, schedule="zbv_zero_bubble")[:2],
           "pp4_z2": _train("A_pp2_z1", pp=4, stage=2)[0],
           "tp2": _train("B_tied_pp2_z1", extra={"tensor_parallel": TP_PLAN})[0]}
    # ZeRO-3 at pp2 x dp2: each layer's parameters partitioned over dp, gathered around its forward and
    # backward and released after (no persistent group, none kept for reuse); 1F1B, and ZBV (two stages
    # a rank, split backward: the input half recomputes the checkpointed layers outside a bracket)
    engines = []
    losses, _, _, out["dp2_z3_eval"] = _train("A_pp2_dp2_z1", eval_after=True, extra={"zero_optimization": Z3_RELEASE},
                                              engines=engines)
    out["dp2_z3"] = losses
    # every chunk's layers ran as a forward of the whole model, each micro-batch's backward from the
    # trace's backward part: the recorded module order still holds (prefetching on) after the last step
    out["dp2_z3_trace_complete"] = engines[0].strategy.trace_complete()
    zbv = {"schedule": "zbv_zero_bubble", "activation_checkpoint_interval": 1}
    out["dp2_z3_zbv_checkpointed"] = _train("A_pp2_dp2_z1", extra={"zero_optimization": Z3_RELEASE, "pipeline": zbv})[0]
    sys.path.insert(0, str(FIXTURES))
    import model as M

    import lightspeed
    from lightspeed.parallel.pipeline import LayerSpec, PipelineModule, TiedLayerSpec

    tied = PipelineModule(M.layer_specs(LayerSpec, TiedLayerSpec, True), num_stages=2, loss_fn=M.loss_fn(True))
    try:
        lightspeed.initialize(model=tied, config={"train_micro_batch_size_per_gpu": 2,
                                                  "zero_optimization": {"stage": 3},
                                                  "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
        out["tied_z3"] = None
    except NotImplementedError as err:
        out["tied_z3"] = str(err)
    try:  # zero.Init partitioning over the world: the stages' layers differ, refused before any collective
        with lightspeed.zero.Init():
            PipelineModule(M.layer_specs(LayerSpec, TiedLayerSpec, False), num_stages=2, loss_fn=M.loss_fn(False))
        out["init_world"] = None
    except ValueError as err:
        out["init_world"] = str(err)
    return out


def test_one_process_follows_deepspeed():
    [(losses, parts, _, _)] = run_world(_train, 1, "A_pp2_z1", pp=1)
    assert parts == [0, 8]
    _close(losses, _expected("A_pp2_z1")["losses"], 1e-6)


def test_pp2_schedules_stages_and_tied_follow_deepspeed():
    ranks = run_world(_world2, 2)
    out = ranks[0]
    assert ranks[1]["fp16"] == out["fp16"]  # the same steps skipped, the same loss, on both stages
    want = _expected("A_pp2_z1")
    assert out["1f1b"] == (want["losses"], want["parts"])  # DeepSpeed's schedule: bit for bit
    for schedule in ("gpipe", "interleaved_1f1b", "interleaved_zero_bubble", "zbv_zero_bubble"):
        _close(out[schedule][0], want["losses"], 1e-6)
    assert out["interleaved_1f1b"][1] == [0, 2, 4, 6, 8]
    for key in ("z2", "z3", "interleaved3"):
        _close(out[key], want["losses"], 1e-6)
    _close(out["tied"], _expected("B_tied_pp2_z1")["losses"], 1e-5)
    _close(out["tied_zbv"], _expected("B_tied_pp2_z1")["losses"], 1e-5)
    _close(out["bf16"], _expected("B_tied_pp2_z1")["losses"], 0.2)
    assert out["fp16"][1] >= 2 and all(math.isfinite(x) for x in out["fp16"][0])
    assert out["checkpointed"] == want["losses"]
    value, per_micro, logits = out["eval"]
    assert value == pytest.approx(want["eval_batch_after_training"]["value"], abs=1e-6)
    assert per_micro is None and logits is None  # rank 0 holds the first stage
    value, per_micro, logits = ranks[1]["eval"]
    assert value == out["eval"][0] and sum(per_micro) / 4 == pytest.approx(value, abs=1e-6) and logits == (8, 10)
    final = _final_params("A_pp2_z1")
    for name, value in out["state"].items():  # rank 0 holds stage 0's layers
        torch.testing.assert_close(value, final[name].float(), atol=1e-6, rtol=0)
    errors = out["errors"]
    assert len(errors) == 6
    assert all("Only train_batch() is accessible in pipeline mode." == e for e in errors[:3])
    assert "pair (inputs, labels)" in errors[3]
    assert "zero_optimization.stage=2 with tied modules" in errors[4]
    assert "pipeline.schedule 'zbv_zero_bubble'" in errors[5]


def test_pp4_dp2_and_tp2_follow_deepspeed():
    ranks = run_world(_world4, 4)
    out = ranks[0]
    _close(out["dp2"], _expected("A_pp2_dp2_z1")["losses"], 1e-6)
    _close(out["dp2_z2"], _expected("A_pp2_dp2_z1")["losses"], 1e-6)
    _close(out["tied_dp2"], _expected("B_tied_pp2_dp2_z1")["losses"], 1e-5)
    want = _expected("A_pp2_z1")["losses"]
    assert out["pp4"][1] == [0, 2, 4, 6, 8]
    _close(out["pp4"][0], want, 1e-6)
    _close(out["pp4_zbv"][0], want, 1e-6)
    _close(out["pp4_z2"], want, 1e-6)
    _close(out["tp2"], _expected("B_tied_pp2_z1")["losses"], 1e-5)
    want = _expected("A_pp2_dp2_z1")
    _close(out["dp2_z3"], want["losses"], 1e-6)
    _close(out["dp2_z3_zbv_checkpointed"], want["losses"], 1e-6)
    assert out["dp2_z3_eval"][0] == pytest.approx(want["eval_batch_after_training"]["value"], abs=1e-6)
    assert "zero_optimization.stage=3 with tied modules" in out["tied_z3"]
    assert all(rank["dp2_z3_trace_complete"] for rank in ranks)
    assert all("zero.Init over a PipelineModule of 2 stages" in rank["init_world"] for rank in ranks)
