"""The one validation of a training config: `validate_training_config`, which `initialize` and
`lightspeed config check` both call, so the check passes exactly the configs `initialize` accepts.

Owns checking the `optimizer` and `scheduler` sections without a model. Their params are validated by
the very code that builds them (`make_optimizer`, `make_scheduler`: the signatures, the value ranges
of their pydantic models, and the constructors' own checks), run over probe parameters: one
one-element CPU tensor per param group, as many groups as the scheduler's per-group lists have values
(one when none has a list). Only a list's length against the model's real number of param groups is
left to `initialize`, which alone knows it. Must not: build anything the caller keeps, or log what it
builds.
"""

from __future__ import annotations

import os
from typing import Optional, Union

import torch

from lightspeed.config.errors import ConfigError
from lightspeed.config.loader import Validation, validate
from lightspeed.comm.collectives import Communicator
from lightspeed.optim.factory import make_optimizer
from lightspeed.optim.schedules import make_scheduler

__all__ = ["validate_training_config", "optimizer_problems", "scheduler_problems"]


def _probe_groups(num_groups: int) -> list[dict]:
    groups = [{"params": [torch.nn.Parameter(torch.zeros(1))]} for _ in range(num_groups)]
    for group in groups:
        group["params"][0].use_muon = False  # Muon asks every parameter which half it takes
    return groups


def _probe_optimizer(optimizer_config, num_groups: int) -> torch.optim.Optimizer:
    """The config's optimizer over probe parameters; AdamW (which has betas, as OneCycle wants) when the
    optimizer comes from code, or its section is invalid."""
    if optimizer_config is not None:
        try:
            return make_optimizer(optimizer_config, _probe_groups(num_groups), comm=Communicator(None, 1))
        except (ConfigError, NotImplementedError):
            pass  # reported by optimizer_problems
    return torch.optim.AdamW(_probe_groups(num_groups), lr=1e-3)


def optimizer_problems(optimizer_config) -> tuple[list[str], list[str]]:
    """(problems, unimplemented) of an `optimizer` section (a config section or a dict)."""
    try:
        make_optimizer(optimizer_config, _probe_groups(1), comm=Communicator(None, 1))
    except ConfigError as error:
        return list(error.problems), []
    except NotImplementedError as error:
        return [], [str(error)]
    return [], []


def scheduler_problems(scheduler_config, optimizer_config=None) -> list[str]:
    """The problems of a `scheduler` section, for the config's optimizer (or one given in code)."""
    params = getattr(scheduler_config, "params", None)
    if isinstance(scheduler_config, dict):
        params = scheduler_config.get("params")
    lists = {k: len(v) for k, v in params.items() if isinstance(v, list) and v} if isinstance(params, dict) else {}
    if len(set(lists.values())) > 1:
        counts = ", ".join(f"{key} has {n}" for key, n in lists.items())
        return [f"scheduler.params: per-group lists must have one value per param group, so the same length "
                f"({counts})"]
    try:
        make_scheduler(scheduler_config, _probe_optimizer(optimizer_config, max(lists.values(), default=1)))
    except ConfigError as error:
        return list(error.problems)
    return []


def validate_training_config(source: Union[dict, str, "os.PathLike[str]", object],
                             world_size: Optional[int] = None, hf_placeholders: bool = False) -> Validation:
    """Every problem `initialize` raises for a config before it builds the engine: the schema, the
    batch triad for `world_size` (as `config.load`), the optimizer and scheduler params; and every
    setting lightspeed does not implement yet. Raises nothing for a bad config: see `.problems` and
    `.unimplemented`. `hf_placeholders`: as `config.loader.validate`'s (`lightspeed config check` on a
    Hugging Face template)."""
    found = validate(source, world_size, hf_placeholders)
    cfg = found.valid_sections
    if cfg is None:
        return found
    problems, unimplemented = list(found.problems), list(found.unimplemented)
    if cfg.optimizer is not None:
        optimizer_found, optimizer_missing = optimizer_problems(cfg.optimizer)
        problems += optimizer_found
        if not any(line.startswith("optimizer.type") for line in unimplemented):
            unimplemented += optimizer_missing
    if cfg.scheduler is not None:
        problems += scheduler_problems(cfg.scheduler, cfg.optimizer)
    # a placeholder set aside is not missing: the template's caller fills it in
    problems = [line for line in problems if not any(line.startswith(f"{path}:") for path in found.placeholders)]
    return Validation(None if problems else found.config, problems, unimplemented, cfg, found.placeholders)
