"""`write_deepspeed_checkpoint` without DeepSpeed: a checkpoint real DeepSpeed wrote (tests/fixtures/deepspeed),
written again for the stage and world size that saved it, gives DeepSpeed's own files back (every entry,
tensors bit-exact, DeepSpeed's classes as DeepSpeed pickles them); written for other stages and world sizes
it reads back to the same state. DeepSpeed itself loading the files: tests/distributed/
test_deepspeed_resumes_lightspeed.py."""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path

import pytest
import torch

from lightspeed.checkpoint.convert import open_checkpoint
from lightspeed.checkpoint.deepspeed_format import DeepSpeedCheckpointSource
from lightspeed.checkpoint.deepspeed_pickle import load_deepspeed_file
from lightspeed.checkpoint.deepspeed_writer import write_deepspeed_checkpoint
from lightspeed.checkpoint.errors import CheckpointError
from lightspeed.launcher.cli import main as cli_main

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "deepspeed"
# DeepSpeed's entries the writer leaves out or cannot know: clip_grad (DeepSpeed then keeps its configured
# gradient_clipping), ds_config (the writer records the one it is given)
_NOT_WRITTEN = {"clip_grad", "ds_config"}


def _same(ours, theirs, where: str) -> None:
    if isinstance(theirs, dict):
        assert isinstance(ours, dict), where
        keys = set(theirs) - _NOT_WRITTEN
        assert set(ours) - _NOT_WRITTEN == keys, (where, (set(ours) - _NOT_WRITTEN) ^ keys)
        for key in keys:
            _same(ours[key], theirs[key], f"{where}.{key}")
    elif isinstance(theirs, (list, tuple)):
        assert isinstance(ours, (list, tuple)) and len(ours) == len(theirs), where
        for i, (a, b) in enumerate(zip(ours, theirs)):
            _same(a, b, f"{where}[{i}]")
    elif isinstance(theirs, torch.Tensor):
        assert isinstance(ours, torch.Tensor) and ours.dtype == theirs.dtype and torch.equal(ours, theirs), where
    else:
        assert ours == theirs, (where, ours, theirs)


def _globals(path: Path) -> set[str]:
    with zipfile.ZipFile(path) as z:
        data = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    import io
    import pickletools

    out = io.StringIO()
    pickletools.dis(data, out)
    return {line.split("GLOBAL", 1)[1].strip().strip("'") for line in out.getvalue().splitlines() if "GLOBAL" in line}


@pytest.mark.parametrize("case", ["ws2_stage0_fp32", "ws1_stage0_bf16", "ws2_stage1_bf16", "ws2_stage2_fp32",
                                  "ws2_stage3_bf16", "ws1_stage3_fp32"])
def test_rewriting_deepspeeds_checkpoint_gives_its_files_back(case, tmp_path):
    exp = json.loads((FIXTURES / case / "expected.json").read_text())
    sub_group = exp["config"]["zero_optimization"].get("sub_group_size", 1_000_000_000)
    tag_dir = write_deepspeed_checkpoint(FIXTURES / case / "ckpt", tmp_path, sub_group_size=sub_group)
    original = FIXTURES / case / "ckpt" / exp["tag"]
    assert sorted(os.listdir(tag_dir)) == sorted(os.listdir(original))
    assert (tmp_path / "latest").read_text() == exp["tag"]
    for name in os.listdir(original):
        _same(load_deepspeed_file(os.path.join(tag_dir, name)), load_deepspeed_file(original / name), name)
        # DeepSpeed's own classes, named as DeepSpeed names them (nothing of lightspeed's in the pickle)
        ours, theirs = _globals(Path(tag_dir, name)), _globals(original / name)
        assert not any("lightspeed" in g for g in ours)
        assert {g for g in ours if g.startswith("deepspeed")} == {g for g in theirs if g.startswith("deepspeed")}


@pytest.mark.parametrize("stage,world", [(0, 1), (1, 3), (2, 1), (3, 2), (3, 3)])
def test_another_stage_and_world_size_read_back_to_the_same_state(stage, world, tmp_path):
    source = FIXTURES / "ws2_stage2_fp32" / "ckpt"
    write_deepspeed_checkpoint(source, tmp_path, stage=stage, world_size=world)
    a = open_checkpoint(source)
    # a stage-0 file names no parameters: its optimizer's order (group by group) is given to read it
    order = [n for g in a.optimizer_groups() for n in g["names"]] if stage == 0 else None
    b = DeepSpeedCheckpointSource(tmp_path, param_names=order)
    assert (b.zero_stage, b.world_size) == (stage, world)
    assert sorted(a.param_names()) == sorted(b.param_names())
    for name in a.param_names():
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            assert torch.equal(a.read(name, key), b.read(name, key)), (name, key)
    for ga, gb in zip(a.optimizer_groups(), b.optimizer_groups()):
        assert ga["names"] == gb["names"] and ga["scalars"] == gb["scalars"] and ga["weight_decay"] == gb["weight_decay"]
    ea, eb = a.extra(), b.extra()
    # DeepSpeed records frozen parameters at stages 2 and 3 only
    for key in ("lr_scheduler", "counters", "buffer_names", "shared_params") + (("frozen_param_names",) * (stage >= 2)):
        assert ea[key] == eb[key], key
    module_a, module_b = a.module_state(), b.module_state()
    for name in ea["buffer_names"] + ea["frozen_param_names"]:
        assert torch.equal(module_a[name], module_b[name]), name


def test_refusals_name_the_problem(tmp_path):
    source = FIXTURES / "ws1_stage3_fp32" / "ckpt"
    write_deepspeed_checkpoint(source, tmp_path)
    with pytest.raises(CheckpointError, match="already exists"):
        write_deepspeed_checkpoint(source, tmp_path)
    with pytest.raises(CheckpointError, match="fp32 and bf16 only"):
        write_deepspeed_checkpoint(source, tmp_path / "fp16", dtype=torch.float16)
    with pytest.raises(CheckpointError, match="stages 0-3"):
        write_deepspeed_checkpoint(source, tmp_path / "s4", stage=4)
    assert not (tmp_path / "fp16").exists() or not any((tmp_path / "fp16").iterdir())


def test_cli_to_deepspeed(tmp_path, capsys):
    rc = cli_main(["convert", "to-deepspeed", str(FIXTURES / "ws2_stage1_fp32" / "ckpt"), str(tmp_path),
                   "--stage", "3", "--world-size", "1"])
    assert rc == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "global_step3")
    src = DeepSpeedCheckpointSource(tmp_path)
    assert (src.zero_stage, src.world_size) == (3, 1)
    assert cli_main(["convert", "to-deepspeed", str(FIXTURES / "ws2_stage1_fp32" / "ckpt"), str(tmp_path)]) != 0
    assert "already exists" in capsys.readouterr().err
