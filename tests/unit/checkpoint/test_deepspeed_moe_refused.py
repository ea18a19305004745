"""A DeepSpeed checkpoint of MoE training that lightspeed does not read is refused by name: without ZeRO
(its `expp_rank_<R>` optimizer files, or expert files beside no ZeRO file) or in the older
`expert_<X>_mp_rank_<XX>` naming. (Those at ZeRO 1-2 load: tests/distributed/test_moe_checkpoints.py.)"""

from __future__ import annotations

import pytest
import torch

from lightspeed.checkpoint.errors import CheckpointError
from lightspeed.checkpoint.universal import open_source


@pytest.mark.parametrize("expert_file", ["layer_0_expert_3_mp_rank_00_model_states.pt",
                                         "expert_1_mp_rank_00_model_states.pt",
                                         "expp_rank_0_mp_rank_00_optim_states.pt"])
def test_deepspeed_moe_checkpoint_is_refused(tmp_path, expert_file):
    tag = tmp_path / "global_step1"
    tag.mkdir()
    torch.save({"module": {}}, tag / "mp_rank_00_model_states.pt")
    torch.save({}, tag / expert_file)
    (tmp_path / "latest").write_text("global_step1")
    with pytest.raises(CheckpointError, match=rf"{expert_file}(: DeepSpeed checkpoints with expert parallelism|\) "
                                              "without ZeRO optimizer files)"):
        open_source(tmp_path)
