"""Sparse attention inside Hugging Face BERT / RoBERTa (SparseAttentionUtils, HFBertSparseSelfAttention)
and DeepSpeed's BERT layer: with a Dense layout a swapped model gives the dense model's outputs."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lightspeed.ops import sparse_attention as sa  # noqa: E402

HIDDEN, HEADS, POSITIONS = 32, 4, 64


def _config(cls, attn):
    config = cls(vocab_size=60, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=HEADS,
                 intermediate_size=64, max_position_embeddings=POSITIONS + (2 if cls is transformers.RobertaConfig else 0),
                 hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=1)
    config._attn_implementation = attn
    return config


def _batch(L=48):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, 60, (2, L), generator=g)
    mask = torch.ones(2, L, dtype=torch.long)
    mask[1, L - 11:] = 0  # the second row is padded
    ids[1, L - 11:] = 1
    return ids, mask


@pytest.mark.parametrize("family, attn", [("bert", "eager"), ("bert", "sdpa"), ("roberta", "eager")])
def test_dense_layout_swap_keeps_outputs(family, attn):
    cfg_cls, model_cls = ((transformers.BertConfig, transformers.BertForMaskedLM) if family == "bert" else
                          (transformers.RobertaConfig, transformers.RobertaForMaskedLM))
    torch.manual_seed(0)
    model = model_cls(_config(cfg_cls, attn)).eval()
    ids, mask = _batch()
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
    sa.SparseAttentionUtils.replace_model_self_attention_with_sparse_self_attention(
        model, POSITIONS, sa.DenseSparsityConfig(num_heads=HEADS, block=16))
    layers = getattr(model, family).encoder.layer
    assert all(isinstance(layer.attention.self, sa.HFBertSparseSelfAttention) for layer in layers)
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask).logits
    keep = mask.bool()  # padded positions' outputs are not defined the same way by both
    torch.testing.assert_close(got[keep], want[keep], atol=1e-5, rtol=1e-5)
    # a sparse layout changes the outputs (the swap is really in the forward path)
    sa.SparseAttentionUtils.replace_model_self_attention_with_sparse_self_attention(
        model, POSITIONS, sa.LocalSlidingWindowSparsityConfig(HEADS, block=16, num_sliding_window_blocks=1))
    with torch.no_grad():
        assert not torch.allclose(model(input_ids=ids, attention_mask=mask).logits[keep], want[keep], atol=1e-3)


def test_bert_sparse_self_attention_layer_matches_hf_layer():
    config = _config(transformers.BertConfig, "eager")
    torch.manual_seed(0)
    hf = transformers.models.bert.modeling_bert.BertSelfAttention(config).eval()
    layer = sa.BertSparseSelfAttention(config, sa.DenseSparsityConfig(num_heads=HEADS, block=16))
    layer.load_state_dict(hf.state_dict(), strict=False)
    x = torch.randn(2, 32, HIDDEN)
    additive = torch.zeros(2, 1, 1, 32)
    additive[0, ..., 20:] = -10000.0  # DeepSpeed's extended BERT mask: [B, 1, 1, L], added
    want, _ = hf(x, attention_mask=additive)
    torch.testing.assert_close(layer(x, additive), want, atol=1e-5, rtol=1e-5)


def test_hf_mask_that_differs_per_query_is_refused():
    config = _config(transformers.BertConfig, "eager")
    layer = sa.HFBertSparseSelfAttention(config, sa.DenseSparsityConfig(num_heads=HEADS, block=16))
    causal = torch.ones(32, 32, dtype=torch.bool).tril()[None, None].expand(2, 1, 32, 32)
    with pytest.raises(NotImplementedError, match="differs per query"):
        layer(torch.randn(2, 32, HIDDEN), attention_mask=causal)


def test_extend_position_embedding_and_padding_helpers():
    torch.manual_seed(0)
    model = transformers.BertForMaskedLM(_config(transformers.BertConfig, "eager")).eval()
    old = model.bert.embeddings.position_embeddings.weight.detach().clone()
    sa.SparseAttentionUtils.extend_position_embedding(model, 2 * POSITIONS)
    new = model.bert.embeddings.position_embeddings.weight
    assert new.shape == (2 * POSITIONS, HIDDEN) and model.config.max_position_embeddings == 2 * POSITIONS
    assert torch.equal(new[:POSITIONS], old) and torch.equal(new[POSITIONS:], old)
    sa.SparseAttentionUtils.replace_model_self_attention_with_sparse_self_attention(
        model, 2 * POSITIONS, sa.BSLongformerSparsityConfig(num_heads=HEADS, block=16))
    ids, mask = _batch(L=100)  # longer than the original table, not a multiple of the block
    pad_len, ids_p, mask_p, types_p, pos_p, emb_p = sa.SparseAttentionUtils.pad_to_block_size(
        16, ids, mask, torch.zeros_like(ids), None, None, pad_token_id=1, model_embeddings=None)
    assert pad_len == 12 and ids_p.shape == (2, 112) and pos_p is None and emb_p is None
    assert (ids_p[:, 100:] == 1).all() and (mask_p[:, 100:] == 0).all() and (types_p[:, 100:] == 0).all()
    with torch.no_grad():
        hidden = model.bert(input_ids=ids_p, attention_mask=mask_p, token_type_ids=types_p).last_hidden_state
    assert sa.SparseAttentionUtils.unpad_sequence_output(pad_len, hidden).shape == (2, 100, HIDDEN)

    roberta = transformers.RobertaForMaskedLM(_config(transformers.RobertaConfig, "eager"))
    old = roberta.roberta.embeddings.position_embeddings.weight.detach().clone()
    sa.SparseAttentionUtils.extend_position_embedding(roberta, 2 * POSITIONS + 10)
    new = roberta.roberta.embeddings.position_embeddings.weight
    assert new.shape == (2 * POSITIONS + 12, HIDDEN) and roberta.config.max_position_embeddings == 2 * POSITIONS + 12
    assert torch.equal(new[:2 + POSITIONS], old) and torch.equal(new[2 + POSITIONS:2 + 2 * POSITIONS], old[2:])

    tokenizer = type("Tok", (), {"model_max_length": 64, "init_kwargs": {}})()
    sa.SparseAttentionUtils.update_tokenizer_model_max_length(tokenizer, 4096)
    assert tokenizer.model_max_length == 4096 and tokenizer.init_kwargs["model_max_length"] == 4096


def test_compat_alias_classes():
    from lightspeed.compat.deepspeed.ops import sparse_attention as ds_sa
    from lightspeed.compat.deepspeed.ops.sparse_attention.sparsity_config import FixedSparsityConfig

    assert FixedSparsityConfig is sa.FixedSparsityConfig
    module = ds_sa.SparseSelfAttention(sa.DenseSparsityConfig(2), max_seq_length=64)
    assert isinstance(module, sa.SparseSelfAttention) and module.get_layout(32).shape == (2, 2, 2)  # no group: no-op
    bert = ds_sa.BertSparseSelfAttention(_config(transformers.BertConfig, "eager"), sa.DenseSparsityConfig(HEADS))
    assert type(bert.sparse_self_attention) is ds_sa.SparseSelfAttention
    assert ds_sa.SparseAttentionUtils.bert_attention_class.attention_class is ds_sa.SparseSelfAttention
    from lightspeed.compat.deepspeed.ops.sparse_attention.matmul import MatMul

    with pytest.raises(NotImplementedError, match="block-sparse matmul"):
        MatMul(torch.ones(1, 2, 2), 16, "sdd")
