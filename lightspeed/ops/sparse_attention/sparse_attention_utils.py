"""`SparseAttentionUtils`: DeepSpeed's helpers for putting sparse attention into a pretrained Hugging
Face BERT / RoBERTa model: longer position embeddings, the tokenizer's length, the self-attention swap,
and padding inputs to a multiple of the block (and unpadding the output).

Owns: those static methods, with DeepSpeed's names, arguments and results. Must not: know the layout
kinds, or import transformers (models are reached through their attributes: `model.bert` /
`model.roberta`, `.embeddings.position_embeddings`, `.encoder.layer[i].attention.self`).

Note: [where lightspeed differs] Each is deliberate and keeps DeepSpeed's results where those are defined:
- the swap installs `HFBertSparseSelfAttention` (transformers 5.x's calling convention:
  bert_sparse_self_attention.py's Note: [HF protocol]); DeepSpeed installed its plain BERT layer, whose
  return value today's transformers cannot unpack. Its layout is made for
  max(2048, config.max_position_embeddings) tokens, so an extended model's lengths fit (DeepSpeed's
  layer always used 2048). DeepSpeed's `replace_model_self_attention_with_sparse_self_attention`
  called a method the model does not have; here it calls this class's layer replacement.
- extend_position_embedding also resizes the embedding's `position_ids` (and `token_type_ids`)
  buffers and `num_embeddings`, which transformers reads in forward; for RoBERTa it copies the
  original rows 0-1 (the padding positions) and continues the repetition over a short tail, rows
  DeepSpeed left uninitialised.
- pad_to_block_size leaves a None attention_mask / token_type_ids None (DeepSpeed failed on them).
- messages go to the logger, not stdout.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from lightspeed._utils.logging import get_logger

from .bert_sparse_self_attention import HFBertSparseSelfAttention
from .sparsity_config import SparsityConfig

__all__ = ["SparseAttentionUtils"]

logger = get_logger(__name__)


def _resize_position_buffers(embeddings, rows: int) -> None:
    table = embeddings.position_embeddings
    table.num_embeddings = rows
    for name, fill in (("position_ids", None), ("token_type_ids", 0)):
        old = getattr(embeddings, name, None)
        if isinstance(old, torch.Tensor) and old.dim() == 2:
            new = (torch.arange(rows, dtype=old.dtype, device=old.device) if fill is None else
                   torch.full((rows,), fill, dtype=old.dtype, device=old.device))
            persistent = name not in embeddings._non_persistent_buffers_set
            embeddings.register_buffer(name, new.expand(1, -1), persistent=persistent)


class SparseAttentionUtils:
    """Static helpers (DeepSpeed's API); see the module Notes for where behaviour differs."""

    bert_attention_class = HFBertSparseSelfAttention

    @staticmethod
    def extend_position_embedding(model, max_position):
        """Grow a BERT / RoBERTa model's position embeddings to `max_position` by repeating the trained
        ones (BERT: the table repeated max_position // original times; RoBERTa: positions 2.. repeated
        behind its two reserved rows, max_position + 2 rows). Sets config.max_position_embeddings."""
        if hasattr(model, "bert"):
            embeddings = model.bert.embeddings
            weight = embeddings.position_embeddings.weight
            original = weight.size(0)
            if max_position <= original:
                raise ValueError(f"max_position ({max_position}) must exceed the model's {original} positions")
            multiples = max(1, max_position // original)
            weight.data = weight.data.repeat(multiples, 1)
            _resize_position_buffers(embeddings, weight.size(0))
        elif hasattr(model, "roberta"):
            embeddings = model.roberta.embeddings
            weight = embeddings.position_embeddings.weight
            original = weight.size(0) - 2  # positions 0 and 1 are reserved (padding_idx = 1)
            if max_position <= original:
                raise ValueError(f"max_position ({max_position}) must exceed the model's {original} positions")
            multiples = max(1, max_position // original)
            max_position += 2
            trained = weight.data[2:]
            repeats = -(-(max_position - 2) // original)
            extended = torch.cat([weight.data[:2], trained.repeat(repeats, 1)[:max_position - 2]])
            weight.data = extended
            _resize_position_buffers(embeddings, max_position)
        else:
            raise ValueError("extend_position_embedding supports models with a `bert` or `roberta` attribute "
                             f"(HF BERT / RoBERTa heads); got {type(model).__name__}")
        model.config.max_position_embeddings = max_position
        logger.info(f"extended position embeddings to {original * multiples}")
        return model

    @staticmethod
    def update_tokenizer_model_max_length(tokenizer, max_position):
        """Set the tokenizer's `model_max_length` (and its init kwargs') to `max_position`."""
        tokenizer.model_max_length = max_position
        tokenizer.init_kwargs["model_max_length"] = max_position
        logger.info(f"updated the tokenizer's model_max_length to {max_position}")
        return tokenizer

    @classmethod
    def replace_model_self_attention_with_sparse_self_attention(cls, model, max_position,
                                                                 sparsity_config: SparsityConfig | None = None):
        """Swap every encoder layer's self-attention of a BERT / RoBERTa model for sparse attention under
        `sparsity_config`, keeping the trained projections; sets config.max_position_embeddings to
        `max_position` (RoBERTa: + 2)."""
        if hasattr(model, "bert"):
            model.config.max_position_embeddings = max_position
            cls.replace_self_attention_layer_with_sparse_self_attention_layer(model.config, model.bert.encoder.layer,
                                                                              sparsity_config)
        elif hasattr(model, "roberta"):
            model.config.max_position_embeddings = max_position + 2
            cls.replace_self_attention_layer_with_sparse_self_attention_layer(
                model.config, model.roberta.encoder.layer, sparsity_config)
        else:
            raise ValueError("replace_model_self_attention_with_sparse_self_attention supports models with a "
                             f"`bert` or `roberta` attribute (HF BERT / RoBERTa heads); got {type(model).__name__}")
        return model

    @classmethod
    def replace_self_attention_layer_with_sparse_self_attention_layer(cls, config, layers,
                                                                      sparsity_config: SparsityConfig | None = None):
        """Replace `layer.attention.self` of each of `layers` by sparse attention sharing its query / key /
        value projections."""
        if sparsity_config is None:
            raise ValueError("a sparsity_config is needed (e.g. FixedSparsityConfig(num_heads="
                             f"{config.num_attention_heads}))")
        if getattr(config, "is_decoder", False):
            raise NotImplementedError("sparse self-attention replaces encoder (bidirectional) self-attention; "
                                      "this model is configured as a decoder")
        max_len = max(2048, int(getattr(config, "max_position_embeddings", 0) or 0))
        max_len = -(-max_len // sparsity_config.block) * sparsity_config.block
        for layer in layers:
            old = layer.attention.self
            sparse = cls.bert_attention_class(config, sparsity_config, max_seq_length=max_len)
            sparse.query, sparse.key, sparse.value = old.query, old.key, old.value
            sparse.sparse_self_attention.to(old.query.weight.device)
            sparse.train(old.training)
            layer.attention.self = sparse
        return layers

    @staticmethod
    def pad_to_block_size(block_size, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                          pad_token_id, model_embeddings):
        """Pad the sequence dim of the inputs up to a multiple of `block_size`: input_ids and position_ids
        with `pad_token_id`, attention_mask with 0 (padding is not attended), token_type_ids with 0,
        inputs_embeds with `model_embeddings(pad ids)`. Returns (pad_len, input_ids, attention_mask,
        token_type_ids, position_ids, inputs_embeds), Nones kept."""
        batch_size, seq_len = input_ids.shape if input_ids is not None else inputs_embeds.shape[:-1]
        pad_len = (block_size - seq_len % block_size) % block_size
        if pad_len > 0:
            if inputs_embeds is not None:
                pad_ids = inputs_embeds.new_full((batch_size, pad_len), pad_token_id, dtype=torch.long)
                inputs_embeds = torch.cat([inputs_embeds, model_embeddings(pad_ids)], dim=-2)
            if input_ids is not None:
                input_ids = F.pad(input_ids, (0, pad_len), value=pad_token_id)
            if position_ids is not None:
                position_ids = F.pad(position_ids, (0, pad_len), value=pad_token_id)
            if attention_mask is not None:
                attention_mask = F.pad(attention_mask, (0, pad_len), value=False)
            if token_type_ids is not None:
                token_type_ids = F.pad(token_type_ids, (0, pad_len), value=0)
        return pad_len, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds

    @staticmethod
    def unpad_sequence_output(pad_len, sequence_output):
        """Drop the last `pad_len` positions of [B, L, ...] `sequence_output` (what pad_to_block_size added)."""
        if pad_len > 0:
            sequence_output = sequence_output[:, :-pad_len]
        return sequence_output
