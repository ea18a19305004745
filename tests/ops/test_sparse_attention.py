"""Block-sparse attention (lightspeed.ops.sparse_attention): the layouts against DeepSpeed's own
`make_layout` results (tests/fixtures/sparse_attention/layouts.json, made by DeepSpeed's source), the
FlexAttention BlockMask against the layout it encodes, both attention paths against dense
scaled_dot_product_attention under the same element mask, and the config section."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lightspeed.ops import sparse_attention as sa
from lightspeed.ops.sparse_attention import flex, reference

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "sparse_attention" / "layouts.json"
CASES = json.loads(FIXTURE.read_text())["cases"]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['kind']}-{c['seq_len']}-{c['seed']}")
def test_layout_equals_deepspeed(case):
    random.seed(case["seed"])
    layout = getattr(sa, case["kind"])(**case["kwargs"]).make_layout(case["seq_len"])
    expected = torch.tensor([int(c) for c in case["layout"]], dtype=torch.int64).view(case["shape"])
    assert layout.dtype == torch.int64
    assert torch.equal(layout, expected)


@pytest.mark.parametrize("make, message", [
    (lambda: sa.FixedSparsityConfig(4, num_local_blocks=4, num_global_blocks=3), "multiple of num_global_blocks"),
    (lambda: sa.FixedSparsityConfig(4, attention="causal"), "unidirectional"),
    (lambda: sa.FixedSparsityConfig(4, attention="unidirectional", horizontal_global_attention=True), "bidirectional"),
    (lambda: sa.FixedSparsityConfig(4, num_different_global_patterns=2), "different_layout_per_head"),
    (lambda: sa.FixedSparsityConfig(4, different_layout_per_head=True, num_different_global_patterns=5), "cannot exceed"),
    (lambda: sa.VariableSparsityConfig(4, global_block_indices=[0, 4], global_block_end_indices=[2]), "same length"),
    (lambda: sa.BSLongformerSparsityConfig(4, global_block_indices=[3], global_block_end_indices=[3]), "empty"),
    (lambda: sa.FixedSparsityConfig(4).make_layout(100), "multiple of the block size"),
    (lambda: sa.BigBirdSparsityConfig(4, num_random_blocks=5).make_layout(64), "num_random_blocks"),
    (lambda: sa.SparsityConfig(4).make_layout(64), "defines no layout"),
])  # fmt: skip
def test_config_errors(make, message):
    with pytest.raises((ValueError, NotImplementedError), match=message):
        make()


def _element_mask_of_block_mask(bm, heads: int, seq_len: int) -> torch.Tensor:
    """What FlexAttention's kernels compute from a BlockMask: full tiles wholly, partial tiles where the
    mask_mod allows, nothing else."""
    tile = bm.BLOCK_SIZE[0]
    n = bm.kv_num_blocks.shape[-1] * tile
    out = torch.zeros(heads, n, n, dtype=torch.bool)
    q = torch.arange(n)[:, None]
    kv = torch.arange(n)[None, :]
    for h in range(heads):
        hb = h if bm.kv_num_blocks.shape[1] > 1 else 0
        for qt in range(bm.kv_num_blocks.shape[-1]):
            rows = slice(qt * tile, (qt + 1) * tile)
            for j in bm.full_kv_indices[0, hb, qt, :int(bm.full_kv_num_blocks[0, hb, qt])].tolist():
                out[h, rows, j * tile:(j + 1) * tile] = True
            for j in bm.kv_indices[0, hb, qt, :int(bm.kv_num_blocks[0, hb, qt])].tolist():
                cols = slice(j * tile, (j + 1) * tile)
                allowed = bm.mask_mod(torch.tensor(0), torch.tensor(h), q[rows], kv[:, cols])
                out[h, rows, cols] |= allowed
    return out[:, :seq_len, :seq_len]


@pytest.mark.parametrize("config, seq_len", [
    (sa.BigBirdSparsityConfig(3, block=16, different_layout_per_head=True, num_random_blocks=2), 384),
    (sa.FixedSparsityConfig(2, block=16), 320),  # 2.5 tiles: the padded tile is partial
    (sa.BSLongformerSparsityConfig(2, block=128, num_sliding_window_blocks=3), 640),  # tiles are blocks
    (sa.VariableSparsityConfig(2, block=48, local_window_blocks=[3, 2], global_block_indices=[4]), 480),
])  # fmt: skip
def test_block_mask_encodes_layout(config, seq_len):
    random.seed(0)
    layout = config.make_layout(seq_len)
    bm = flex.layout_block_mask(layout, config.block, seq_len, "cpu")
    assert bm.BLOCK_SIZE[0] == flex.tile_size(config.block)
    full = torch.zeros(bm.full_kv_indices.shape[:3] + (bm.full_kv_indices.shape[-1],), dtype=torch.bool)
    partial = torch.zeros_like(full)
    for dense, nums, idx in ((full, bm.full_kv_num_blocks, bm.full_kv_indices), (partial, bm.kv_num_blocks,
                                                                                bm.kv_indices)):
        for pos in torch.ones(nums.shape).nonzero().tolist():
            dense[tuple(pos)][idx[tuple(pos)][:int(nums[tuple(pos)])].long()] = True
    assert not (full & partial).any()  # a tile listed as both would be computed twice by the kernels
    got = _element_mask_of_block_mask(bm, config.num_heads, seq_len)
    assert torch.equal(got, reference.expand_layout(layout, config.block))
    if config.block % 128 == 0:  # every computed tile is a whole layout block: no mask evaluated
        assert int(bm.kv_num_blocks.sum()) == 0


def _sdpa_expected(q, k, v, layout, block, rpe=None, kpm=None, kpm_mode="add", am=None, am_mode="mul"):
    """Dense attention of scaled_dot_product_attention under the element mask of the layout and masks."""
    L = q.shape[2]
    bias = torch.zeros(q.shape[0], q.shape[1], L, L)
    if rpe is not None:
        bias = bias + rpe.float()
    if kpm is not None:
        m = kpm.float()[:, None, None, :]
        bias = bias + m if kpm_mode == "add" else bias.masked_fill(m == 0, float("-inf"))
    if am is not None:
        m = am.float()[None, None]
        bias = bias + m if am_mode == "add" else bias.masked_fill(m == 0, float("-inf"))
    bias = bias.masked_fill(~reference.expand_layout(layout, block)[None], float("-inf"))
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=bias)


def _inputs(B, H, L, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, L, D, generator=g).to(dtype) for _ in range(3))
    kpm = torch.where(torch.rand(B, L, generator=g) < 0.2, -10000.0, 0.0).to(dtype)
    am = (torch.rand(L, L, generator=g) > 0.3).to(dtype)
    am.diagonal().fill_(1)  # every row keeps a key: DeepSpeed's kernel would give NaN for a fully masked row
    rpe = (0.1 * torch.randn(B, H, L, L, generator=g)).to(dtype)
    return q, k, v, kpm, am, rpe


@pytest.mark.parametrize("backend", ["flex", "reference"])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_attention_equals_dense_under_same_mask(backend, dtype, tol):
    random.seed(1)
    config = sa.BigBirdSparsityConfig(4, block=16, different_layout_per_head=True, num_random_blocks=1)
    module = sa.SparseSelfAttention(config, max_seq_length=512, backend=backend)
    L = 256
    q, k, v, kpm, am, rpe = _inputs(2, 4, L, 16, dtype)
    layout = module.get_layout(L)
    got = module(q, k.transpose(2, 3), v, rpe=rpe, key_padding_mask=kpm[:, None, None, :], attn_mask=am[None, None])
    assert got.dtype == dtype
    want = _sdpa_expected(q, k, v, layout, 16, rpe=rpe, kpm=kpm, am=am)
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    # mask modes swapped: a multiplicative key-padding mask, an additive attention mask
    module = sa.SparseSelfAttention(config, key_padding_mask_mode="mul", attn_mask_mode="add", max_seq_length=512,
                                    backend=backend)
    keep = (kpm == 0).to(dtype)
    got = module(q, k, v, key_padding_mask=keep, attn_mask=am)
    want = _sdpa_expected(q, k, v, module.get_layout(L), 16, kpm=keep, kpm_mode="mul", am=am, am_mode="add")
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def test_reference_gradients_equal_dense():
    config = sa.FixedSparsityConfig(2, block=16, num_local_blocks=2)
    module = sa.SparseSelfAttention(config, max_seq_length=128)  # CPU: "auto" is the reference path
    q, k, v, kpm, am, _ = _inputs(1, 2, 128, 8, torch.float32, seed=3)
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    got = torch.autograd.grad((module(*inputs, key_padding_mask=kpm, attn_mask=am) ** 2).sum(), inputs)
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    want = torch.autograd.grad((_sdpa_expected(*inputs, module.get_layout(128), 16, kpm=kpm, am=am) ** 2).sum(),
                               inputs)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_module_errors_and_env_backend(monkeypatch):
    module = sa.SparseSelfAttention(sa.DenseSparsityConfig(2), max_seq_length=64)
    q = torch.randn(1, 2, 48, 8)
    with pytest.raises(ValueError, match="exceeds the max_seq_length"):
        module(torch.randn(1, 2, 128, 8), torch.randn(1, 2, 128, 8), torch.randn(1, 2, 128, 8))
    with pytest.raises(ValueError, match="multiple of the sparse block size"):
        module(q[:, :, :40], q[:, :, :40], q[:, :, :40])
    with pytest.raises(ValueError, match="key_padding_mask of shape"):
        module(q, q, q, key_padding_mask=torch.zeros(2, 48))
    with pytest.raises(ValueError, match="rpe must be"):
        module(q, q, q, rpe=torch.zeros(1, 2, 48, 40))
    with pytest.raises(ValueError, match="heads"):
        module(torch.randn(1, 3, 48, 8), torch.randn(1, 3, 48, 8), torch.randn(1, 3, 48, 8))
    with pytest.raises(ValueError, match="'add' or 'mul'"):
        sa.SparseSelfAttention(sa.DenseSparsityConfig(2), attn_mask_mode="multiply")
    monkeypatch.setenv("LIGHTSPEED_OPS_BACKEND", "cuda")
    with pytest.raises(ValueError, match="LIGHTSPEED_OPS_BACKEND"):
        module(q, q, q)
    with pytest.raises(ValueError, match="backend must be one of"):
        sa.SparseSelfAttention(sa.DenseSparsityConfig(2), max_seq_length=64, backend="triton")(q, q, q)
    monkeypatch.setenv("LIGHTSPEED_OPS_BACKEND", "reference")
    module(q.requires_grad_(), q, q).sum().backward()  # the reference path: CPU autograd works


def test_config_section_builds_deepspeed_kinds(ls_caplog):
    from lightspeed.compat.deepspeed.runtime.config import DeepSpeedConfig, get_sparse_attention
    from lightspeed.config import load

    base = {"train_micro_batch_size_per_gpu": 1}
    cfg = load({**base, "sparse_attention": {"mode": "bigbird", "block": 32, "num_random_blocks": 2,
                                             "attention": "unidirectional"}}, world_size=1)
    assert cfg.sparse_attention.deepspeed_dict() == {
        "mode": "bigbird", "block": 32, "different_layout_per_head": False, "num_random_blocks": 2,
        "num_sliding_window_blocks": 3, "num_global_blocks": 1}
    assert "mode 'bigbird' does not read attention" in ls_caplog.text  # set, but not a BigBird key
    ds = DeepSpeedConfig({**base, "sparse_attention": {"mode": "fixed", "different_layout_per_head": True,
                                                       "num_different_global_patterns": 4}})
    assert ds.sparse_attention == {
        "mode": "fixed", "block": 16, "different_layout_per_head": True, "num_local_blocks": 4,
        "num_global_blocks": 1, "attention": "bidirectional", "horizontal_global_attention": False,
        "num_different_global_patterns": 4}
    sa_config = ds.sparse_attention  # what DeepSpeed scripts do with it: drop "mode", pass the rest
    del sa_config["mode"]
    assert sa.FixedSparsityConfig(num_heads=8, **sa_config).num_different_global_patterns == 4
    built = sa.sparsity_config_from_dict(DeepSpeedConfig(ds._param_dict).sparse_attention, num_heads=8)
    assert isinstance(built, sa.FixedSparsityConfig) and built.num_different_global_patterns == 4
    assert torch.equal(built.make_layout(256), sa.FixedSparsityConfig(
        8, different_layout_per_head=True, num_different_global_patterns=4).make_layout(256))
    assert DeepSpeedConfig(base).sparse_attention is None
    assert get_sparse_attention({"sparse_attention": {"mode": "dense"}}) == {"mode": "dense", "block": 16}
    assert get_sparse_attention(base) is None
    for mode in ("dense", "variable", "bslongformer"):
        d = load({**base, "sparse_attention": {"mode": mode}}, world_size=1).sparse_attention.deepspeed_dict()
        assert type(sa.sparsity_config_from_dict(d, 2)).__name__.lower().startswith(mode)


def test_loaded_layout_replaces_cached_block_mask():
    random.seed(0)
    config = sa.BigBirdSparsityConfig(2, block=16, num_random_blocks=2)
    a = sa.SparseSelfAttention(config, max_seq_length=128, backend="flex")
    b = sa.SparseSelfAttention(config, max_seq_length=128, backend="flex")
    q, k, v, *_ = _inputs(1, 2, 128, 8, torch.float32)
    assert not torch.equal(a.master_layout, b.master_layout)
    b(q, k, v)  # caches b's own block mask
    b.load_state_dict(a.state_dict())
    torch.testing.assert_close(b(q, k, v), a(q, k, v))


@pytest.mark.slow
def test_compiled_flex_consumes_block_mask_and_score_mod():
    """The GPU path's code (torch.compile(flex_attention) with the layout's BlockMask, whose full tiles
    skip the mask, and the masks' score_mod), compiled for the CPU: equal to the reference."""
    from torch.nn.attention.flex_attention import flex_attention

    random.seed(0)
    config = sa.BigBirdSparsityConfig(2, block=16, different_layout_per_head=True, num_random_blocks=1,
                                      num_sliding_window_blocks=17)
    L = 512
    layout = config.make_layout(L)
    block_mask = flex.layout_block_mask(layout, 16, L, "cpu")
    assert int(block_mask.full_kv_num_blocks.sum()) > 0 and int(block_mask.kv_num_blocks.sum()) > 0
    q, k, v, kpm, am, rpe = _inputs(1, 2, L, 16, torch.float32, seed=5)
    score_mod = flex._score_mod(rpe, kpm, am, "add", "mul")
    got = torch.compile(flex_attention, dynamic=False)(q, k, v, score_mod=score_mod, scale=0.25,
                                                       block_mask=block_mask)
    want = _sdpa_expected(q, k, v, layout, 16, rpe=rpe, kpm=kpm, am=am)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
