"""Quantized MoE experts (lightspeed/inference/experts.py): init_inference swaps transformers 5's experts
modules (3-D gate_up_proj / down_proj) for QuantizedExperts, which computes what the experts module
computes with its weights dequantized; other layouts and excluded names stay float; a saved quantized
model loads back as saved."""
from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

from lightspeed.inference import QuantizedLinear, init_inference
from lightspeed.inference.experts import QuantizedExperts, experts_layout

transformers = pytest.importorskip("transformers")

VOCAB = 96
QUANTS = [("fp6", None), ("int8", None), ("int4", 16)]


def _moe(name):
    torch.manual_seed(0)
    t = transformers
    common = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                  max_position_embeddings=64)
    if name == "mixtral":
        cfg = t.MixtralConfig(intermediate_size=96, num_local_experts=4, num_experts_per_tok=2, **common)
    else:  # qwen2_moe: 5 experts of 48, top 2, and a shared expert (plain nn.Linear layers) beside them
        cfg = t.Qwen2MoeConfig(intermediate_size=96, moe_intermediate_size=48, shared_expert_intermediate_size=80,
                               num_experts=5, num_experts_per_tok=2, **common)
    return t.AutoModelForCausalLM.from_config(cfg).eval()


def _dequantized_copy(base, quantized):
    """`base` with every weight the quantized model holds packed replaced by its dequantized value."""
    ref = copy.deepcopy(base)
    packed = dict(quantized.named_modules())
    with torch.no_grad():
        for name, module in ref.named_modules():
            got = packed.get(name)
            if isinstance(got, QuantizedLinear):
                module.weight.copy_(got.dequantize_weight())
            elif isinstance(got, QuantizedExperts):
                module.gate_up_proj.copy_(torch.stack([layer.dequantize_weight() for layer in got.gate_up]))
                module.down_proj.copy_(torch.stack([layer.dequantize_weight() for layer in got.down]))
    return ref


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
@pytest.mark.parametrize("fmt,group_size", QUANTS)
def test_quantized_experts_compute_the_dequantized_model(name, fmt, group_size):
    base = _moe(name)
    q = init_inference(copy.deepcopy(base), dtype=torch.float32, device="cpu",
                       quant={"weight": fmt, "group_size": group_size})
    experts = [m for m in q.modules() if isinstance(m, QuantizedExperts)]
    assert len(experts) == 2 and all(len(e.gate_up) == {"mixtral": 4, "qwen2_moe": 5}[name] for e in experts)
    assert not any(isinstance(experts_layout(m), tuple) for m in q.modules())  # none left in float
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(_logits(q, ids), _logits(_dequantized_copy(base, q), ids), rtol=1e-5, atol=1e-5)
    # the float expert weights are gone: only packed codes, fp16-bit scales and the layout version are left
    assert not any(key.endswith(("gate_up_proj", "down_proj")) for key in q.state_dict())
    assert {t.dtype for e in experts for t in e.buffers()} == {torch.int8, torch.int16, torch.int32}
    gen = {"attention_mask": torch.ones_like(ids[:1]), "max_new_tokens": 5, "do_sample": False, "pad_token_id": 0}
    fused = init_inference(copy.deepcopy(base), dtype=torch.float32, device="cpu", replace_with_kernel_inject=True,
                           quant={"weight": fmt, "group_size": group_size})  # q/k/v (and the shared expert) fused
    assert torch.equal(fused.generate(ids[:1], **gen), q.generate(ids[:1], **gen))


def test_experts_module_directly_with_dropped_routes():
    """Called directly, against the transformers module with the dequantized weights and its eager
    implementation (the loop QuantizedExperts follows): several tokens per expert and an expert no token
    chose. Routes to the dropped slot (index num_experts, which transformers >= 5.2x's loop skips) add
    nothing: the same as routing them anywhere with weight 0."""
    base = _moe("mixtral")
    q = init_inference(copy.deepcopy(base), dtype=torch.float32, device="cpu", quant={"weight": "int8"})
    mine, theirs = q.model.layers[0].mlp.experts, _dequantized_copy(base, q).model.layers[0].mlp.experts
    theirs.config._experts_implementation = "eager"  # its default grouped_mm sums in another order
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(6, 64, generator=gen)
    index = torch.tensor([[0, 2], [2, 0], [1, 2], [2, 1], [0, 1], [1, 2]])  # expert 3 unused
    weights = torch.rand(6, 2, generator=gen)
    with torch.no_grad():
        torch.testing.assert_close(mine(x, index, weights), theirs(x, index, weights), rtol=1e-5, atol=1e-6)
        dropped = index.clone()
        dropped[2:4, 1] = 4
        zeroed = weights.clone()
        zeroed[2:4, 1] = 0
        torch.testing.assert_close(mine(x, dropped, weights), mine(x, index, zeroed), rtol=1e-6, atol=1e-7)


def _eager_loop(module, x, index, weights):
    """QuantizedExperts' per-expert loop (the path above MAX_GROUPED_ROWS routes), however many routes."""
    stacks, module._stacks = module._stacks, None
    try:
        return module(x, index, weights)
    finally:
        module._stacks = stacks


@pytest.mark.parametrize("k", [1, 2, 4])
def test_grouped_path_matches_the_expert_loop(k):
    """Up to MAX_GROUPED_ROWS routes (a decode step) run through the grouped products: routes sorted by
    expert, each token's results summed in expert order, dropped routes zero; against the loop, for every
    route count from 1 token to the limit, and the loop beyond it. The experts' buffers are views of the
    stacks (the state dict keeps per-expert names; a checkpoint of them saves: test below)."""
    from lightspeed.ops.wquant import MAX_GROUPED_ROWS

    q = init_inference(_moe("qwen2_moe"), dtype=torch.float32, device="cpu",
                       quant={"weight": "int4", "group_size": 16})
    mine = q.model.layers[0].mlp.experts
    stack = mine._stacks[0].planes[0]
    assert all(layer.qweight.untyped_storage().data_ptr() == stack.untyped_storage().data_ptr()
               for layer in mine.gate_up)
    gen = torch.Generator().manual_seed(7)
    for tokens in (1, 3, MAX_GROUPED_ROWS // k, MAX_GROUPED_ROWS // k + 1):
        x = torch.randn(tokens, 64, generator=gen)
        index = torch.stack([torch.randperm(5, generator=gen)[:k] for _ in range(tokens)])
        index[0, -1] = 5  # a dropped route
        weights = torch.rand(tokens, k, generator=gen)
        with torch.no_grad():
            torch.testing.assert_close(mine(x, index, weights), _eager_loop(mine, x, index, weights), rtol=1e-5,
                                       atol=1e-6)


def test_grouped_experts_compile_to_one_graph():
    """torch.compile(fullgraph=True) of QuantizedExperts: each grouped product one operator node, output
    equal to eager; with a gradient wanted the per-expert loop runs (the grouped product has no backward)."""
    q = init_inference(_moe("mixtral"), dtype=torch.float32, device="cpu", quant={"weight": "fp6"})
    mine = q.model.layers[0].mlp.experts
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(mine, backend=backend, fullgraph=True)
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(3, 64, generator=gen)
    index = torch.tensor([[0, 2], [3, 0], [1, 4]])
    weights = torch.rand(3, 2, generator=gen)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, index, weights), mine(x, index, weights), rtol=1e-6, atol=1e-6)
    op = torch.ops.lightspeed.grouped_quantized_matmul
    assert len(graphs) == 1 and sum(n.target in (op, op.default) for n in graphs[0].graph.nodes) == 2
    x.requires_grad_(True)
    mine(x, index, weights).sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_grouped_path_in_chunks_matches_the_expert_loop():
    """More routes than one grouped launch takes (the path a CUDA-graph capture of a long prompt runs):
    chunks of MAX_GROUPED_ROWS routes, against the loop."""
    from lightspeed.ops.wquant import MAX_GROUPED_ROWS

    q = init_inference(_moe("mixtral"), dtype=torch.float32, device="cpu", quant={"weight": "fp6"})
    mine = q.model.layers[1].mlp.experts
    gen = torch.Generator().manual_seed(11)
    tokens = MAX_GROUPED_ROWS + 7  # two full chunks of 32 tokens x top-2, then 7
    x = torch.randn(tokens, 64, generator=gen)
    index = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(tokens)])
    weights = torch.rand(tokens, 2, generator=gen)
    with torch.no_grad():
        torch.testing.assert_close(mine._grouped(x, index, weights), _eager_loop(mine, x, index, weights),
                                   rtol=1e-5, atol=1e-6)


class _BiasedExperts(nn.Module):
    """The layout of an experts module with biases (GPT-OSS-like flags): not what QuantizedExperts holds."""

    def __init__(self):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(2, 32, 16))
        self.down_proj = nn.Parameter(torch.randn(2, 16, 16))
        self.act_fn = nn.SiLU()
        self.has_bias = True

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return hidden_states


def test_other_layouts_and_excluded_names_stay_float(ls_caplog):
    model = nn.Sequential(_BiasedExperts())
    init_inference(model, dtype=torch.float32, device="cpu", quant={"weight": "int8"})
    assert isinstance(model[0], _BiasedExperts) and "has_bias=True" in ls_caplog.text
    q = init_inference(_moe("mixtral"), dtype=torch.float32, device="cpu",
                       quant={"weight": "fp6", "exclude": ["*.experts"]})
    assert not any(isinstance(m, QuantizedExperts) for m in q.modules())
    assert isinstance(q.model.layers[0].self_attn.q_proj, QuantizedLinear)


class _ListMoe(nn.Module):
    """transformers 4's MoE block layout: an nn.Linear router with one output per expert, a ModuleList of
    per-expert MLPs, a shared expert and its one-output gate."""

    def __init__(self, hidden=64, inter=96, experts=4):
        super().__init__()
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(hidden, inter), nn.Linear(inter, hidden))
                                     for _ in range(experts))
        self.shared_expert = nn.Sequential(nn.Linear(hidden, inter), nn.Linear(inter, hidden))
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)


def test_moe_routers_stay_float_unless_included(ls_caplog):
    """A MoE block's routing layers (one output per expert, or one) are kept float, logged, as vLLM and
    llama.cpp keep them; the experts' and the shared expert's layers are quantized; `include` quantizes
    a router."""
    ls_caplog.set_level(logging.INFO, logger="lightspeed")
    model = nn.Sequential(_ListMoe())
    init_inference(model, dtype=torch.float32, device="cpu", quant={"weight": "int8"})
    block = model[0]
    assert type(block.gate) is nn.Linear and type(block.shared_expert_gate) is nn.Linear
    assert "keeping 0.gate unquantized (MoE router" in ls_caplog.text
    assert all(isinstance(m, QuantizedLinear) for e in block.experts for m in e)
    assert all(isinstance(m, QuantizedLinear) for m in block.shared_expert)
    model = nn.Sequential(_ListMoe())
    init_inference(model, dtype=torch.float32, device="cpu", quant={"weight": "int8", "include": ["0.gate"]})
    assert isinstance(model[0].gate, QuantizedLinear) and type(model[0].shared_expert_gate) is nn.Linear
    q = init_inference(_moe("qwen2_moe"), dtype=torch.float32, device="cpu", quant={"weight": "fp6"})
    mlp = q.model.layers[0].mlp
    assert type(mlp.shared_expert_gate) is nn.Linear and isinstance(mlp.shared_expert.up_proj, QuantizedLinear)


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_checkpoint_of_per_expert_matrices_loads(name, device, tmp_path, ls_caplog):
    """A transformers checkpoint directory as on disk (save_pretrained writes the original per-expert
    names: Mixtral's `block_sparse_moe.experts.N.w1/w3/w2` and router, Qwen-MoE's
    `mlp.experts.N.gate_proj/up_proj/down_proj`), loaded by `checkpoint=` into a meta model: quantized,
    the same logits as quantizing the model itself; float, the model's own logits; experts excluded from
    quantization keep float 3-D weights. Every checkpoint tensor is used. CUDA: fp16, through the kernels."""
    from lightspeed import OnDevice

    base = _moe(name)
    base.save_pretrained(tmp_path)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1)).to(device)
    dtype = torch.float16 if device == "cuda" else torch.float32

    def meta_model():
        with OnDevice(dtype=torch.float32, device="meta"):
            return transformers.AutoModelForCausalLM.from_config(base.config).eval()

    quant = {"weight": "int8"}
    ls_caplog.set_level(logging.INFO, logger="lightspeed")  # the loader's note of unused checkpoint tensors
    loaded = init_inference(meta_model(), dtype=dtype, device=device, checkpoint=str(tmp_path), quant=quant)
    assert isinstance(loaded.model.layers[1].mlp.experts, QuantizedExperts)
    assert "does not use" not in ls_caplog.text and "load_checkpoint" not in ls_caplog.text
    want = init_inference(copy.deepcopy(base), dtype=dtype, device=device, quant=quant)
    assert torch.equal(_logits(loaded, ids), _logits(want, ids))
    plain = init_inference(meta_model(), dtype=dtype, device=device, checkpoint=str(tmp_path))
    own = init_inference(copy.deepcopy(base), dtype=dtype, device=device)
    torch.testing.assert_close(_logits(plain, ids), _logits(own, ids), rtol=1e-6, atol=1e-6)
    mixed = init_inference(meta_model(), dtype=dtype, device=device, checkpoint=str(tmp_path),
                           quant={"weight": "int8", "exclude": ["*.experts"]})
    experts = mixed.model.layers[0].mlp.experts
    assert not isinstance(experts, QuantizedExperts)
    torch.testing.assert_close(experts.down_proj, base.model.layers[0].mlp.experts.down_proj.to(device, dtype))


def test_checkpoint_missing_an_expert_is_an_error(tmp_path):
    from safetensors.torch import load_file, save_file

    from lightspeed import OnDevice
    from lightspeed.checkpoint.errors import CheckpointError

    base = _moe("mixtral")
    base.save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    del state["model.layers.1.block_sparse_moe.experts.3.w3.weight"]
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with OnDevice(dtype=torch.float32, device="meta"):
        meta = transformers.AutoModelForCausalLM.from_config(base.config).eval()
    with pytest.raises(CheckpointError, match="lacks expert 3 of 'model.layers.1.mlp.experts.gate_up_proj'"):
        init_inference(meta, dtype=torch.float32, device="cpu", checkpoint=str(tmp_path), quant={"weight": "int4"})


def test_saved_quantized_experts_load_back_as_saved(tmp_path):
    """save_mp_checkpoint_path writes each expert's packed layers; a model built on the meta device loads
    them as saved (no quantization call), with the same logits; asking for another format is an error."""
    from lightspeed import OnDevice
    import lightspeed.inference.quantized_linear as ql

    base = _moe("qwen2_moe")
    q = init_inference(copy.deepcopy(base), dtype=torch.float32, device="cpu", quant={"weight": "int4", "group_size": 16},
                       save_mp_checkpoint_path=tmp_path)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))

    def meta_model():
        with OnDevice(dtype=torch.float32, device="meta"):
            return transformers.AutoModelForCausalLM.from_config(base.config).eval()

    keep, ql.quantize = ql.quantize, None  # any quantization call would fail
    try:
        loaded = init_inference(meta_model(), dtype=torch.float32, device="cpu", checkpoint=str(tmp_path))
    finally:
        ql.quantize = keep
    assert isinstance(loaded.model.layers[1].mlp.experts, QuantizedExperts)
    assert torch.equal(_logits(loaded, ids), _logits(q, ids))
    with pytest.raises(ValueError, match="experts .* are saved as int4 .* but fp6"):  # linears excluded: they load
        init_inference(meta_model(), dtype=torch.float32, device="cpu", checkpoint=str(tmp_path),  # as saved
                       quant={"weight": "fp6", "exclude": ["*proj", "*gate"]})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fmt", ["fp6", "int4"])
def test_cuda_quantized_experts(fmt):
    """The Triton kernels at the experts' small per-expert M: logits against the dequantized fp16 model."""
    base = _moe("mixtral")
    q = init_inference(copy.deepcopy(base), dtype=torch.float16, quant={"weight": fmt})
    ref = _dequantized_copy(base, q).to("cuda", torch.float16)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1)).cuda()
    a, b = _logits(q, ids).float(), _logits(ref, ids).float()
    assert ((a - b).norm() / b.norm()).item() < 5e-3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_cuda_moe_generate_in_a_cuda_graph(name):
    """A decode step's experts run as grouped launches without a host sync, so a MoE model's generate
    replays from a CUDA graph: tokens equal to eager generate with the same static cache, logits to
    fp16 rounding (the prompt's 2 x 7 x 2 routes take the grouped path too; the loop is compared above)."""
    base = _moe(name)
    eager = init_inference(copy.deepcopy(base), dtype=torch.float16, quant={"weight": "fp6"})
    graphed = init_inference(base, dtype=torch.float16, quant={"weight": "fp6"}, enable_cuda_graph=True)
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(2)).cuda()

    def generate(model, **kw):
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                             pad_token_id=0, return_dict_in_generate=True, output_logits=True, **kw)
        return out.sequences, torch.stack(out.logits)

    want_ids, want_logits = generate(eager, cache_implementation="static", disable_compile=True)
    got_ids, got_logits = generate(graphed)
    runner = graphed.forward.graphs
    assert runner.captures == 1 and not runner.eager
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_logits, want_logits, rtol=0, atol=2e-3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_long_input_captures_in_chunks():
    """A forward of more routes than one grouped launch takes (2 x 40 tokens x top-2), called again with
    enable_cuda_graph: captured (the grouped path in chunks: the loop's host sync would fail the capture),
    its logits those of the eager model (whose loop runs the same experts)."""
    base = _moe("mixtral")
    eager = init_inference(copy.deepcopy(base), dtype=torch.float16, quant={"weight": "fp6"})
    graphed = init_inference(base, dtype=torch.float16, quant={"weight": "fp6"}, enable_cuda_graph=True)
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(4)).cuda()
    with torch.no_grad():
        for _ in range(3):  # warm-up, capture, replay
            got = graphed(ids, use_cache=False).logits
        want = eager(ids, use_cache=False).logits
    assert graphed.forward.graphs.captures == 1 and not graphed.forward.graphs.eager
    torch.testing.assert_close(got, want, rtol=0, atol=2e-3)
