"""DeepSpeedCheckpointSource against checkpoints real DeepSpeed wrote (tests/fixtures/deepspeed/, made by
its make_fixtures.py): every fixture reads; masters and Adam moments equal what DeepSpeed's own accessors
gathered from the live engine; consolidation equals DeepSpeed's zero_to_fp32; counters, groups and
scheduler read right; bad files are refused in one line naming the file."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from lightspeed.checkpoint.deepspeed_format import DeepSpeedCheckpointSource, is_deepspeed_checkpoint
from lightspeed.checkpoint.errors import CheckpointError
from lightspeed.checkpoint.source import TrainingStateSource
from lightspeed.checkpoint.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "deepspeed"
CASES = sorted(p.name for p in FIXTURES.iterdir() if (p / "expected.json").is_file())


def _expected(case: str) -> dict:
    return json.loads((FIXTURES / case / "expected.json").read_text())


def test_fixtures_cover_every_stage_world_size_and_dtype():
    seen = {(e["world_size"], e["zero_stage"], e["dtype"]) for e in map(_expected, CASES)}
    assert {s for _, s, _ in seen} == {0, 1, 2, 3}
    assert {w for w, _, _ in seen} == {1, 2}
    assert {d for _, _, d in seen} >= {"fp32", "bf16"}
    total = sum(f.stat().st_size for f in FIXTURES.rglob("*") if f.is_file())
    assert total < 2_000_000


@pytest.mark.parametrize("case", CASES)
def test_reads_masters_and_optimizer_state_as_deepspeed_holds_them(case):
    exp = _expected(case)
    src = DeepSpeedCheckpointSource(FIXTURES / case / "ckpt")
    assert isinstance(src, TrainingStateSource)
    truth = torch.load(FIXTURES / case / "optimizer_state.pt", weights_only=True)
    assert set(src.param_names()) == set(truth)
    assert src.state_keys() == ["exp_avg", "exp_avg_sq"]
    for name in src.param_names():
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            got = src.read(name, key)
            assert got.dtype == torch.float32 and got.shape == src.param_shape(name)
            assert torch.equal(got, truth[name][key]), (case, name, key)
    extra = src.extra()
    assert extra["source"] == "deepspeed"
    assert extra["zero_stage"] == exp["zero_stage"] and extra["dp_world_size"] == exp["world_size"]
    assert {k: extra["counters"][k] for k in exp["counters"]} == exp["counters"]
    assert extra["lr_scheduler"] == exp["lr_scheduler"]
    if exp["dtype"] == "fp32" and exp["zero_stage"] == 0:
        assert extra["loss_scaler"] is None
    elif exp["dtype"] != "bf16acc32":
        assert extra["loss_scaler"]["cur_scale"] == 1.0


@pytest.mark.parametrize("case", CASES)
def test_optimizer_groups_carry_names_hyperparameters_and_step(case):
    exp = _expected(case)
    groups = DeepSpeedCheckpointSource(FIXTURES / case / "ckpt").optimizer_groups()
    assert len(groups) == len(exp["param_groups"])
    names = [n for g in groups for n in g["names"]]
    assert sorted(names) == sorted(["embed.weight", "up.weight", "up.bias", "down.weight", "down.bias"])
    for got, want in zip(groups, exp["param_groups"]):
        assert got["lr"] == pytest.approx(want["lr"]) and got["weight_decay"] == want["weight_decay"]
        assert list(got["betas"]) == list(want["betas"])
        # DeepSpeed's unfused bf16 optimizer takes one extra, zero-gradient step to create the state.
        assert got["scalars"]["step"] in (exp["counters"]["global_steps"], exp["counters"]["global_steps"] + 1)
    if exp["zero_stage"] > 0:
        assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
        assert groups[1]["names"] == ["up.bias", "down.bias"]


@pytest.mark.parametrize("case", [c for c in CASES if (FIXTURES / c / "consolidated.pt").is_file()])
def test_consolidation_equals_deepspeeds_zero_to_fp32(case):
    want = torch.load(FIXTURES / case / "consolidated.pt", weights_only=True)
    got = get_fp32_state_dict_from_zero_checkpoint(str(FIXTURES / case / "ckpt"))
    assert list(got) == list(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), name


def test_bf16_optimizer_checkpoint_deepspeed_cannot_consolidate_is_read():
    exp = _expected("ws2_stage1_bf16acc32")
    assert "is not a zero checkpoint" in exp["deepspeed_zero_to_fp32_error"]
    got = get_fp32_state_dict_from_zero_checkpoint(str(FIXTURES / "ws2_stage1_bf16acc32" / "ckpt"))
    truth = torch.load(FIXTURES / "ws2_stage1_bf16acc32" / "optimizer_state.pt", weights_only=True)
    for name, entry in truth.items():
        assert torch.equal(got[name], entry["fp32"])


@pytest.mark.parametrize("case", ["ws2_stage2_fp32", "ws2_stage3_bf16"])
def test_tags_latest_and_tag_directory(case, tmp_path):
    root = FIXTURES / case / "ckpt"
    tag = _expected(case)["tag"]
    a = DeepSpeedCheckpointSource(root)
    b = DeepSpeedCheckpointSource(root, tag=tag)
    c = DeepSpeedCheckpointSource(root / tag)
    assert a.path == b.path == c.path and is_deepspeed_checkpoint(root) and is_deepspeed_checkpoint(root / tag)
    with pytest.raises(CheckpointError, match="global_step99: checkpoint tag directory not found"):
        DeepSpeedCheckpointSource(root, tag="global_step99")
    shutil.copytree(root, tmp_path / "ckpt")
    os.remove(tmp_path / "ckpt" / "latest")
    with pytest.raises(CheckpointError, match="latest: not found; pass the tag"):
        DeepSpeedCheckpointSource(tmp_path / "ckpt")


def _copy(case: str, tmp_path: Path) -> Path:
    shutil.copytree(FIXTURES / case / "ckpt", tmp_path / "ckpt")
    return tmp_path / "ckpt" / _expected(case)["tag"]


def _one_line(err: pytest.ExceptionInfo, path: Path) -> str:
    text = str(err.value)
    assert "\n" not in text and str(path) in text
    return text


def test_truncated_file_is_refused_naming_it(tmp_path):
    tag_dir = _copy("ws2_stage2_fp32", tmp_path)
    bad = tag_dir / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    bad.write_bytes(bad.read_bytes()[:300])
    with pytest.raises(CheckpointError) as err:
        DeepSpeedCheckpointSource(tag_dir.parent)
    assert "truncated or corrupt" in _one_line(err, bad)


def test_garbage_model_file_is_refused_naming_it(tmp_path):
    tag_dir = _copy("ws1_stage0_fp32", tmp_path)
    bad = tag_dir / "mp_rank_00_model_states.pt"
    bad.write_bytes(b"not a checkpoint at all" * 10)
    with pytest.raises(CheckpointError) as err:
        DeepSpeedCheckpointSource(tag_dir.parent)
    assert "truncated or corrupt" in _one_line(err, bad)


class _Payload:
    """Pickles as a call to os.system: loading it with plain pickle would run a shell command."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_pickled_code_is_refused_and_not_run(tmp_path):
    tag_dir = _copy("ws2_stage2_fp32", tmp_path)
    bad = tag_dir / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    marker = tmp_path / "ran"
    torch.save({"optimizer_state_dict": {"zero_stage": 2, "payload": _Payload(marker)}}, bad)
    with pytest.raises(CheckpointError) as err:
        DeepSpeedCheckpointSource(tag_dir.parent)
    text = _one_line(err, bad)
    assert "refused to load" in text and "system" in text
    assert not marker.exists()


@pytest.mark.parametrize("name", ["zero_pp_rank_1_mp_rank_00_optim_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                                  "zero_pp_rank_1_mp_rank_00_model_states.pt"])
def test_missing_rank_file_is_named(tmp_path, name):
    """Whichever rank's file is gone (the last one included, which leaves no gap in the numbering), the
    error names it, and the stitched frozen parameters never come from torch.empty."""
    tag_dir = _copy("ws2_stage3_fp32", tmp_path)
    os.remove(tag_dir / name)
    with pytest.raises(CheckpointError) as err:
        DeepSpeedCheckpointSource(tag_dir.parent)
    assert "missing" in _one_line(err, tag_dir / name)


def test_a_frozen_parameter_without_every_part_is_an_error(tmp_path):
    """A stage-3 frozen parameter is stitched from every rank's part: a part not found (here: rank 1's
    model file lost its part) names the file instead of leaving uninitialised memory in the tensor."""
    from lightspeed.checkpoint.deepspeed_format import StitchedModuleState

    frozen = {"f": torch.arange(7.0)}
    parts = [{"f": torch.arange(4.0)}, {"f": torch.tensor([4.0, 5.0, 6.0, 0.0])}]
    state = StitchedModuleState({"f": torch.empty(0)}, {"f": (7,)}, lambda: parts, ["r0.pt", "r1.pt"])
    assert torch.equal(state["f"], frozen["f"])
    del parts[1]["f"]
    with pytest.raises(CheckpointError, match="r1.pt: holds no part of frozen parameter f"):
        state["f"]
    parts[1]["f"] = torch.tensor([4.0])  # cut short
    with pytest.raises(CheckpointError, match="r1.pt: .* hold 5 of its 7 elements"):
        state["f"]


def test_model_parallel_checkpoints_are_named_unsupported(tmp_path):
    tag_dir = _copy("ws1_stage1_fp32", tmp_path)
    shutil.copy(tag_dir / "mp_rank_00_model_states.pt", tag_dir / "mp_rank_01_model_states.pt")
    with pytest.raises(CheckpointError, match="model \\(tensor\\) parallelism are not supported"):
        DeepSpeedCheckpointSource(tag_dir.parent)


def test_stage0_param_names_hint_and_ambiguity():
    root = FIXTURES / "ws1_stage0_fp32" / "ckpt"
    names = ["embed.weight", "up.weight", "up.bias", "down.weight", "down.bias"]
    hinted = DeepSpeedCheckpointSource(root, param_names=names)
    plain = DeepSpeedCheckpointSource(root)
    assert hinted.param_names() == plain.param_names() == names
    assert plain.extra()["frozen_param_names"] == ["norm_scale"]
    assert plain.extra()["shared_params"] == {"head.weight": "embed.weight"}
    with pytest.raises(CheckpointError, match="param_names"):
        DeepSpeedCheckpointSource(root, param_names=names[:4] + ["norm_scale_typo"])


def test_reads_need_only_their_files(monkeypatch):
    """Opening reads the model file and rank 0's optimizer file; other ranks are opened on first use."""
    import lightspeed.checkpoint.deepspeed_format as fmt

    opened = []
    real = fmt.load_deepspeed_file
    monkeypatch.setattr(fmt, "load_deepspeed_file", lambda p, mmap=True: (opened.append(os.path.basename(p)), real(p, mmap))[1])
    src = DeepSpeedCheckpointSource(FIXTURES / "ws2_stage3_fp32" / "ckpt")
    assert "zero_pp_rank_0_mp_rank_00_optim_states.pt" in opened
    before = len(opened)
    src.read("up.bias")
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt" in opened[before:]


def _stage0_model(frozen_shape):
    """A stage-0 model file as DeepSpeed writes it for fp32: a torch optimizer over two of three parameters."""
    module = {"a": torch.zeros(3, 2), "frozen": torch.zeros(frozen_shape), "b": torch.zeros(4)}
    state = {0: {"step": torch.tensor(2.0), "exp_avg": torch.ones(3, 2), "exp_avg_sq": torch.ones(3, 2)},
             1: {"step": torch.tensor(2.0), "exp_avg": torch.full((4,), 2.0), "exp_avg_sq": torch.ones(4)}}
    return {"module": module, "buffer_names": [], "optimizer": {"state": state, "param_groups": [
        {"lr": 0.1, "params": [0, 1]}]}}


def test_stage0_match_takes_the_one_fitting_choice_and_refuses_several():
    from lightspeed.checkpoint.deepspeed_stage0 import stage0_layout

    layout = stage0_layout(_stage0_model((5,)), "m.pt", None)
    assert list(layout.params) == ["a", "b"] and layout.frozen == ["frozen"]
    assert torch.equal(layout.slot_states(0, 1)["exp_avg"], torch.full((4,), 2.0))
    with pytest.raises(CheckpointError, match="m.pt: more than one order-preserving choice.*pass param_names"):
        stage0_layout(_stage0_model((4,)), "m.pt", None)
    hinted = stage0_layout(_stage0_model((4,)), "m.pt", ["a", "frozen"])
    assert list(hinted.params) == ["a", "frozen"] and hinted.frozen == ["b"]


def test_reads_stay_right_when_files_are_unmapped_between_them(monkeypatch):
    import lightspeed.checkpoint.deepspeed_format as fmt

    monkeypatch.setattr(fmt, "_REMAP_AFTER_BYTES", 1)  # unmap after every read
    for case in ("ws2_stage2_bf16", "ws2_stage3_fp32"):
        src = DeepSpeedCheckpointSource(FIXTURES / case / "ckpt")
        truth = torch.load(FIXTURES / case / "optimizer_state.pt", weights_only=True)
        for name in src.param_names():
            for key in ("fp32", "exp_avg"):
                assert torch.equal(src.read(name, key), truth[name][key])
                assert not src._optim_cache


def test_param_names_given_for_a_zero_checkpoint_must_agree():
    root = FIXTURES / "ws2_stage2_fp32" / "ckpt"
    names = ["embed.weight", "up.weight", "up.bias", "down.weight", "down.bias"]
    assert DeepSpeedCheckpointSource(root, param_names=names).param_names()
    with pytest.raises(CheckpointError, match="param_names differ"):
        DeepSpeedCheckpointSource(root, param_names=names + ["norm_scale"])


def test_deepspeed_classes_become_plain_data_without_deepspeed(tmp_path, monkeypatch):
    """A DeepSpeed class the fixtures do not pickle (fp16's DynamicLossScaler, which this CPU cannot
    train with): pickled under DeepSpeed's module path, read back as a dict of its fields."""
    import sys
    import types

    from lightspeed.checkpoint.deepspeed_pickle import CLASS_KEY, load_deepspeed_file

    path = "deepspeed.runtime.fp16.loss_scaler"
    for name in ("deepspeed", "deepspeed.runtime", "deepspeed.runtime.fp16", path):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))

    class DynamicLossScaler:
        def __init__(self):
            self.cur_scale, self.cur_iter, self.scale_window, self.dynamic = 256.0, 7, 2, True

    DynamicLossScaler.__module__ = path
    DynamicLossScaler.__qualname__ = "DynamicLossScaler"
    sys.modules[path].DynamicLossScaler = DynamicLossScaler
    tag_dir = _copy("ws2_stage2_fp32", tmp_path)
    for rank in range(2):
        f = tag_dir / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
        data = load_deepspeed_file(f, mmap=False)
        data["optimizer_state_dict"]["loss_scaler"] = DynamicLossScaler()
        data["optimizer_state_dict"]["dynamic_loss_scale"] = True
        torch.save(data, f)
    for name in ("deepspeed", "deepspeed.runtime", "deepspeed.runtime.fp16", path):
        monkeypatch.delitem(sys.modules, name)
    scaler = DeepSpeedCheckpointSource(tag_dir.parent).extra()["loss_scaler"]
    assert scaler == {CLASS_KEY: f"{path}.DynamicLossScaler", "cur_scale": 256.0, "cur_iter": 7,
                      "scale_window": 2, "dynamic": True, "dynamic_loss_scale": True}


def test_stage0_fused_fp16_optimizer_layout():
    """DeepSpeed's fused FP16_Optimizer (FusedAdam at stage 0): one flat fp32 tensor per param group,
    the group's parameters end to end; its moments flat alike."""
    from lightspeed.checkpoint.deepspeed_stage0 import stage0_layout

    module = {"w": torch.zeros(2, 3, dtype=torch.float16), "b": torch.zeros(3, dtype=torch.float16),
              "buf": torch.ones(1)}
    flat = torch.arange(9, dtype=torch.float32)
    opt = {"dynamic_loss_scale": True, "cur_scale": 256.0, "cur_iter": 5, "last_overflow_iter": -1,
           "scale_factor": 2.0, "scale_window": 1000, "clip_grad": 1.0, "fp32_groups_flat": [flat],
           "optimizer_state_dict": {"state": {0: {"step": 5, "exp_avg": flat * 2, "exp_avg_sq": flat * 3}},
                                    "param_groups": [{"lr": 0.1, "params": [0]}]}}
    layout = stage0_layout({"module": module, "buffer_names": ["buf"], "optimizer": opt}, "m.pt", None)
    assert {n: p[1] for n, p in layout.params.items()} == {"w": ((0, 0, 0, 6),), "b": ((0, 0, 6, 3),)}
    assert layout.groups == [{"lr": 0.1, "names": ["w", "b"], "scalars": {"step": 5}}]
    assert layout.loss_scaler["cur_scale"] == 256.0 and layout.state_keys == ["exp_avg", "exp_avg_sq"]
    assert torch.equal(layout.master(0, 0), flat) and torch.equal(layout.slot_states(0, 0)["exp_avg"], flat * 2)


def test_stage3_frozen_parameters_are_stitched_on_lookup_and_not_kept():
    from lightspeed.checkpoint.deepspeed_format import StitchedModuleState

    src = DeepSpeedCheckpointSource(FIXTURES / "ws2_stage3_bf16" / "ckpt")
    module = src.module_state()
    assert isinstance(module, StitchedModuleState)
    assert module.entry_meta("norm_scale") == (torch.Size([6]), torch.bfloat16)
    first, again = module["norm_scale"], module["norm_scale"]
    assert first is not again and torch.equal(first, again)
    want = torch.load(FIXTURES / "ws2_stage3_bf16" / "consolidated.pt", weights_only=True)["norm_scale"]
    assert torch.equal(first, want)
    assert module["up.weight"].numel() == 0  # a trainable parameter's placeholder, as stage 3 saves it
