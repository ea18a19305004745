"""checkpoint/deepspeed_autoep.py on DeepSpeed 0.19.8's own AutoEP checkpoints
(tests/fixtures/deepspeed_autoep_checkpoint): the whole model's fused experts equal DeepSpeed's
per-expert w1 | w3 and w2 exactly; the ZeRO-2 optimizer state is the same tensors whatever the ep size
saved (ep2 and ep1 at ZeRO-2 trained alike); `zero_to_fp32` consolidates a tag to the Hugging Face
model's names and `lightspeed checkpoint verify`'s check finds nothing wrong; a directory mixing both
optimizer layouts is refused in one line. (Loading into engines: tests/distributed/
test_deepspeed_autoep_checkpoint.py.)"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from lightspeed.checkpoint.deepspeed_autoep import DeepSpeedAutoEPSource, open_deepspeed_source
from lightspeed.checkpoint.errors import CheckpointError

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "..", "fixtures", "deepspeed_autoep_checkpoint")


def test_reader_fuses_deepspeeds_experts():
    z2 = open_deepspeed_source(os.path.join(FIXTURES, "ep2_z2"))
    assert isinstance(z2, DeepSpeedAutoEPSource) and z2.zero_stage == 2
    name = "model.layers.1.mlp.experts.gate_up_proj"
    assert z2.param_shape(name) == (4, 48, 16) and "model.layers.1.mlp.gate.weight" in z2.param_names()
    expert = torch.load(os.path.join(FIXTURES, "ep2_z2", "global_step2", "layer_1_expert_3_mp_rank_00_model_states.pt"))
    prefix = "model.layers.1.mlp.experts"
    torch.testing.assert_close(z2.read(name)[3], torch.cat([expert[f"{prefix}.w1.3"], expert[f"{prefix}.w3.3"]]),
                               rtol=0, atol=0)
    torch.testing.assert_close(z2.read(f"{prefix}.down_proj")[3], expert[f"{prefix}.w2.3"], rtol=0, atol=0)
    ep1 = open_deepspeed_source(os.path.join(FIXTURES, "ep1_z2"))
    for n in z2.param_names():
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(ep1.read(n, key), z2.read(n, key), rtol=1e-4, atol=1e-6)
    assert [g["names"] for g in ep1.optimizer_groups()] == [g["names"] for g in z2.optimizer_groups()]


def test_consolidates_and_verifies():
    from lightspeed.checkpoint.universal import check_tag
    from lightspeed.checkpoint.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    for run in ("ep2_z0", "ep2_z2"):
        source = open_deepspeed_source(os.path.join(FIXTURES, run))
        whole = get_fp32_state_dict_from_zero_checkpoint(os.path.join(FIXTURES, run))
        assert set(whole) == set(source.param_names())
        for name, value in whole.items():
            torch.testing.assert_close(value, source.read(name), rtol=0, atol=0)
        assert check_tag(os.path.join(FIXTURES, run, "global_step2"), None) == ([], [])


def test_mixed_optimizer_layouts_refused(tmp_path):
    tag = tmp_path / "global_step2"
    shutil.copytree(os.path.join(FIXTURES, "ep2_z2", "global_step2"), tag)
    shutil.copy(os.path.join(FIXTURES, "ep2_z0", "global_step2", "expp_rank_0_mp_rank_00_optim_states.pt"), tag)
    with pytest.raises(CheckpointError, match="needs either zero_pp_rank") as err:
        DeepSpeedAutoEPSource(tag)
    assert "\n" not in str(err.value)
