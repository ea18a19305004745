"""Mixture-of-experts training with expert parallelism, as DeepSpeed's `deepspeed.moe`: the gates
(`gating.py`: top-1, top-2 and top-k with DeepSpeed's exact numerics), the layer (`layer.py`: `MoE`,
`MOELayer`, `Experts`, the all-to-all dispatch over the topology's "ep" group; `batched.py`: the local
experts at once when they are recognised MLPs, `GatedMLP`) and the model transform
that binds that group and places the expert parameters (`transform.py`), the aux loss of a layer
inside a pipeline stage (`aux_loss.py`); and AutoEP, DeepSpeed's
`expert_parallel` section (`autoep.py`: detect a Hugging Face model's MoE blocks and split their fused
experts over "ep"; `autoep_layer.py`: the split experts with a ragged all-to-all dispatch;
`grouped_mlp.py`: the experts' MLP over tokens sorted by expert, with per-expert biases and the
preset's gated activation). Tested against DeepSpeed's
own gates in tests/unit/parallel/test_moe_gating.py and against one process holding every expert in
tests/distributed/test_moe_training.py."""

from lightspeed.parallel.experts.autoep import PRESETS as AUTOEP_PRESETS
from lightspeed.parallel.experts.autoep import autoep_transform, detect_moe_blocks
from lightspeed.parallel.experts.autoep_layer import EPExperts
from lightspeed.parallel.experts.batched import GatedMLP
from lightspeed.parallel.experts.errors import MoEArgumentError
from lightspeed.parallel.experts.gating import (Routes, TopKGate, expert_capacity, top1gating, top2gating,
                                                topkgating)
from lightspeed.parallel.experts.grouped_mlp import grouped_mlp, grouped_mlp_reference
from lightspeed.parallel.experts.layer import Experts, MoE, MOELayer, bind_expert_group
from lightspeed.parallel.experts.transform import (EXPERT_DATA_PARALLEL, expert_parallel_size,
                                                   expert_parallel_transform, expert_placements, moe_layers)

__all__ = ["AUTOEP_PRESETS", "EPExperts", "EXPERT_DATA_PARALLEL", "Experts", "GatedMLP", "MOELayer", "MoE",
           "MoEArgumentError", "Routes", "TopKGate", "autoep_transform", "bind_expert_group", "detect_moe_blocks",
           "expert_capacity", "expert_parallel_size", "expert_parallel_transform", "expert_placements", "grouped_mlp",
           "grouped_mlp_reference", "moe_layers", "top1gating", "top2gating", "topkgating"]
