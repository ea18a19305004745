"""`UlyssesSPAttentionHF` (DeepSpeed's `deepspeed.runtime.sequence_parallel.ulysses_sp`): Ulysses
sequence parallelism for Hugging Face transformers models, through transformers' attention registry.

Owns: the attention wrapper (HF layout [b, h, s/P, d] -> all-to-all -> the model's own attention
function on [b, h/P, s, d] -> all-to-all back -> [b, s/P, h, d]), `register_with_transformers` (builds
the sp groups, validates the model's head counts, installs the wrapper for one attention implementation
in `transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS`, returns the `mpu`) and
`unregister_from_transformers`. Must not: touch the model's modules or classes, or shard data (the data
loader adapter does).

Masks: each rank's model builds its attention mask for its local slice, which means nothing for the full
sequence, so the wrapper drops it and the core attention runs causal on the gathered sequence (as
DeepSpeed does). Padding therefore has to be at the end of a sequence with labels -100 (which causal
attention never lets earlier tokens see); packed sequences with document boundaries are not supported.
Positions: the model's rotary embedding runs on the local slice before attention, so the batch must carry
global `position_ids` (the data loader adapter makes them).
"""

from __future__ import annotations

from typing import Any

import torch

from lightspeed._utils.logging import get_logger
from lightspeed.comm.differentiable import seq_all_to_all
from lightspeed.comm.api import get_world_size
from lightspeed.comm.sequence_groups import KEY, SequenceParallelMPU, initialize_sequence_parallel
from lightspeed.parallel.tensor_parallel import split_tp_size

logger = get_logger(__name__)

SUPPORTED_CORE_ATTENTION = ("sdpa", "flash_attention_2", "flash_attention_3")

_REGISTERED: dict[str, Any] = {}  # attn implementation -> the function the wrapper replaced


def check_heads(num_heads: int, num_kv_heads: int, sp_size: int, tp_size: int = 1) -> None:
    """Clear errors, naming the config key, when heads cannot be split over `sp_size` ranks. With tensor
    parallelism each tp rank holds `num_heads / tp_size` heads (its column-parallel q/k/v slices), and
    Ulysses splits those local heads over the sp group."""
    reasons = {"attention heads": "Ulysses gives each rank of a sequence-parallel group an equal share of the heads",
               "key/value heads": "replicating key/value heads when there are fewer of them than sequence-parallel "
                                  "ranks is not implemented"}
    for count, what in ((num_heads, "attention heads"), (num_kv_heads, "key/value heads")):
        if count % tp_size:
            raise ValueError(f"tensor_parallel.autotp_size={tp_size} does not divide the model's {count} {what}")
        local = count // tp_size
        if local % sp_size:
            held = f"the model's {count} {what}" if tp_size == 1 else \
                f"the {local} {what} each tensor-parallel rank holds (the model's {count} / autotp_size={tp_size})"
            raise ValueError(f"{KEY}={sp_size} does not divide {held}: {reasons[what]}")


class UlyssesSPAttentionHF(torch.nn.Module):
    """The attention function transformers calls: `forward(module, query, key, value, attention_mask,
    *args, **kwargs) -> (output [b, s/P, h, d], attn_weights)` with query [b, h, s/P, d] and key/value
    [b, kv_h, s/P, d]. `attn` is the core attention function (transformers' sdpa, flash, ...)."""

    def __init__(self, attn, batch_size: int, attn_head_count: int, attn_head_size: int, kv_head_count: int,
                 num_hidden_layers: int, process_group: Any, seq_length_is_variable: bool = False,
                 local_seq_length: int | None = None, global_seq_length: int | None = None,
                 disable_in_eval: bool = False) -> None:
        super().__init__()
        sp_size = get_world_size(process_group)
        check_heads(attn_head_count, kv_head_count, sp_size)
        if not seq_length_is_variable and (global_seq_length is None or global_seq_length % sp_size != 0):
            raise ValueError(f"UlyssesSPAttentionHF: a fixed sequence length must be divisible by {KEY}={sp_size} "
                             f"(got {global_seq_length})")
        self.attn = attn
        self.process_group = process_group
        self.world_size = sp_size
        self.batch_size = batch_size
        self.attn_head_count, self.attn_head_size, self.kv_head_count = attn_head_count, attn_head_size, kv_head_count
        self.num_hidden_layers = num_hidden_layers
        self.seq_length_is_variable = seq_length_is_variable
        self.local_seq_length, self.global_seq_length = local_seq_length, global_seq_length
        self.disable_in_eval = disable_in_eval

    def _check_shapes(self, query: torch.Tensor, key: torch.Tensor) -> None:
        if query.dim() != 4 or query.shape[1] != self.attn_head_count or key.shape[1] != self.kv_head_count:
            raise ValueError(f"UlyssesSPAttentionHF: expected query [b, {self.attn_head_count}, s, d] and key/value "
                             f"[b, {self.kv_head_count}, s, d], got {tuple(query.shape)} and {tuple(key.shape)}")
        if not self.seq_length_is_variable and query.shape[2] != self.local_seq_length:
            raise ValueError(f"UlyssesSPAttentionHF: registered for a fixed local sequence length "
                             f"{self.local_seq_length}, got {query.shape[2]} (pass seq_length_is_variable=True)")

    def forward(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Any, *args: Any, **kwargs: Any):
        if self.disable_in_eval and not module.training:
            return self.attn(module, query, key, value, attention_mask, *args, **kwargs)
        self._check_shapes(query, key)
        # [b, h, s/P, d] -> [b, h/P, s, d]: split the heads, join the sequence
        q, k, v = (seq_all_to_all(t, self.process_group, 1, 2) for t in (query, key, value))
        # the local mask is meaningless for the joined sequence: the core attention runs causal
        context, weights = self.attn(module, q, k, v, None, *args, **kwargs)
        # transformers' attention functions return [b, s, h/P, d] -> [b, s/P, h, d]
        return seq_all_to_all(context, self.process_group, 1, 2), weights

    @classmethod
    def register_with_transformers(cls, model_name_or_path, core_attn_implementation: str,
                                   sequence_parallel_size: int, micro_batch_size: int, seq_length: int | None = None,
                                   seq_length_is_variable: bool = True, disable_in_eval: bool = False,
                                   max_length: int | None = None):
        """Build the sequence-parallel groups, route `core_attn_implementation` through Ulysses for the
        model (a model object, or a hub name / path whose config is read), and return the `mpu` to pass
        to `initialize(mpu=...)`; None when `sequence_parallel_size` is 1. DeepSpeed's signature
        (`max_length` is its deprecated name of `seq_length`). A model object split for tensor
        parallelism already gets the mesh's sp groups and its per-rank head counts."""
        if sequence_parallel_size == 1:
            return None
        if max_length is not None:
            logger.warning("register_with_transformers(max_length=...) is deprecated: use seq_length")
            seq_length = seq_length if seq_length is not None else max_length
        if not seq_length_is_variable and seq_length is None:
            raise ValueError("register_with_transformers: pass seq_length (the fixed global sequence length) or "
                             "seq_length_is_variable=True")
        if core_attn_implementation not in SUPPORTED_CORE_ATTENTION:
            raise ValueError(f"register_with_transformers: core_attn_implementation={core_attn_implementation!r} is "
                             f"not supported by Ulysses sequence parallelism; use one of {SUPPORTED_CORE_ATTENTION} "
                             "(eager attention needs the full-sequence mask that Ulysses drops)")
        from transformers import AutoConfig
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        model = model_name_or_path if hasattr(model_name_or_path, "config") else None
        config = model.config if model is not None else AutoConfig.from_pretrained(model_name_or_path)
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        model_attn = getattr(config, "_attn_implementation", None)
        if model is not None and model_attn not in (None, core_attn_implementation):
            raise ValueError(f"register_with_transformers: core_attn_implementation={core_attn_implementation!r} "
                             f"but the model runs attn_implementation={model_attn!r}; set both to the same")
        if core_attn_implementation not in ALL_ATTENTION_FUNCTIONS:
            raise ValueError(f"register_with_transformers: {core_attn_implementation!r} is not in transformers' "
                             f"attention registry ({list(ALL_ATTENTION_FUNCTIONS.valid_keys())})")
        if _REGISTERED:
            raise RuntimeError("register_with_transformers: Ulysses is already registered in this process (call "
                               "UlyssesSPAttentionHF.unregister_from_transformers() first)")
        num_heads = text_config.num_attention_heads
        num_kv_heads = getattr(text_config, "num_key_value_heads", None) or num_heads
        # a model split for tensor parallelism already (tp_model_init, or initialize()'s transform before
        # this one) holds num_heads / tp heads per rank, and its sp groups are the mesh's (strided by tp)
        tp_size = split_tp_size(model) if model is not None else 1
        check_heads(num_heads, num_kv_heads, sequence_parallel_size, tp_size)
        if not seq_length_is_variable and seq_length % sequence_parallel_size != 0:
            raise ValueError(f"{KEY}={sequence_parallel_size} does not divide seq_length={seq_length}")
        groups = initialize_sequence_parallel(sequence_parallel_size, tp_size)

        core = ALL_ATTENTION_FUNCTIONS[core_attn_implementation]
        uattn = cls(attn=core, batch_size=micro_batch_size, attn_head_count=num_heads // tp_size,
                    attn_head_size=getattr(text_config, "head_dim", None) or text_config.hidden_size // num_heads,
                    kv_head_count=num_kv_heads // tp_size, num_hidden_layers=text_config.num_hidden_layers,
                    process_group=groups.sp_group, seq_length_is_variable=seq_length_is_variable,
                    local_seq_length=None if seq_length_is_variable else seq_length // sequence_parallel_size,
                    global_seq_length=None if seq_length_is_variable else seq_length,
                    disable_in_eval=disable_in_eval)
        # with a model object, only its own attention modules go through Ulysses; another model in the
        # process that uses the same implementation keeps the core function
        owned = None if model is None else {id(m) for m in model.modules()}

        def ulysses_attention(module, query, key, value, attention_mask, *args, **kwargs):
            if owned is not None and id(module) not in owned:
                return core(module, query, key, value, attention_mask, *args, **kwargs)
            return uattn(module, query, key, value, attention_mask, *args, **kwargs)

        # transformers' registry is meant to be written (AttentionInterface); replacing the entry keeps
        # every branch transformers takes on the implementation's name (mask creation, kwargs)
        ALL_ATTENTION_FUNCTIONS[core_attn_implementation] = ulysses_attention
        _REGISTERED[core_attn_implementation] = core
        logger.info("Ulysses sequence parallelism: %s attention over %d ranks (%d heads, %d key/value heads per "
                    "tensor-parallel rank)", core_attn_implementation, sequence_parallel_size, num_heads // tp_size,
                    num_kv_heads // tp_size)
        return SequenceParallelMPU(groups)

    @classmethod
    def unregister_from_transformers(cls, core_attn_implementation: str | None = None) -> None:
        """Put back the core attention function(s) that `register_with_transformers` replaced."""
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        names = list(_REGISTERED) if core_attn_implementation is None else [core_attn_implementation]
        for name in names:
            if name not in _REGISTERED:
                raise ValueError(f"unregister_from_transformers: {name!r} is not registered ({list(_REGISTERED)})")
            ALL_ATTENTION_FUNCTIONS[name] = _REGISTERED.pop(name)


def is_registered() -> bool:
    """Whether Ulysses currently routes an attention implementation of transformers."""
    return bool(_REGISTERED)

