"""DeepSpeed's MoE checkpoint layout without a distributed world: a checkpoint lightspeed does not read is
refused by name (the older `expert_<X>_mp_rank_<XX>` naming, expert files beside no optimizer file, neither
ZeRO's nor the `expp_rank_<E>` files of training without ZeRO, or `expp_rank_<E>` files beside no expert
file); DeepSpeed's ep2 checkpoint without ZeRO is written again in its layout at other ep sizes, ZeRO
stages and world sizes and reads back unchanged; what is not written (ZeRO-3, an ep that does not divide
the experts or the ranks) is refused, also by `lightspeed convert to-deepspeed --ep-size`. (Those
checkpoints load into engines: tests/distributed/test_moe_checkpoints.py, test_deepspeed_moe_layout.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightspeed.checkpoint.errors import CheckpointError
from lightspeed.checkpoint.universal import open_source


@pytest.mark.parametrize("files, error", [
    (["layer_0_expert_3_mp_rank_00_model_states.pt"], "layer_0_expert_3_mp_rank_00_model_states.pt\\) with neither"),
    (["expert_1_mp_rank_00_model_states.pt"], "expert_1_mp_rank_00_model_states.pt: DeepSpeed checkpoints with MoE"),
    (["expp_rank_0_mp_rank_00_optim_states.pt"], "expp_rank_0_mp_rank_00_optim_states.pt: DeepSpeed writes"),
    (["layer_0_expert_0_mp_rank_00_model_states.pt", "expp_rank_1_mp_rank_00_optim_states.pt"],
     "expp_rank_0_mp_rank_00_optim_states.pt: missing"),
])
def test_deepspeed_moe_checkpoint_is_refused(tmp_path, files, error):
    tag = tmp_path / "global_step1"
    tag.mkdir()
    torch.save({"module": {}}, tag / "mp_rank_00_model_states.pt")
    for name in files:
        torch.save({}, tag / name)
    (tmp_path / "latest").write_text("global_step1")
    with pytest.raises(CheckpointError, match=error):
        open_source(tmp_path)


def test_deepspeed_moe_names_and_groups():
    from lightspeed.checkpoint.deepspeed_moe import expert_group_ranks, global_name, num_local_experts

    names = ["a.deepspeed_experts.0.w", "a.deepspeed_experts.1.w", "b.weight", "m.experts.w1"]
    local = num_local_experts(names)
    assert local == {"a.deepspeed_experts.": 2}
    assert global_name("a.deepspeed_experts.1.w", 0, local) == "a.deepspeed_experts.1.w"
    assert global_name("a.deepspeed_experts.1.w", 1, local) == "a.deepspeed_experts.3.w"
    assert global_name("m.experts.w1", 1, local) is None  # DeepSpeed AutoEP's fused experts: refused by the reader
    assert expert_group_ranks(4, 2) == [[0, 2], [1, 3]]  # ep 2: ep rank e's experts over ranks e, e + 2
    assert expert_group_ranks(2, 1) == [[0], [1]]


FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "deepspeed_moe_checkpoint"


@pytest.mark.parametrize("ep, stage, world", [(1, 0, 2), (2, 0, 2), (2, 2, 2), (2, 1, 4)])
def test_deepspeed_moe_rewritten_at_another_ep(tmp_path, ep, stage, world):
    """DeepSpeed's ep2 checkpoint without ZeRO, written again in its layout for ep `ep` at ZeRO `stage` over
    `world` ranks (without ZeRO an expp_rank file per ep rank), reads back with every master and moment as
    saved, and the experts' files as DeepSpeed's."""
    from lightspeed.checkpoint.deepspeed_format import DeepSpeedCheckpointSource
    from lightspeed.checkpoint.deepspeed_writer import write_deepspeed_checkpoint

    source = DeepSpeedCheckpointSource(FIXTURE / "ep2_z0")
    tag = write_deepspeed_checkpoint(FIXTURE / "ep2_z0", tmp_path, ep_size=ep, stage=stage, world_size=world)
    names = sorted(p.name for p in Path(tag).iterdir())
    assert [n for n in names if "optim_states" in n] == (
        [f"expp_rank_{e}_mp_rank_00_optim_states.pt" for e in range(ep)] if stage == 0
        else [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(world)])
    for g in range(4):
        assert torch.load(f"{tag}/layer_0_expert_{g}_mp_rank_00_model_states.pt", weights_only=True).keys() == \
            torch.load(FIXTURE / "ep2_z0" / "global_step2" / f"layer_0_expert_{g}_mp_rank_00_model_states.pt",
                       weights_only=True).keys()
    back = DeepSpeedCheckpointSource(tmp_path)
    assert back.param_names() == source.param_names() and back.state_keys() == source.state_keys()
    for name in source.param_names():
        for key in ("fp32", *source.state_keys()):
            assert torch.equal(back.read(name, key), source.read(name, key)), (name, key)
    assert [g["names"] for g in back.optimizer_groups()] == [g["names"] for g in source.optimizer_groups()]
    assert [g["name"] for g in back.optimizer_groups()] == ["dense", f"ep_size_{ep}"]


@pytest.mark.parametrize("kwargs, error", [({"stage": 3}, "refuses its MoE layers at stage 3"),
                                           ({"ep_size": 3, "world_size": 3},
                                            "4 experts in moe.deepspeed_moe.experts.deepspeed_experts, "
                                            "not a multiple of the expert-parallel size 3"),
                                           ({"ep_size": 2, "world_size": 3}, "size 2 does not divide the 3 ranks")])
def test_deepspeed_moe_layout_not_written_is_refused(tmp_path, kwargs, error):
    from lightspeed.checkpoint.deepspeed_writer import write_deepspeed_checkpoint

    with pytest.raises(CheckpointError, match=error):
        write_deepspeed_checkpoint(FIXTURE / "ep2_z0", tmp_path, **kwargs)
    assert not any(tmp_path.iterdir())


def test_cli_to_deepspeed_ep_size(tmp_path, capsys):
    from lightspeed.checkpoint.deepspeed_format import DeepSpeedCheckpointSource
    from lightspeed.launcher.cli import main as cli_main

    assert cli_main(["convert", "to-deepspeed", str(FIXTURE / "ep2_z0"), str(tmp_path / "ok"), "--ep-size", "1"]) == 0
    assert sorted(p.name for p in (tmp_path / "ok" / "global_step2").glob("expp_rank_*")) == [
        "expp_rank_0_mp_rank_00_optim_states.pt"]
    assert DeepSpeedCheckpointSource(tmp_path / "ok").zero_stage == 0
    capsys.readouterr()
    assert cli_main(["convert", "to-deepspeed", str(FIXTURE / "ep2_z0"), str(tmp_path / "bad"), "--stage", "3"]) != 0
    assert "refuses its MoE layers at stage 3" in capsys.readouterr().err


def test_deepspeed_moe_checkpoint_at_zero3_is_refused(tmp_path):
    """DeepSpeed 0.19.8 asserts against its MoE layers at ZeRO-3, so such files are not DeepSpeed's: refused."""
    tag = tmp_path / "global_step1"
    tag.mkdir()
    torch.save({"module": {}}, tag / "mp_rank_00_model_states.pt")
    torch.save({}, tag / "layer_0_expert_0_mp_rank_00_model_states.pt")
    torch.save({"optimizer_state_dict": {"zero_stage": 3, "partition_count": 1}},
               tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    with pytest.raises(CheckpointError, match="MoE checkpoint at ZeRO stage 3: read at stages 0-2 only "
                                              r"\(DeepSpeed 0.19.8 refuses its MoE layers at stage 3"):
        open_source(tmp_path, "global_step1")
