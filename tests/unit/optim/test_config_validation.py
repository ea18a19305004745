"""`validate_training_config`: the one validation `initialize` and `lightspeed config check` share, so
whatever the check passes `initialize` accepts and whatever `initialize` rejects the check reports,
with the same lines; the optimizer and scheduler params are checked without a model."""

from __future__ import annotations

import pytest

from lightspeed import ConfigError, initialize
from lightspeed.optim.validation import validate_training_config
from lightspeed.testing.models import TinyMLP

BATCH = {"train_micro_batch_size_per_gpu": 2}
ADAM = {"type": "Adam", "params": {"lr": 1e-3}}

REJECTED = [
    ({**BATCH, "optimizer": {"type": "Adamm", "params": {"lr": 1e-3}}},
     'optimizer.type: unknown optimizer "Adamm"; did you mean "Adam"?'),
    ({**BATCH, "optimizer": {"type": "Adam", "params": {"lr": "fast"}}},
     'optimizer.params.lr: must be a number >= 0 (got "fast")'),
    ({**BATCH, "optimizer": {"type": "Adam", "params": {"lr": -1}}}, "optimizer.params.lr: must be a number >= 0 (got -1)"),
    ({**BATCH, "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "weight_decy": 0.1}}},
     'optimizer.params.weight_decy: unknown key; did you mean "weight_decay"?'),
    ({**BATCH, "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentun": 0.9}}},
     'optimizer.params.momentun: unknown key; did you mean "momentum"?'),
    ({**BATCH, "optimizer": ADAM, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": -5}}},
     "scheduler.params.warmup_num_steps: must be a positive integer (got -5)"),
    ({**BATCH, "optimizer": ADAM, "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_step": 10}}},
     'scheduler.params.total_num_step: unknown key; did you mean "total_num_steps"?'),
    ({**BATCH, "optimizer": ADAM, "scheduler": {"type": "LinearLR", "params": {"start_factor": 0}}},
     "scheduler.params: torch.optim.lr_scheduler.LinearLR rejected them"),
    ({**BATCH, "optimizer": ADAM,
      "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": [0.1, 0.2], "cycle_max_lr": [1, 2, 3]}}},
     "scheduler.params: per-group lists must have one value per param group, so the same length "
     "(cycle_min_lr has 2, cycle_max_lr has 3)"),
    ({"train_micro_batch_size_per_gpu": 10**30},
     "train_micro_batch_size_per_gpu: must be at most 2**31 - 1 = 2147483647 (got 1000000000000000000000000000000)"),
]


@pytest.mark.parametrize("config, problem", REJECTED)
def test_check_and_initialize_reject_the_same_configs_with_the_same_lines(config, problem):
    found = validate_training_config(config, world_size=1)
    assert found.config is None and any(line.startswith(problem) for line in found.problems), found.problems
    with pytest.raises(ConfigError) as err:
        initialize(model=TinyMLP(), config=config, dist_init_required=False)
    assert err.value.problems == found.problems


def test_a_valid_config_passes_both_and_nothing_is_kept_or_logged(ls_caplog):
    config = {**BATCH, "optimizer": ADAM,
              "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1}}}
    found = validate_training_config(config, world_size=1)
    assert (found.problems, found.unimplemented) == ([], []) and found.config.optimizer.type == "Adam"
    assert not [r for r in ls_caplog.records if "optimizer:" in r.getMessage() or "LR scheduler" in r.getMessage()]
    engine, optimizer, _, scheduler = initialize(model=TinyMLP(), config=config, dist_init_required=False)
    assert type(scheduler).__name__ == "OneCycle" and optimizer.param_groups[0]["lr"] == 0.01


def test_every_problem_and_every_unimplemented_setting_at_once():
    config = {**BATCH, "zero_optimization": {"stage": 7}, "trackio": {"enabled": True},
              "optimizer": {"type": "Adam", "params": {"lr": -1}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 0}}}
    found = validate_training_config(config, world_size=1)
    assert found.problems == ["zero_optimization.stage: must be 0, 1, 2 or 3 (got 7)",
                              "optimizer.params.lr: must be a number >= 0 (got -1)",
                              "scheduler.params.warmup_num_steps: must be a positive integer (got 0)"]
    assert found.unimplemented == ["trackio.enabled=true is not implemented yet"]


def test_an_unimplemented_optimizer_is_listed_not_reported_as_a_problem():
    mpi = {"type": "OneBitLamb", "params": {"comm_backend_name": "mpi"}}
    found = validate_training_config({**BATCH, "optimizer": mpi}, 1)
    assert found.problems == [] and len(found.unimplemented) == 1
    assert found.unimplemented[0].startswith("optimizer.params.comm_backend_name: OneBitLamb over MPI")
    with pytest.raises(NotImplementedError, match="MPI"):
        initialize(model=TinyMLP(), config={**BATCH, "optimizer": mpi}, dist_init_required=False)
