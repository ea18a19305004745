"""`apply_sequence_parallel`: the sequence-parallel step of `initialize()`'s model transforms.

Owns: checking that a model can be split over the sp group (its head counts, as the config key's error;
under tensor parallelism the heads each tp rank holds)
and wiring a Hugging Face model's attention through Ulysses when the caller has not. Must not: change
the model's modules, or shard data.

A transformers model (it has a `config` with `num_attention_heads`) whose attention is not registered
yet is registered here with its own attention implementation, so `"sequence_parallel_size"` in the
config is enough for the model; the batches must still come sliced (`UlyssesSPDataLoaderAdapter`). Any
other model must route its attention through `DistributedAttention` (or its own all-to-alls); one
without a `DistributedAttention` submodule gets a warning, since nothing here can see a functional call.
"""

from __future__ import annotations

import torch

from lightspeed._utils.logging import get_logger
from lightspeed.comm.topology import Topology
from lightspeed.sequence.layer import DistributedAttention
from lightspeed.sequence.ulysses_hf import UlyssesSPAttentionHF, check_heads, is_registered

logger = get_logger(__name__)


def apply_sequence_parallel(model: torch.nn.Module, cfg, topology: Topology) -> torch.nn.Module:
    """Prepare `model` for Ulysses over the topology's sp dim (a no-op at size 1); returns the model."""
    sp_world_size = topology.size("sp")
    if sp_world_size <= 1:
        return model
    micro_batch_size = cfg.train_micro_batch_size_per_gpu
    config = getattr(model, "config", None)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    num_heads = getattr(text_config, "num_attention_heads", None)
    if num_heads is not None:
        # tensor parallelism ran first: each tp rank holds num_heads / tp of the heads, which Ulysses splits
        check_heads(num_heads, getattr(text_config, "num_key_value_heads", None) or num_heads, sp_world_size,
                    topology.size("tp"))
        if not is_registered():
            UlyssesSPAttentionHF.register_with_transformers(
                model, core_attn_implementation=getattr(config, "_attn_implementation", None),
                sequence_parallel_size=sp_world_size, micro_batch_size=micro_batch_size)
        return model
    if not is_registered() and not any(isinstance(m, DistributedAttention) for m in model.modules()):
        logger.warning("sequence_parallel_size=%d: the model has no DistributedAttention submodule and no "
                       "transformers attention is registered for Ulysses; its attention must exchange the "
                       "sequence itself, or each rank attends only to its own slice", sp_world_size)
    return model
