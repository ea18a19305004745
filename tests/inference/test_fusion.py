"""init_inference(replace_with_kernel_inject=True): sibling projections (q/k/v, gate/up, query/key/value)
fused into one layer (lightspeed/inference/fusion.py). The fused model computes what the unfused one
does (dense and quantized, on tiny transformers models of several families), with one product per group
per forward; a quantized group's packed weight is its parts' codes and scales stacked; a part called
with another input is still exact; groups that cannot be fused are left as they are; checkpoints keep
the model's own names; torch.compile and CUDA graphs run the fused model."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightspeed.inference import QuantizedLinear, init_inference
from lightspeed.inference.fusion import FusedLinear, FusedPart, concat_quantized, fuse_projections
from lightspeed.ops.wquant import dequantize, quantize
from lightspeed.ops.wquant.reference import reference_matmul

transformers = pytest.importorskip("transformers")

VOCAB = 96
QUANTS = [None, {"weight": "fp6"}, {"weight": "int8"}, {"weight": "int4", "group_size": 32}]


def _family(name):
    torch.manual_seed(0)
    t = transformers
    if name == "llama":  # grouped-query attention: parts of unequal width
        cfg = t.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64)
    elif name == "opt":  # biases
        cfg = t.OPTConfig(num_hidden_layers=2, hidden_size=64, ffn_dim=96, num_attention_heads=4,
                          word_embed_proj_dim=64, vocab_size=VOCAB, max_position_embeddings=64)
    elif name == "gpt_neo":
        cfg = t.GPTNeoConfig(num_layers=2, hidden_size=64, num_heads=4, attention_types=[[["global", "local"], 1]],
                             vocab_size=VOCAB, max_position_embeddings=64, window_size=4)
    else:  # bert: an encoder, query/key/value with biases
        cfg = t.BertConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                           vocab_size=VOCAB, max_position_embeddings=64)
        return t.BertModel(cfg).eval()
    return t.AutoModelForCausalLM.from_config(cfg).eval()


GROUPS_PER_LAYER = {"llama": 2, "opt": 1, "gpt_neo": 1, "bert": 1}


def _ids():
    return torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))


def _out(model, ids):
    with torch.no_grad():
        out = model(ids)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def _bytes(model):
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


@pytest.mark.parametrize("name", list(GROUPS_PER_LAYER))
@pytest.mark.parametrize("quant", QUANTS, ids=lambda q: q and q["weight"] or "dense")
def test_fused_model_matches_the_unfused_one(name, quant):
    base = _family(name)
    plain = init_inference(copy.deepcopy(base), dtype=torch.float32, device="cpu", quant=quant)
    fused = init_inference(copy.deepcopy(base), dtype=torch.float32, device="cpu", quant=quant,
                           replace_with_kernel_inject=True)
    groups = [m for m in fused.modules() if isinstance(m, FusedLinear)]
    assert len(groups) == 2 * GROUPS_PER_LAYER[name]
    assert all(isinstance(g.layer, QuantizedLinear if quant else nn.Linear) for g in groups)
    # the parts hold nothing: the weights are there once (quantized: one layout_version buffer and one
    # 32-row padding per group instead of per part)
    assert _bytes(fused) == _bytes(plain) if quant is None else _bytes(fused) <= _bytes(plain)
    calls = []
    for g in groups:
        g.layer.register_forward_hook(lambda *a: calls.append(1))
    ids = _ids()
    torch.testing.assert_close(_out(fused, ids), _out(plain, ids), rtol=1e-6, atol=1e-6)
    assert len(calls) == len(groups)  # one product per group per forward
    assert all(g._kept is None for g in groups)  # nothing kept once every part took its rows
    if name != "bert":
        gen = {"attention_mask": torch.ones_like(ids[:1]), "max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
        assert torch.equal(fused.generate(ids[:1], **gen), plain.generate(ids[:1], **gen))


@pytest.mark.parametrize("fmt,group_size", [("fp6", None), ("int8", None), ("int4", None), ("int4", 48),
                                            ("int8", 96)])
def test_quantized_parts_are_stacked_bit_for_bit(fmt, group_size):
    """Parts of 37, 50 and 13 rows (none a multiple of the 32-row storage group), K = 192 (padded to the
    128-value pack tile): the fused weight dequantizes to the parts' weights stacked, and its product is
    theirs side by side."""
    gen = torch.Generator().manual_seed(4)
    layers = [QuantizedLinear.from_float(torch.randn(n, 192, generator=gen) * 0.1, torch.randn(n, generator=gen),
                                         weight=fmt, group_size=group_size) for n in (37, 50, 13)]
    fused = concat_quantized(layers)
    assert (fused.out_features, fused.in_features) == (100, 192)
    assert torch.equal(fused.dequantize_weight(), torch.cat([layer.dequantize_weight() for layer in layers]))
    x = torch.randn(5, 192, generator=gen)
    torch.testing.assert_close(fused(x), torch.cat([layer(x) for layer in layers], dim=-1), rtol=1e-6, atol=1e-6)
    whole = quantize(torch.cat([dequantize(layer.quantized_weight()) for layer in layers]), fmt, group_size)
    assert torch.equal(reference_matmul(x, whole), reference_matmul(x, fused.quantized_weight()))


class _Attention(nn.Module):
    def __init__(self, quant=None):
        super().__init__()
        torch.manual_seed(0)
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(32, 32), nn.Linear(32, 16), nn.Linear(32, 16)
        if quant:
            for name in ("q_proj", "k_proj", "v_proj"):
                setattr(self, name, QuantizedLinear.from_linear(getattr(self, name), quant))

    def forward(self, x):
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)


@pytest.mark.parametrize("quant", [None, "int8"])
def test_a_part_called_with_another_input_is_exact(quant, ls_caplog):
    """Parts take the kept product only for the same tensor, unchanged: another tensor, or the same one
    changed in place, gets its own product (a warning, once, when a kept product was left untaken)."""
    plain = _Attention(quant)
    block = copy.deepcopy(plain)
    assert fuse_projections(block) == ["qkv_proj"]
    group = block.qkv_proj
    x1, x2 = torch.randn(3, 32), torch.randn(3, 32)
    with torch.no_grad():
        assert torch.equal(block.q_proj(x1), plain.q_proj(x1))
        assert torch.equal(block.k_proj(x2), plain.k_proj(x2))  # another input
        assert "k_proj/v_proj had not taken" in ls_caplog.text
        assert torch.equal(block.v_proj(x2), plain.v_proj(x2))
        assert torch.equal(block.q_proj(x2), plain.q_proj(x2))  # the kept product of x2: all three served
        assert group._kept is None
        q = block.q_proj(x1)
        x1.mul_(2)  # changed in place: k must not take the rows computed before
        assert torch.equal(block.k_proj(x1), plain.k_proj(x1)) and torch.equal(q, plain.q_proj(x1 / 2))
        with torch.inference_mode():  # no version counter: matched by identity
            x3 = torch.randn(3, 32)
            got, want = block(x3), plain(x3)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert ls_caplog.text.count("had not taken") == 1
    part = block.k_proj
    assert isinstance(part, FusedPart) and (part.in_features, part.out_features, part.rows) == (32, 16, (32, 48))
    if quant:
        assert not hasattr(part, "weight")  # packed: the group's `layer.dequantize_weight()` has it
    else:
        assert torch.equal(part.weight, plain.k_proj.weight) and torch.equal(part.bias, plain.k_proj.bias)
        assert part.weight.data_ptr() == group.layer.weight.data_ptr() + 32 * 32 * 4  # a view


def test_groups_that_cannot_be_fused_are_left_as_they_are(ls_caplog):
    """A group whose members differ (v_proj excluded from quantization) or carry hooks, and a block that
    may cross-attend (BART), keep their layers; a model with no group runs as it is, with a warning."""
    ls_caplog.set_level("INFO", logger="lightspeed")
    model = init_inference(_family("llama"), dtype=torch.float32, device="cpu", replace_with_kernel_inject=True,
                           quant={"weight": "int8", "exclude": ["*.v_proj"]})
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.q_proj, QuantizedLinear) and isinstance(layer.mlp.gate_proj, FusedPart)
    assert "not fusing model.layers.0.self_attn.qkv_proj: not all nn.Linear or all QuantizedLinear" in ls_caplog.text
    block = _Attention()
    block.k_proj.register_forward_hook(lambda *a: None)
    assert fuse_projections(block) == [] and "hooks on a member" in ls_caplog.text
    cfg = transformers.BartConfig(encoder_layers=1, decoder_layers=1, d_model=32, encoder_ffn_dim=64,
                                  decoder_ffn_dim=64, encoder_attention_heads=2, decoder_attention_heads=2,
                                  vocab_size=VOCAB)
    bart = transformers.BartForConditionalGeneration(cfg).eval()
    init_inference(bart, dtype=torch.float32, device="cpu", replace_with_kernel_inject=True)
    assert not any(isinstance(m, FusedLinear) for m in bart.modules())
    assert "may cross-attend" in ls_caplog.text and "has no projection group to fuse" in ls_caplog.text


def test_a_saved_checkpoint_keeps_the_model_names(tmp_path):
    """save_mp_checkpoint_path writes the layers before fusion, so the files load into a fresh model
    (fused again or not) and give the same outputs."""
    from lightspeed import OnDevice

    base = _family("llama")
    fused = init_inference(copy.deepcopy(base), dtype=torch.float32, device="cpu", quant={"weight": "fp6"},
                           replace_with_kernel_inject=True, save_mp_checkpoint_path=tmp_path)
    ids = _ids()
    want = _out(fused, ids)
    for inject in (True, False):
        with OnDevice(dtype=torch.float32, device="meta"):
            meta = transformers.AutoModelForCausalLM.from_config(base.config).eval()
        loaded = init_inference(meta, dtype=torch.float32, device="cpu", checkpoint=str(tmp_path),
                                replace_with_kernel_inject=inject)
        assert isinstance(loaded.model.layers[1].self_attn.q_proj, FusedPart if inject else QuantizedLinear)
        torch.testing.assert_close(_out(loaded, ids), want, rtol=1e-6, atol=1e-6)


def test_compiled_fused_model_runs_one_operator_per_group():
    """torch.compile(fullgraph=True): the three parts' calls trace to one quantized product (the kept
    output is matched by identity while tracing), and the compiled model computes the eager one's."""
    from torch._dynamo.backends.common import aot_autograd

    model = init_inference(_family("llama"), dtype=torch.float32, device="cpu", quant={"weight": "fp6"},
                           replace_with_kernel_inject=True)
    graphs = []

    def keep(gm, _):
        graphs.append(gm)
        return gm

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=aot_autograd(fw_compiler=keep), fullgraph=True)
    for seed in range(3):
        ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(seed))
        torch.testing.assert_close(_out(compiled, ids), _out(model, ids), rtol=1e-6, atol=1e-6)
    op = torch.ops.lightspeed.quantized_matmul.default
    assert [sum(node.target == op for node in gm.graph.nodes) for gm in graphs] == [2 * (2 + 2)]  # qkv, o, gate_up, down


def test_fused_model_under_cuda_graphs(monkeypatch):
    """generate replays the fused model's decode steps (CPU fake graphs) and gives the unfused model's
    tokens and logits."""
    from lightspeed.inference import cuda_graph
    from tests.inference.fake_cuda_graph import use_fake_graphs

    use_fake_graphs(monkeypatch)
    base = _family("llama")
    plain = init_inference(copy.deepcopy(base), dtype=torch.float32, device="cpu", quant={"weight": "fp6"})
    fused = init_inference(copy.deepcopy(base), dtype=torch.float32, device="cpu", quant={"weight": "fp6"},
                           replace_with_kernel_inject=True)
    runner = cuda_graph.install(fused, torch.device("cpu"))
    ids = _ids()[:1]
    gen = {"attention_mask": torch.ones_like(ids), "max_new_tokens": 8, "do_sample": False, "pad_token_id": 0,
           "return_dict_in_generate": True, "output_logits": True}
    want = plain.generate(ids, cache_implementation="static", **gen)
    got = fused.generate(ids, **gen)
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), rtol=1e-6, atol=1e-6)
    assert runner.captures == 1 and not runner.eager


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("quant", [None, "fp6", "int4"])
def test_cuda_fused_generate_with_graphs_matches_unfused(quant):
    """On the GPU (Triton kernels, cuBLAS), with enable_cuda_graph: tokens equal the unfused model's eager
    generate, logits to fp16 rounding."""
    kwargs = {"quant": {"weight": quant}} if quant else {}
    base = _family("llama")
    plain = init_inference(copy.deepcopy(base), dtype=torch.float16, **kwargs)
    fused = init_inference(copy.deepcopy(base), dtype=torch.float16, replace_with_kernel_inject=True,
                           enable_cuda_graph=True, **kwargs)
    ids = _ids().cuda()
    gen = {"attention_mask": torch.ones_like(ids), "max_new_tokens": 8, "do_sample": False, "pad_token_id": 0,
           "return_dict_in_generate": True, "output_logits": True, "cache_implementation": "static"}
    want = plain.generate(ids, disable_compile=True, **gen)
    got = fused.generate(ids, **gen)
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), rtol=0, atol=2e-3)
    assert fused.forward.graphs.captures == 1 and not fused.forward.graphs.eager
