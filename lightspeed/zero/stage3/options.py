"""Stage 3's options, read from the config: the gather schedule, the persistence thresholds, which
modules are units, and whether one rank's parameters view their shards.

Owns: `Stage3Options` and the note about the stage 1/2 keys stage 3 does not use. Must not: build
anything.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from lightspeed._utils.logging import get_logger, warn_once
from lightspeed.precision.policy import PrecisionPolicy
from lightspeed.zero.stage3.coordinator import Schedule
from lightspeed.zero.stage3.units import LeafRule

logger = get_logger(__name__)

ONE_RANK_VIEWS = True  # what configs get (Stage3Options.one_rank_views); the machinery's unit tests turn it off


@dataclass(frozen=True)
class Stage3Options:
    schedule: Schedule = field(default_factory=Schedule)
    param_persistence_threshold: int = 100_000
    model_persistence_threshold: int = sys.maxsize
    gather_16bit_weights_on_model_save: bool = False
    allow_untested_optimizer: bool = False
    leaf_rule: LeafRule = field(default_factory=LeafRule)  # which modules are units (see units.py)
    # at a data-parallel world of one the parameters view their shards: nothing is gathered or released
    # (param_group.py's Note: one rank); off, one rank runs the gather machinery (its unit tests)
    one_rank_views: bool = True

    @classmethod
    def from_config(cls, cfg, policy: PrecisionPolicy) -> "Stage3Options":
        z = cfg.zero_optimization
        schedule = Schedule(prefetch_numel=int(z.stage3_prefetch_bucket_size),
                            max_live_numel=int(z.stage3_max_live_parameters),
                            max_reuse_distance=int(z.stage3_max_reuse_distance),
                            prescale_gradients=bool(cfg.prescale_gradients),
                            gradient_predivide_factor=float(cfg.gradient_predivide_factor),
                            reduce_dtype=policy.reduce_dtype)
        leaf = z.leaf_module
        _note_unused_keys(z)
        leaf_rule = LeafRule(granularity_threshold=int(z.stage3_module_granularity_threshold),
                             classes=tuple(leaf.classes), names=tuple(leaf.names),
                             name_suffixes=tuple(leaf.name_suffixes))
        return cls(schedule=schedule, param_persistence_threshold=int(z.stage3_param_persistence_threshold),
                   one_rank_views=ONE_RANK_VIEWS,
                   model_persistence_threshold=int(z.stage3_model_persistence_threshold),
                   gather_16bit_weights_on_model_save=bool(z.stage3_gather_16bit_weights_on_model_save),
                   allow_untested_optimizer=bool(cfg.zero_allow_untested_optimizer), leaf_rule=leaf_rule)


def _note_unused_keys(z) -> None:
    """Stage 3 communicates one parameter group (a unit, see the Note above) at a time, with every
    reduce-scatter overlapping the rest of backward: the stage 1/2 bucket keys have no effect. Said once
    when a config sets them, never dropped silently."""
    unused = [k for k in ("reduce_bucket_size", "allgather_bucket_size") if k in z.model_fields_set]
    if "overlap_comm" in z.model_fields_set and z.overlap_comm is False:
        unused.append("overlap_comm")
    if unused:
        warn_once("zero_optimization." + ", zero_optimization.".join(unused) + ": no effect at stage 3, which "
                  "gathers and reduce-scatters one parameter group (a block of the model) at a time and always "
                  "overlaps the reductions with backward; stage3_prefetch_bucket_size and "
                  "stage3_max_live_parameters bound what is gathered", logger)
