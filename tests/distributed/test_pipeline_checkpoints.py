"""Checkpoints of pipeline-parallel engines on real gloo processes, in three worlds (2, 1 and 4 ranks),
over the DeepSpeed pipeline fixtures' models and data (tests/fixtures/deepspeed_pipeline).

World 2: model A at pp2 (ZeRO-1) trains 3 steps, saves lightspeed's mesh layout, and goes on for 3
more (the uninterrupted reference); a second pp2 engine loads the tag and must continue with the same
losses; model B (tied embedding, ZeRO-1: its state partitioned over dp x pp) saves at pp2; DeepSpeed's
own pipeline checkpoints `A_pp2_z1` and `B_tied_pp2_z0` load into the pp2 engine (A: steps 4-6 give
DeepSpeed's `losses_after_resume`; B: the loaded weights and Adam state equal the files', as DeepSpeed's
ZeRO-0 clipping norm differs from lightspeed's, so later losses would not compare).
World 1: the pp2 tag loads at pp1 and continues as the pp2 run did; a pp1 run saves after 3 steps, and
so does the same model as a plain nn.Sequential through the non-pipeline engine;
DeepSpeed's `A_pp2_z1` loads at pp1 and reproduces `losses_after_resume`; B's pp2 tag loads at pp1.
World 4: the pp1 tag loads at pp4 and the pp2 tag at pp2 x dp2 (both data-parallel ranks fed rank 0's
data, so the averaged gradient is the pp2 run's), each continuing with its reference's losses;
model B at ZeRO-0 and pp2 x dp2 saves and loads at pp4 (ZeRO-1) with the consolidated weights; model B
at pp2 x tp2 saves and resumes at pp2 x tp2 and at pp2 x dp2;
the plain model's tag loads at pp2 x dp2 too (a non-pipeline checkpoint of the same names); a load
whose RNG file of rank 1 is damaged fails on every rank and changes nothing; DeepSpeed's
`A_pp2_dp2_z1` loads at pp2 x dp2 and reproduces its `losses_after_resume`; model A at ZeRO-3 and
pp2 x dp2 saves after 3 steps and resumes at ZeRO-3 and at ZeRO-1, following DeepSpeed's 6 steps,
and refuses to save in DeepSpeed's layout (its pipeline engine has no ZeRO-3).
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from lightspeed.testing.run_world import run_world

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "deepspeed_pipeline")
TOL = 1e-6
# ResidualMLP's fc1 column-parallel, fc2 row-parallel (model B's blocks)
TP_PLAN = {"autotp_size": 2, "partition_config": {"use_default_specs": False, "layer_specs": [
    {"patterns": [r".*\.fc1\.weight$", r".*\.fc1\.bias$"], "partition_type": "column"},
    {"patterns": [r".*\.fc2\.weight$"], "partition_type": "row"}]}}


def _expected(run: str) -> dict:
    with open(os.path.join(FIXTURES, run, "expected.json")) as f:
        return json.load(f)


def _engine(run: str, pp: int, dp: int, *, tied: bool | None = None, stage: int | None = None, fmt: str | None = None,
            extra: dict | None = None):
    sys.path.insert(0, FIXTURES)
    import model as M  # the fixtures' models and data

    import lightspeed
    from lightspeed.parallel.pipeline import LayerSpec, PipelineModule, TiedLayerSpec

    exp = _expected(run)
    tied = exp["tied"] if tied is None else tied
    cfg = json.loads(json.dumps(exp["config"]))
    cfg["train_batch_size"] = cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"] * dp
    if stage is not None:
        cfg["zero_optimization"] = {"stage": stage}
    if fmt is not None:
        cfg["checkpoint"] = {"format": fmt}
    cfg.update(extra or {})
    net = PipelineModule(M.layer_specs(LayerSpec, TiedLayerSpec, tied), num_stages=pp, loss_fn=M.loss_fn(tied),
                         partition_method=exp["partition_method"], seed_layers=True, seed_fn=M.seed_layer,
                         base_seed=M.BASE_SEED)
    engine, *_ = lightspeed.initialize(model=net, config=cfg,
                                       model_parameters=[p for p in net.parameters() if p.requires_grad])
    return engine


def _train(engine, run: str, steps, *, tied: bool, data_rank: int = 0) -> list[float]:
    import model as M

    exp = _expected(run)
    out = []
    for step in steps:
        batch = [M.batches(step, m, exp["micro_batch"], exp["data_seed"], data_rank, tied)
                 for m in range(exp["gradient_accumulation_steps"])]
        out.append(float(engine.train_batch(iter(batch))))
    return out


def _deepspeed_tag(run: str) -> str:
    return os.path.join(FIXTURES, run, "ckpt")


def _deepspeed_file(path: str):
    from lightspeed.checkpoint.deepspeed_pickle import load_deepspeed_file

    return load_deepspeed_file(path)


def _loaded_vs_deepspeed(engine, run: str) -> dict:
    """The largest difference between the engine's weights / Adam state and DeepSpeed's files, after
    loading DeepSpeed's checkpoint of `run` (ZeRO-0: the stage file's torch optimizer state, indexed in
    the stage module's parameter order)."""
    tag = os.path.join(_deepspeed_tag(run), "global_step3")
    names = [n for n, _ in engine.module.named_parameters()]
    weights = 0.0
    for name, p in engine.module.named_parameters():
        layer, rest = (("00", name[len("tied_modules.embed."):]) if name.startswith("tied_modules.")
                       else (f"{int(name.split('.', 1)[0]):02d}", name.split(".", 1)[1]))
        saved = _deepspeed_file(os.path.join(tag, f"layer_{layer}-model_states.pt"))[rest]
        weights = max(weights, (p.detach() - saved).abs().max().item())
    optimizer = _deepspeed_file(os.path.join(tag, f"mp_rank_{engine.stage_id:02d}_model_states.pt"))["optimizer"]
    state = {f.name: engine.optimizer.state[f.owner] for f in engine.strategy.fragments()}
    moments, steps = 0.0, set()
    for i, name in enumerate(names):
        for key in ("exp_avg", "exp_avg_sq"):
            moments = max(moments, (state[name][key].reshape(-1) - optimizer["state"][i][key].reshape(-1)).abs().max().item())
        steps.add(int(state[name]["step"]))
    return {"weights": weights, "moments": moments, "steps": sorted(steps), "names": names,
            "global_steps": engine.global_steps}


def _world2(tmp: str):
    import torch.distributed as dist

    out = {}
    a = _engine("A_pp2_z1", 2, 1)
    out["A_first"] = _train(a, "A_pp2_z1", range(3), tied=False)
    a.save_checkpoint(os.path.join(tmp, "A_pp2"))
    out["A_uninterrupted"] = _train(a, "A_pp2_z1", range(3, 6), tied=False)
    resumed = _engine("A_pp2_z1", 2, 1)
    path, _ = resumed.load_checkpoint(os.path.join(tmp, "A_pp2"))
    out["A_counters"] = (resumed.global_steps, resumed.global_samples)
    out["A_resumed"] = _train(resumed, "A_pp2_z1", range(3, 6), tied=False)
    out["files"] = sorted(os.listdir(path))

    b = _engine("B_tied_pp2_z0", 2, 1, stage=1)
    out["B_first"] = _train(b, "B_tied_pp2_z0", range(3), tied=True)
    b.save_checkpoint(os.path.join(tmp, "B_pp2"))
    out["B_uninterrupted"] = _train(b, "B_tied_pp2_z0", range(3, 6), tied=True)

    ds = _engine("A_pp2_z1", 2, 1)
    ds.load_checkpoint(_deepspeed_tag("A_pp2_z1"))
    out["DS_A_counters"] = (ds.global_steps, ds.global_samples)
    out["DS_A_resumed"] = _train(ds, "A_pp2_z1", range(3, 6), tied=False)

    ds_b = _engine("B_tied_pp2_z0", 2, 1)
    ds_b.load_checkpoint(_deepspeed_tag("B_tied_pp2_z0"))
    out["DS_B"] = _loaded_vs_deepspeed(ds_b, "B_tied_pp2_z0")
    dist.barrier()
    return out


class _Tanh(torch.nn.Module):
    def forward(self, x):
        return torch.tanh(x)


def _plain_model_a():
    """Model A as a plain nn.Sequential with the PipelineModule's names and initialisation (layer i built
    after seeding 1234 + i), trained by the non-pipeline engine."""
    import model as M
    from torch import nn

    layers = []
    for i, build in enumerate([lambda: nn.Linear(M.IN_DIM, M.HIDDEN), nn.ReLU, lambda: nn.Linear(M.HIDDEN, M.HIDDEN),
                               _Tanh, lambda: nn.Linear(M.HIDDEN, M.HIDDEN), lambda: nn.LayerNorm(M.HIDDEN),
                               lambda: nn.Linear(M.HIDDEN, M.HIDDEN), lambda: nn.Linear(M.HIDDEN, M.CLASSES)]):
        M.seed_layer(M.BASE_SEED + i)
        layers.append(build())
    return nn.Sequential(*layers)


def _world1(tmp: str):
    sys.path.insert(0, FIXTURES)
    import model as M

    import lightspeed

    out = {}
    exp = _expected("A_pp2_z1")
    plain = _plain_model_a()
    engine, *_ = lightspeed.initialize(model=plain, config=exp["config"], model_parameters=list(plain.parameters()))
    loss_fn = M.loss_fn(False)
    for step in range(3):
        for m in range(exp["gradient_accumulation_steps"]):
            x, y = M.batches(step, m, exp["micro_batch"], exp["data_seed"], 0, False)
            engine.backward(loss_fn(engine(x), y))
            engine.step()
    engine.save_checkpoint(os.path.join(tmp, "A_plain"))
    a = _engine("A_pp2_z1", 1, 1)
    a.load_checkpoint(os.path.join(tmp, "A_pp2"))
    out["A_from_pp2"] = _train(a, "A_pp2_z1", range(3, 6), tied=False)

    ref = _engine("A_pp2_z1", 1, 1)
    out["A_first"] = _train(ref, "A_pp2_z1", range(3), tied=False)
    ref.save_checkpoint(os.path.join(tmp, "A_pp1"))
    out["A_uninterrupted"] = _train(ref, "A_pp2_z1", range(3, 6), tied=False)

    ds = _engine("A_pp2_z1", 1, 1)
    ds.load_checkpoint(_deepspeed_tag("A_pp2_z1"))
    out["DS_A_resumed"] = _train(ds, "A_pp2_z1", range(3, 6), tied=False)

    b = _engine("B_tied_pp2_z0", 1, 1, stage=1)
    b.load_checkpoint(os.path.join(tmp, "B_pp2"))
    out["B_from_pp2"] = _train(b, "B_tied_pp2_z0", range(3, 6), tied=True)
    return out


def _world4(tmp: str):
    import torch.distributed as dist

    from lightspeed.checkpoint.errors import CheckpointError

    out = {}
    a = _engine("A_pp2_z1", 4, 1)
    a.load_checkpoint(os.path.join(tmp, "A_pp1"))
    out["A_pp4_from_pp1"] = _train(a, "A_pp2_z1", range(3, 6), tied=False)

    wide = _engine("A_pp2_z1", 2, 2)  # both data-parallel ranks see rank 0's data: the pp2 run's gradient
    before = {n: p.detach().clone() for n, p in wide.module.named_parameters()}
    if dist.get_rank() == 0:  # rank 1's RNG file damaged: only mesh rank 1 fails to read the tag
        import shutil

        shutil.copytree(os.path.join(tmp, "A_pp2"), os.path.join(tmp, "A_pp2_bad"))
        with open(os.path.join(tmp, "A_pp2_bad", "global_step3", "rng_rank1.pt"), "r+b") as f:
            f.seek(-200, os.SEEK_END)
            f.write(b"\0" * 16)
    dist.barrier()
    try:
        wide.load_checkpoint(os.path.join(tmp, "A_pp2_bad"))
        out["failed"] = None
    except CheckpointError as err:
        out["failed"] = str(err)
    out["unchanged"] = all(torch.equal(before[n], p.detach()) for n, p in wide.module.named_parameters())
    out["steps_after_failure"] = wide.global_steps
    wide.load_checkpoint(os.path.join(tmp, "A_pp2"))
    out["A_pp2dp2_from_pp2"] = _train(wide, "A_pp2_z1", range(3, 6), tied=False, data_rank=0)
    wide.load_checkpoint(os.path.join(tmp, "A_plain"))  # a non-pipeline module's checkpoint, same names
    out["A_pp2dp2_from_plain"] = _train(wide, "A_pp2_z1", range(3, 6), tied=False, data_rank=0)

    # ZeRO-0 (state replicated: data-parallel rank 0 of each stage writes; the tied embedding counted
    # from stage 0) at pp2 x dp2, loaded at pp4 and ZeRO-1
    b = _engine("B_tied_pp2_z0", 2, 2, stage=0)
    _train(b, "B_tied_pp2_z0", range(2), tied=True, data_rank=b.groups.dp_rank)
    b.save_checkpoint(os.path.join(tmp, "B_pp2dp2_z0"))
    b4 = _engine("B_tied_pp2_z0", 4, 1, stage=1)
    b4.load_checkpoint(os.path.join(tmp, "B_pp2dp2_z0"))
    out["B_pp4"] = {n: p.detach().clone() for n, p in b4.module.named_parameters()}
    out["B_pp4_step"] = sorted({int(st["step"]) for st in b4.optimizer.state.values()})

    # pp2 x tp2 (tied model B, ZeRO-1): resumed at pp2 x tp2, and at pp2 x dp2 without tensor parallelism
    tp = _engine("B_tied_pp2_z0", 2, 1, stage=1, extra={"tensor_parallel": TP_PLAN})
    _train(tp, "B_tied_pp2_z0", range(3), tied=True)
    tp.save_checkpoint(os.path.join(tmp, "B_pp2tp2"))
    out["B_tp_uninterrupted"] = _train(tp, "B_tied_pp2_z0", range(3, 6), tied=True)
    tp_again = _engine("B_tied_pp2_z0", 2, 1, stage=1, extra={"tensor_parallel": TP_PLAN})
    tp_again.load_checkpoint(os.path.join(tmp, "B_pp2tp2"))
    out["B_tp_resumed"] = _train(tp_again, "B_tied_pp2_z0", range(3, 6), tied=True)
    no_tp = _engine("B_tied_pp2_z0", 2, 2, stage=1)
    no_tp.load_checkpoint(os.path.join(tmp, "B_pp2tp2"))
    out["B_dp2_from_tp2"] = _train(no_tp, "B_tied_pp2_z0", range(3, 6), tied=True, data_rank=0)

    # ZeRO-3 at pp2 x dp2 (each stage's parameters partitioned over dp): saved after 3 steps, resumed at
    # ZeRO-3 and at ZeRO-1, each continuing DeepSpeed's uninterrupted trajectory
    z3 = _engine("A_pp2_dp2_z1", 2, 2, stage=3)
    out["Z3_first"] = _train(z3, "A_pp2_dp2_z1", range(3), tied=False, data_rank=z3.groups.dp_rank)
    z3.save_checkpoint(os.path.join(tmp, "A_pp2dp2_z3"))
    z3.config.checkpoint.format = "deepspeed"  # DeepSpeed's pipeline engine has no ZeRO-3 layout: refused first
    try:
        z3.save_checkpoint(os.path.join(tmp, "A_pp2dp2_z3_ds"))
        out["Z3_deepspeed_format"] = None
    except NotImplementedError as err:
        out["Z3_deepspeed_format"] = (str(err), os.path.exists(os.path.join(tmp, "A_pp2dp2_z3_ds")))
    for stage in (3, 1):
        again = _engine("A_pp2_dp2_z1", 2, 2, stage=stage)
        again.load_checkpoint(os.path.join(tmp, "A_pp2dp2_z3"))
        out[f"Z3_resumed_z{stage}"] = _train(again, "A_pp2_dp2_z1", range(3, 6), tied=False,
                                             data_rank=again.groups.dp_rank)

    ds = _engine("A_pp2_dp2_z1", 2, 2)
    ds.load_checkpoint(_deepspeed_tag("A_pp2_dp2_z1"))
    out["DS_counters"] = (ds.global_steps, ds.global_samples)
    out["DS_A_dp2_resumed"] = _train(ds, "A_pp2_dp2_z1", range(3, 6), tied=False, data_rank=ds.groups.dp_rank)
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("pipe_ckpt"))
    two = run_world(_world2, 2, tmp, timeout=240)
    one = run_world(_world1, 1, tmp, timeout=240)
    four = run_world(_world4, 4, tmp, timeout=240)
    return {"tmp": tmp, "two": two, "one": one, "four": four}


def test_pp2_resumes_at_pp2(worlds):
    out = worlds["two"][0]
    assert out["A_first"] == pytest.approx(_expected("A_pp2_z1")["losses"][:3], abs=TOL)
    assert out["A_counters"] == (3, 24)
    assert out["A_resumed"] == pytest.approx(out["A_uninterrupted"], abs=TOL)
    assert {"module_states_pp0.pt", "module_states_pp1.pt", "optim_states_rank1.pt"} <= set(out["files"])


def test_pp2_resumes_at_pp1_and_pp2_dp2(worlds):
    two, one, four = worlds["two"][0], worlds["one"][0], worlds["four"]
    assert one["A_from_pp2"] == pytest.approx(two["A_uninterrupted"], abs=1e-5)
    for rank in four:
        assert rank["A_pp2dp2_from_pp2"] == pytest.approx(two["A_uninterrupted"], abs=1e-5)


def test_non_pipeline_checkpoint_resumes_in_a_pipeline(worlds):
    two = worlds["two"][0]
    for rank in worlds["four"]:
        assert rank["A_pp2dp2_from_plain"] == pytest.approx(two["A_uninterrupted"], abs=1e-5)


def test_pp1_resumes_at_pp4(worlds):
    one, four = worlds["one"][0], worlds["four"]
    assert one["A_first"] == pytest.approx(_expected("A_pp2_z1")["losses"][:3], abs=1e-5)
    for rank in four:
        assert rank["A_pp4_from_pp1"] == pytest.approx(one["A_uninterrupted"], abs=1e-5)


def test_tied_pp2_zero1_resumes_at_pp1(worlds):
    two, one = worlds["two"][0], worlds["one"][0]
    assert one["B_from_pp2"] == pytest.approx(two["B_uninterrupted"], abs=1e-5)


def test_replicated_tied_pp2_dp2_loads_at_pp4(worlds):
    from lightspeed.checkpoint.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    whole = get_fp32_state_dict_from_zero_checkpoint(os.path.join(worlds["tmp"], "B_pp2dp2_z0"))
    seen = set()
    for out in worlds["four"]:
        assert out["B_pp4_step"] == [2]
        for name, value in out["B_pp4"].items():
            assert torch.equal(value, whole[name]), name
            seen.add(name)
    assert seen == set(whole) and "tied_modules.embed.weight" in seen


def test_pp2_tp2_resumes_at_pp2_tp2_and_pp2_dp2(worlds):
    for out in worlds["four"]:
        assert out["B_tp_resumed"] == pytest.approx(out["B_tp_uninterrupted"], abs=TOL)
        assert out["B_dp2_from_tp2"] == pytest.approx(out["B_tp_uninterrupted"], abs=1e-5)


def test_failed_load_is_agreed_and_changes_nothing(worlds):
    for rank, out in enumerate(worlds["four"]):
        assert out["failed"] is not None, rank
        assert ("rng_rank1" in out["failed"]) if rank == 1 else ("rank 1 could not read" in out["failed"])
        assert out["unchanged"] and out["steps_after_failure"] == 0


def test_deepspeed_pipeline_checkpoint_resumes(worlds):
    out, one = worlds["two"][0], worlds["one"][0]
    after = _expected("A_pp2_z1")["checkpoint"]["losses_after_resume"]
    assert out["DS_A_counters"] == (3, 24)
    assert out["DS_A_resumed"] == pytest.approx(after, abs=TOL)
    assert one["DS_A_resumed"] == pytest.approx(after, abs=1e-5)


def test_deepspeed_pipeline_dp2_checkpoint_resumes(worlds):
    after = _expected("A_pp2_dp2_z1")["checkpoint"]["losses_after_resume"]
    for out in worlds["four"]:
        assert out["DS_counters"] == (3, 48)
        assert out["DS_A_dp2_resumed"] == pytest.approx(after, abs=TOL)


def test_deepspeed_tied_zero0_checkpoint_loads(worlds):
    for stage, out in enumerate(worlds["two"]):
        ds = out["DS_B"]
        assert ds["names"][0] == "tied_modules.embed.weight"
        assert ds["weights"] == 0.0 and ds["moments"] == 0.0, stage
        assert ds["steps"] == [3] and ds["global_steps"] == 3


def test_zero3_pp2_dp2_resumes_at_zero3_and_zero1(worlds):
    want = _expected("A_pp2_dp2_z1")["losses"]
    for rank in worlds["four"]:
        assert rank["Z3_first"] == pytest.approx(want[:3], abs=1e-5)
        assert rank["Z3_resumed_z3"] == pytest.approx(want[3:6], abs=1e-5)
        assert rank["Z3_resumed_z1"] == pytest.approx(want[3:6], abs=1e-5)
        message, written = rank["Z3_deepspeed_format"]
        assert "zero_optimization.stage 3" in message and not written
