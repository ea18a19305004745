"""init_inference with tensor parallelism on real gloo processes (world sizes 1, 2, 4) against the
single-process model: logits, greedy generation, the slices each rank keeps (whole and quantized), the
checkpoint path (each rank quantizes its slice as it loads), DeepSpeed's injection_policy form, a row-parallel
bias, torch.compile over the all-reduce hooks, MoE experts (Mixtral, Qwen2-MoE) split inside every expert, and the
plan's checks. One world runs several scenarios to keep the process start-ups few."""

from __future__ import annotations

import copy

import pytest
import torch

from lightspeed.testing.run_world import run_world

transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.dist, pytest.mark.timeout(240)]

VOCAB = 96


def _cfg(kv_heads=4):
    return transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=8,
                                    num_key_value_heads=kv_heads, vocab_size=VOCAB, max_position_embeddings=64)


def _model(kv_heads=4):
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(_cfg(kv_heads)).eval()


def _ids():
    return torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(3))


def _run(model):
    ids = _ids()
    with torch.no_grad():
        logits = model(ids).logits
    out = model.generate(ids[:1], attention_mask=torch.ones_like(ids[:1]), max_new_tokens=6, do_sample=False,
                         pad_token_id=0)
    return logits, out


def _layer0(model):
    layer = model.model.layers[0]
    return {"q.q_proj": layer.self_attn.q_proj, "o.o_proj": layer.self_attn.o_proj, "down.down_proj": layer.mlp.down_proj}


class Block(torch.nn.Module):
    """A residual MLP block with biases on both linears: the row-parallel bias must be added once."""

    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(16, 32)
        self.down = torch.nn.Linear(32, 16)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


def _blocks():
    torch.manual_seed(1)
    return torch.nn.Sequential(Block(), Block()).eval()


def _block_input():
    return torch.randn(3, 16, generator=torch.Generator().manual_seed(4))


def _weights(model):
    """Layer 0's q_proj (colwise), o_proj and down_proj (rowwise) weights as this rank holds them (float)."""
    out = {}
    for name, module in _layer0(model).items():
        out[name] = module.dequantize_weight().float() if hasattr(module, "dequantize_weight") else \
            module.weight.detach().float()
    return out


def _scenarios(world, ckpt_dir):
    from lightspeed import OnDevice
    from lightspeed.inference import QuantizedLinear, init_inference

    tp = {"tp_size": world}
    res = {}
    plain = init_inference(_model(), dtype=torch.float32, device="cpu", tensor_parallel=tp)
    res["plain"] = (*_run(plain), _weights(plain))
    blocks = init_inference(_blocks(), dtype=torch.float32, device="cpu", tensor_parallel=tp,
                            injection_policy={Block: ("down",)})
    with torch.no_grad():
        res["blocks"] = blocks(_block_input())
    int8 = init_inference(_model(), dtype=torch.float32, device="cpu", tensor_parallel=tp, quant={"weight": "int8"})
    res["int8"] = (*_run(int8), _weights(int8))
    for quant in (None, {"weight": "int8"}):  # each rank fuses its q/k/v and gate/up slices
        fused = init_inference(_model(), dtype=torch.float32, device="cpu", tensor_parallel=tp, quant=quant,
                               replace_with_kernel_inject=True)
        res[f"fused_{bool(quant)}"] = (*_run(fused), fused.model.layers[0].self_attn.qkv_proj.layer.out_features)
    with OnDevice(dtype=torch.float32, device="meta"):
        meta = transformers.LlamaForCausalLM(_cfg()).eval()
    loaded = init_inference(meta, dtype=torch.float32, device="cpu", tensor_parallel=tp, quant={"weight": "int8"},
                            checkpoint=ckpt_dir)
    res["loaded"] = _run(loaded)[0]
    with OnDevice(dtype=torch.float32, device="meta"):
        meta = transformers.LlamaForCausalLM(_cfg()).eval()
    loaded_plain = init_inference(meta, dtype=torch.float32, device="cpu", tensor_parallel=tp, checkpoint=ckpt_dir)
    with torch.no_grad():
        res["loaded_plain"] = loaded_plain(_ids()).logits
    res["head_in"] = plain.lm_head.in_features  # the untied output head is split too
    with OnDevice(dtype=torch.float32, device="meta"):
        meta = transformers.LlamaForCausalLM(_cfg()).eval()
    bin_loaded = init_inference(meta, dtype=torch.float32, device="cpu", tensor_parallel=tp, quant={"weight": "int8"},
                                checkpoint=ckpt_dir + "_bin")  # torch .bin files: slices of the mapped tensors
    with torch.no_grad():
        res["bin_loaded"] = bin_loaded(_ids()).logits
    policy = {transformers.models.llama.modeling_llama.LlamaDecoderLayer: ("self_attn.o_proj", "mlp.down_proj")}
    by_policy = init_inference(_model(), dtype=torch.float32, device="cpu", mp_size=world, injection_policy=policy)
    res["policy"] = _run(by_policy)[0]
    # saved split (each rank its packed slices), loaded back without quantizing again
    saved = f"{ckpt_dir}_tp{world}"
    init_inference(_model(), dtype=torch.float32, device="cpu", tensor_parallel=tp, quant={"weight": "int8"},
                   save_mp_checkpoint_path=saved)
    import lightspeed.inference.quantized_linear as ql

    keep, ql.quantize = ql.quantize, None  # any quantize call would fail
    try:
        with OnDevice(dtype=torch.float32, device="meta"):
            meta = transformers.LlamaForCausalLM(_cfg()).eval()
        res["reloaded"] = _run(init_inference(meta, dtype=torch.float32, device="cpu", tensor_parallel=tp,
                                              checkpoint=saved))[0]
    finally:
        ql.quantize = keep
    if world == 2:  # the all-reduce hooks trace under torch.compile (dynamo's functional collectives)
        with torch.no_grad():
            res["compiled"] = torch.compile(int8, backend="aot_eager", fullgraph=True)(_ids()).logits
    if world > 1:
        packed = _model()
        packed.model.layers[1].mlp.up_proj = QuantizedLinear.from_linear(packed.model.layers[1].mlp.up_proj, "int8")
        for kwargs, exc in (({"model": _model(kv_heads=world // 2)}, ValueError),
                            ({"model": packed}, ValueError),
                            ({"model": transformers.MptForCausalLM(transformers.MptConfig(
                                n_layers=1, d_model=32, n_heads=4, vocab_size=VOCAB))}, NotImplementedError)):
            try:
                init_inference(kwargs["model"], dtype=torch.float32, device="cpu", tensor_parallel=tp)
            except exc as err:
                res.setdefault("errors", []).append(str(err))
    return res


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    from lightspeed.inference import init_inference

    ckpt = tmp_path_factory.mktemp("llama")
    _model().save_pretrained(ckpt, max_shard_size="60KB")
    _model().save_pretrained(str(ckpt) + "_bin", max_shard_size="60KB", safe_serialization=False)
    base = _model()
    plain = init_inference(copy.deepcopy(base), dtype=torch.float32, device="cpu")
    int8 = init_inference(copy.deepcopy(base), dtype=torch.float32, device="cpu", quant={"weight": "int8"})
    with torch.no_grad():
        blocks = _blocks()(_block_input())
    return {"ckpt": str(ckpt), "plain": _run(plain), "int8": _run(int8)[0], "blocks": blocks,
            "full": {name: m.weight.detach().float() for name, m in _layer0(base).items()}}


@pytest.mark.parametrize("world", [1, 2, 4])
def test_tensor_parallel_matches_one_process(world, reference):
    from lightspeed.ops.wquant import dequantize, quantize

    results = run_world(_scenarios, world, world, reference["ckpt"])
    ref_logits, ref_tokens = reference["plain"]
    for rank, res in enumerate(results):
        logits, tokens, weights = res["plain"]
        torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
        assert torch.equal(tokens, ref_tokens)
        assert torch.equal(logits, results[0]["plain"][0])  # every rank gets the same sums
        assert torch.equal(res["policy"], logits)  # injection_policy: the same plan as the config's
        torch.testing.assert_close(res["blocks"], reference["blocks"], rtol=1e-5, atol=1e-5)  # biases added once
        # each rank's slices: q_proj rows, o_proj / down_proj columns
        full = reference["full"]
        rows = full["q.q_proj"].shape[0] // world
        assert torch.equal(weights["q.q_proj"], full["q.q_proj"][rank * rows:(rank + 1) * rows])
        for name in ("o.o_proj", "down.down_proj"):
            cols = full[name].shape[1] // world
            assert torch.equal(weights[name], full[name][:, rank * cols:(rank + 1) * cols])
        # INT8: colwise slices quantize row by row as the whole layer does; rowwise slices get their own
        # per-channel scales over K / world
        q_logits, q_tokens, q_weights = res["int8"]
        whole_q = dequantize(quantize(full["q.q_proj"], "int8"), torch.float32)
        assert torch.equal(q_weights["q.q_proj"], whole_q[rank * rows:(rank + 1) * rows])
        for name in ("o.o_proj", "down.down_proj"):
            cols = full[name].shape[1] // world
            piece = full[name][:, rank * cols:(rank + 1) * cols].contiguous()
            assert torch.equal(q_weights[name], dequantize(quantize(piece, "int8"), torch.float32))
        rel = ((q_logits - reference["int8"]).norm() / reference["int8"].norm()).item()
        assert rel < (1e-6 if world == 1 else 0.02), rel
        for quant, (want_logits, want_tokens) in ((False, (logits, tokens)), (True, (q_logits, q_tokens))):
            f_logits, f_tokens, f_rows = res[f"fused_{quant}"]  # replace_with_kernel_inject: q/k/v, gate/up fused
            torch.testing.assert_close(f_logits, want_logits, rtol=1e-6, atol=1e-6)
            assert torch.equal(f_tokens, want_tokens) and f_rows == (64 + 2 * 32) // world
        assert torch.equal(res["loaded"], q_logits)  # from the checkpoint, sliced as it loads
        assert torch.equal(res["bin_loaded"], q_logits)
        assert torch.equal(res["loaded_plain"], logits)  # float slices from the checkpoint
        assert res["head_in"] == 64 // world
        assert torch.equal(res["reloaded"], q_logits)  # saved split and packed, loaded as saved
        if world == 2:
            torch.testing.assert_close(res["compiled"], q_logits, rtol=1e-5, atol=1e-5)
        if world > 1:
            heads, packed, plan = res["errors"]
            assert "num_key_value_heads" in heads and "quantized already" in packed and "base_model_tp_plan" in plan


def _gpu_scenario(world, fmt, name):
    from lightspeed.inference import init_inference

    torch.cuda.set_device(int(torch.distributed.get_rank()))
    quant = None if fmt is None else {"weight": fmt}
    model = init_inference(_gpu_model(name), dtype=torch.float16, tensor_parallel={"tp_size": world}, quant=quant)
    if name == "gpt2":
        assert model.transformer.h[0].attn.c_attn.out_features == 3 * 64 // world
    elif name == "phi3":
        assert model.model.layers[0].self_attn.qkv_proj.out_features == 128 // world
    elif name in ("bloom", "falcon"):  # q|k|v rows: 8 heads x 3; falcon: (8 q + 4 k + 4 v) heads, of 8 values
        rows = {"bloom": 3 * 64, "falcon": 16 * 8}[name]
        assert model.transformer.h[0].self_attention.query_key_value.out_features == rows // world
    else:
        assert model.model.layers[0].mlp.down_proj.in_features == 128 // world
    with torch.no_grad():
        return model(_ids().cuda()).logits.float().cpu()


def _gpu_graph_scenario(world, fmt):
    """generate with enable_cuda_graph under tensor parallelism (each rank's graphs capture its
    all-reduces) against the same model's eager generate with the same static cache."""
    from lightspeed.inference import init_inference

    torch.cuda.set_device(int(torch.distributed.get_rank()))
    quant = None if fmt is None else {"weight": fmt}
    kw = {"dtype": torch.float16, "tensor_parallel": {"tp_size": world}, "quant": quant}
    model, graphed = init_inference(_model(), **kw), init_inference(_model(), enable_cuda_graph=True, **kw)
    ids = _ids().cuda()
    gen = {"attention_mask": torch.ones_like(ids), "max_new_tokens": 8, "do_sample": False, "pad_token_id": 0,
           "cache_implementation": "static"}
    want = model.generate(ids, disable_compile=True, **gen)
    return torch.equal(want, graphed.generate(ids, **gen)), graphed.forward.graphs.captures


def _gpu_model(name):
    return _family(name) if name in ("bloom", "falcon") else {"gpt2": _gpt2, "phi3": _phi3}.get(name, _model)()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("fmt,name", [(None, "llama"), ("fp6", "llama"), (None, "gpt2"), ("fp6", "phi3"),
                                      ("fp6", "bloom"), (None, "falcon")])
def test_tensor_parallel_on_two_gpus_with_nccl(fmt, name):
    """NCCL, fp16, the Triton kernels on each rank's GPU: logits against the one-GPU model's (fp16: its
    rounding; FP6: plus the row-parallel slices' own scales). GPT-2: Conv1D layers and the fused c_attn;
    Phi-3: fused layers of unequal parts; BLOOM: ALiBi; Falcon: grouped k/v, parallel attention."""
    from lightspeed.inference import init_inference

    quant = None if fmt is None else {"weight": fmt}
    one = init_inference(_gpu_model(name), dtype=torch.float16, device="cuda:0", quant=quant)
    with torch.no_grad():
        ref = one(_ids().cuda()).logits.float().cpu()
    results = run_world(_gpu_scenario, 2, 2, fmt, name, backend="nccl", env={"LIGHTSPEED_ACCELERATOR": "cuda"},
                          timeout=200)  # under the module's 240 s pytest limit: a hang reports its stacks
    assert torch.equal(results[0], results[1])
    rel = ((results[0] - ref).norm() / ref.norm()).item()
    assert rel < (5e-3 if fmt is None else 0.05), rel


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("fmt", [None, "fp6"])
def test_enable_cuda_graph_with_tensor_parallelism_on_two_gpus(fmt):
    results = run_world(_gpu_graph_scenario, 2, 2, fmt, backend="nccl", env={"LIGHTSPEED_ACCELERATOR": "cuda"},
                          timeout=200)  # under the module's 240 s pytest limit: a hang reports its stacks
    assert results == [(True, 1), (True, 1)]


def test_split_checkpoint_needs_its_tp_size(reference):
    """A checkpoint saved over 2 ranks names each rank's files; one process cannot load it."""
    from lightspeed import OnDevice
    from lightspeed.inference import init_inference

    run_world(_scenarios, 2, 2, reference["ckpt"])  # writes <ckpt>_tp2 (cheap next to the checks above)
    with OnDevice(dtype=torch.float32, device="meta"):
        meta = transformers.LlamaForCausalLM(_cfg()).eval()
    with pytest.raises(ValueError, match="saved split over 2 ranks; load it with tensor_parallel tp_size=2"):
        init_inference(meta, dtype=torch.float32, device="cpu", checkpoint=reference["ckpt"] + "_tp2")


# q/k/v biases, row-parallel biases (Phi), head_dim set; GPT-NeoX: a fused per-head q|k|v layer and an
# embedding style in its plan; GPT-J: head counts kept as attributes (divided per rank)
FAMILIES = ("qwen2", "phi", "mistral", "gemma", "qwen3", "gpt_neox", "gptj", "opt", "gpt_neo", "bloom", "falcon",
            "falcon_alibi", "falcon_mq", "bigcode", "bigcode_mha")


def _family(name):
    torch.manual_seed(0)
    if name == "gpt_neox":
        return transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
            num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=8, vocab_size=VOCAB,
            max_position_embeddings=64)).eval()
    if name == "opt":  # project_in / project_out (word_embed_proj_dim) stay whole
        return transformers.OPTForCausalLM(transformers.OPTConfig(
            num_hidden_layers=2, hidden_size=64, ffn_dim=128, num_attention_heads=8, vocab_size=VOCAB,
            max_position_embeddings=64, word_embed_proj_dim=32, pad_token_id=0, bos_token_id=1,
            eos_token_id=2)).eval()
    if name == "gpt_neo":  # a local-attention layer after a global one
        return transformers.GPTNeoForCausalLM(transformers.GPTNeoConfig(
            num_layers=2, hidden_size=64, num_heads=8, vocab_size=VOCAB, max_position_embeddings=64,
            attention_types=[[["global", "local"], 1]], window_size=4, intermediate_size=128, bos_token_id=1,
            eos_token_id=2)).eval()
    if name == "bloom":  # ALiBi: each rank's heads get their own slopes
        return transformers.BloomForCausalLM(transformers.BloomConfig(
            n_layer=2, hidden_size=64, n_head=8, vocab_size=VOCAB, pad_token_id=0, bos_token_id=1,
            eos_token_id=2)).eval()
    if name == "falcon_mq":  # Falcon-7B's multi-query layout: one k/v head, kept whole on every rank
        return transformers.FalconForCausalLM(transformers.FalconConfig(
            num_hidden_layers=2, hidden_size=64, num_attention_heads=8, multi_query=True, new_decoder_architecture=False,
            parallel_attn=True, bias=False, vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2)).eval()
    if name.startswith("falcon"):  # 40B's grouped k/v layout, rotary; or one k/v per head and ALiBi (RW)
        grouped = name == "falcon"
        return transformers.FalconForCausalLM(transformers.FalconConfig(
            num_hidden_layers=2, hidden_size=64, num_attention_heads=8, num_kv_heads=4 if grouped else 8,
            new_decoder_architecture=grouped, multi_query=False, alibi=not grouped, parallel_attn=grouped,
            bias=not grouped, vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2)).eval()
    if name.startswith("bigcode"):  # StarCoder's multi-query c_attn [q heads | k | v], or per-head q|k|v
        return transformers.GPTBigCodeForCausalLM(transformers.GPTBigCodeConfig(
            n_layer=2, n_embd=64, n_head=8, multi_query=name == "bigcode", vocab_size=VOCAB, n_positions=64,
            bos_token_id=1, eos_token_id=2)).eval()
    if name == "gptj":
        return transformers.GPTJForCausalLM(transformers.GPTJConfig(
            n_layer=2, n_embd=64, n_head=8, rotary_dim=4, vocab_size=VOCAB, n_positions=64)).eval()
    common = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=8,
                  num_key_value_heads=4, vocab_size=VOCAB, max_position_embeddings=64)
    cls, cfg = {"qwen2": ("Qwen2ForCausalLM", "Qwen2Config"), "phi": ("PhiForCausalLM", "PhiConfig"),
                "mistral": ("MistralForCausalLM", "MistralConfig"), "gemma": ("GemmaForCausalLM", "GemmaConfig"),
                "qwen3": ("Qwen3ForCausalLM", "Qwen3Config")}[name]
    extra = {"head_dim": 8} if name in ("gemma", "qwen3") else {}
    return getattr(transformers, cls)(getattr(transformers, cfg)(**common, **extra)).eval()


def _families(world):
    from lightspeed.inference import init_inference

    out = {name: _run(init_inference(_family(name), dtype=torch.float32, device="cpu",
                                     tensor_parallel={"tp_size": world})) for name in FAMILIES}
    # DeepSpeed's injection_policy on GPT-BigCode: its c_attn keeps the model's layout, not GPT-2's thirds
    block = transformers.models.gpt_bigcode.modeling_gpt_bigcode.GPTBigCodeBlock
    out["bigcode_policy"] = _run(init_inference(_family("bigcode"), dtype=torch.float32, device="cpu",
                                                tensor_parallel={"tp_size": world},
                                                injection_policy={block: ("attn.c_proj", "mlp.c_proj")}))
    return out


@pytest.mark.parametrize("world", [1, 2])  # the 4-way split: test_tensor_parallel_matches_one_process
def test_tensor_parallel_across_model_families(world):
    """The config's base_model_tp_plan of other transformers families (OPT's, GPT-Neo's, BLOOM's,
    Falcon's and GPT-BigCode's: the built-in plans; multi-query Falcon and BigCode keep their k/v head
    whole), split over the ranks, against one process; BigCode also through injection_policy."""
    from lightspeed.inference import init_inference

    results = run_world(_families, world, world)
    for name in (*FAMILIES, "bigcode_policy"):  # logits of a forward without a mask; greedy tokens of generate
        logits, tokens = _run(init_inference(_family(name.removesuffix("_policy")), dtype=torch.float32,
                                             device="cpu"))
        for got_logits, got_tokens in (res[name] for res in results):
            torch.testing.assert_close(got_logits, logits, rtol=1e-5, atol=1e-5, msg=name)
            assert torch.equal(got_tokens, tokens), name


def _gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64)
    return transformers.GPT2LMHeadModel(cfg).eval()


def _gpt2_scenarios(world, ckpt_dir):
    """GPT-2 (Conv1D layers, a fused q|k|v c_attn, head counts as attributes): the built-in plan, DeepSpeed's
    injection_policy form, INT8, and a checkpoint load reading only this rank's thirds of c_attn."""
    from lightspeed import OnDevice
    from lightspeed.inference import init_inference

    tp = {"tp_size": world}
    res = {}
    plain = init_inference(_gpt2(), dtype=torch.float32, device="cpu", tensor_parallel=tp)
    res["plain"] = _run(plain)
    attn = plain.transformer.h[0].attn
    weight = attn.c_attn.weight.detach()  # a Conv1D [in, out] when whole (world 1), an nn.Linear slice [out, in]
    res["attn"] = (attn.split_size, weight.t() if world == 1 else weight.clone(), attn.c_attn.bias.detach().clone())
    policy = {transformers.models.gpt2.modeling_gpt2.GPT2Block: ("attn.c_proj", "mlp.c_proj")}
    res["policy"] = _run(init_inference(_gpt2(), dtype=torch.float32, device="cpu", mp_size=world,
                                        injection_policy=policy))[0]
    saved = f"{ckpt_dir}_int8_tp{world}"  # each rank's packed slices (c_attn's thirds), loaded back as saved
    res["int8"] = _run(init_inference(_gpt2(), dtype=torch.float32, device="cpu", tensor_parallel=tp,
                                      quant={"weight": "int8"}, save_mp_checkpoint_path=saved))[0]
    for name, source in (("loaded", ckpt_dir), ("reloaded", saved)):
        with OnDevice(dtype=torch.float32, device="meta"):
            meta = transformers.GPT2LMHeadModel(_gpt2().config).eval()
        res[name] = _run(init_inference(meta, dtype=torch.float32, device="cpu", tensor_parallel=tp,
                                        checkpoint=source))[0]
    return res


def _saved_reference(tmp_path_factory, build):
    """(the model, {its checkpoint directory, its one-process results: plain and INT8})."""
    from lightspeed.inference import init_inference

    ckpt = tmp_path_factory.mktemp(build.__name__.strip("_"))
    build().save_pretrained(ckpt)
    base = build()
    int8 = init_inference(copy.deepcopy(base), dtype=torch.float32, device="cpu", quant={"weight": "int8"})
    return base, {"ckpt": str(ckpt), "plain": _run(base), "int8": _run(int8)[0]}


@pytest.fixture(scope="module")
def gpt2_reference(tmp_path_factory):
    base, reference = _saved_reference(tmp_path_factory, _gpt2)
    attn = base.transformer.h[0].attn
    return {**reference,
            "c_attn": (attn.c_attn.weight.detach().t(), attn.c_attn.bias.detach())}


@pytest.mark.parametrize("world", [1, 2, 4])
def test_gpt2_tensor_parallel_matches_one_process(world, gpt2_reference):
    results = run_world(_gpt2_scenarios, world, world, gpt2_reference["ckpt"])
    ref_logits, ref_tokens = gpt2_reference["plain"]
    weight, bias = gpt2_reference["c_attn"]  # [3 x 64, 64]: q | k | v
    rows = 64 // world
    for rank, res in enumerate(results):
        logits, tokens = res["plain"]
        torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
        assert torch.equal(tokens, ref_tokens)
        split_size, w, b = res["attn"]
        assert split_size == 64 // world
        want = [slice(p * 64 + rank * rows, p * 64 + (rank + 1) * rows) for p in range(3)]  # its rows of q, k, v
        assert torch.equal(w, torch.cat([weight[r] for r in want])) and torch.equal(b, torch.cat([bias[r] for r in want]))
        assert torch.equal(res["policy"], logits)
        assert torch.equal(res["loaded"], logits)
        assert torch.equal(res["reloaded"], res["int8"])
        rel = ((res["int8"] - gpt2_reference["int8"]).norm() / gpt2_reference["int8"].norm()).item()
        assert rel < (1e-6 if world == 1 else 0.02), rel


def _phi3():
    torch.manual_seed(0)
    cfg = transformers.Phi3Config(num_hidden_layers=2, hidden_size=64, intermediate_size=96, num_attention_heads=8,
                                  num_key_value_heads=4, vocab_size=VOCAB, max_position_embeddings=64,
                                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return transformers.Phi3ForCausalLM(cfg).eval()


def _phi3_scenarios(world, ckpt_dir):
    """Phi-3 (fused qkv_proj with grouped-query parts, fused gate_up_proj, head counts read from the config
    in the forward): the built-in plan, INT8, and a checkpoint load reading only this rank's rows of each part."""
    from lightspeed import OnDevice
    from lightspeed.inference import init_inference

    tp = {"tp_size": world}
    plain = init_inference(_phi3(), dtype=torch.float32, device="cpu", tensor_parallel=tp)
    layer = plain.model.layers[0]
    res = {"plain": _run(plain), "qkv": layer.self_attn.qkv_proj.weight.detach().clone(),
           "gate_up": layer.mlp.gate_up_proj.weight.detach().clone(),
           "heads": (layer.self_attn.config.num_attention_heads, layer.self_attn.num_key_value_heads,
                     plain.config.num_attention_heads)}
    res["int8"] = _run(init_inference(_phi3(), dtype=torch.float32, device="cpu", tensor_parallel=tp,
                                      quant={"weight": "int8"}))[0]
    with OnDevice(dtype=torch.float32, device="meta"):
        meta = transformers.Phi3ForCausalLM(_phi3().config).eval()
    res["loaded"] = _run(init_inference(meta, dtype=torch.float32, device="cpu", tensor_parallel=tp,
                                        checkpoint=ckpt_dir))[0]
    return res


@pytest.fixture(scope="module")
def phi3_reference(tmp_path_factory):
    base, reference = _saved_reference(tmp_path_factory, _phi3)
    layer = base.model.layers[0]
    return {**reference, "qkv": layer.self_attn.qkv_proj.weight.detach(),
            "gate_up": layer.mlp.gate_up_proj.weight.detach()}


@pytest.mark.parametrize("world", [1, 2])  # the 4-way split: test_tensor_parallel_matches_one_process
def test_phi3_tensor_parallel_matches_one_process(world, phi3_reference):
    results = run_world(_phi3_scenarios, world, world, phi3_reference["ckpt"])
    ref_logits, ref_tokens = phi3_reference["plain"]
    for rank, res in enumerate(results):
        logits, tokens = res["plain"]
        torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
        assert torch.equal(tokens, ref_tokens)
        # its rows of q (64), k (32) and v (32); of gate (96) and up (96)
        for key, parts in (("qkv", (64, 32, 32)), ("gate_up", (96, 96))):
            starts = [sum(parts[:i]) for i in range(len(parts))]
            want = [phi3_reference[key][s + rank * (p // world):s + (rank + 1) * (p // world)]
                    for s, p in zip(starts, parts)]
            assert torch.equal(res[key], torch.cat(want)), key
        assert res["heads"] == (8 // world, 4 // world, 8)  # the attention's view; the model's config whole
        assert torch.equal(res["loaded"], logits)
        rel = ((res["int8"] - phi3_reference["int8"]).norm() / phi3_reference["int8"].norm()).item()
        assert rel < (1e-6 if world == 1 else 0.02), rel


MOE = ("mixtral", "qwen2_moe")


def _moe(name):
    """Mixtral (4 experts of 96) or Qwen2-MoE (5 experts of 48 and a shared expert of 80), 2 layers."""
    torch.manual_seed(0)
    common = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=8, num_key_value_heads=4, vocab_size=VOCAB,
                  max_position_embeddings=64)
    if name == "mixtral":
        cfg = transformers.MixtralConfig(intermediate_size=96, num_local_experts=4, num_experts_per_tok=2, **common)
    else:
        cfg = transformers.Qwen2MoeConfig(intermediate_size=96, moe_intermediate_size=48, num_experts=5,
                                          shared_expert_intermediate_size=80, num_experts_per_tok=2, **common)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


def _moe_scenarios(world, ckpt_dirs):
    from lightspeed import OnDevice
    from lightspeed.inference import init_inference

    tp, res = {"tp_size": world}, {}
    for name in MOE:
        plain = init_inference(_moe(name), dtype=torch.float32, device="cpu", tensor_parallel=tp)
        res[name] = _run(plain)
        res[name + "_down"] = plain.model.layers[0].mlp.experts.down_proj.detach().clone()
        saved = f"{ckpt_dirs[name]}_int8_tp{world}"  # each rank's packed experts, loaded back as saved
        res[name + "_int8"] = _run(init_inference(_moe(name), dtype=torch.float32, device="cpu", tensor_parallel=tp,
                                                  quant={"weight": "int8"}, save_mp_checkpoint_path=saved))[0]
        # transformers' per-expert checkpoint, read in slices and quantized; then the saved split one
        for key, source, quant in (("_loaded", ckpt_dirs[name], {"weight": "int8"}),
                                   ("_loaded_3d", ckpt_dirs[name + "_3d"], {"weight": "int8"}),
                                   ("_reloaded", saved, None)):
            with OnDevice(dtype=torch.float32, device="meta"):
                meta = _moe(name)
            res[name + key] = _run(init_inference(meta, dtype=torch.float32, device="cpu", tensor_parallel=tp,
                                                  checkpoint=source, quant=quant))[0]
    return res


@pytest.fixture(scope="module")
def moe_reference(tmp_path_factory):
    from lightspeed.inference import init_inference

    out = {}
    for name in MOE:
        ckpt = tmp_path_factory.mktemp(name)
        base = _moe(name)
        base.save_pretrained(ckpt)  # one matrix per expert, as on disk
        ckpt_3d = tmp_path_factory.mktemp(name + "_3d")  # lightspeed's float save: the 3-D parameters as they are
        init_inference(copy.deepcopy(base), dtype=torch.float32, device="cpu", save_mp_checkpoint_path=ckpt_3d)
        int8 = init_inference(copy.deepcopy(base), dtype=torch.float32, device="cpu", quant={"weight": "int8"})
        out[name] = {"ckpt": str(ckpt), "ckpt_3d": str(ckpt_3d), "plain": _run(base), "int8": _run(int8)[0],
                     "down": base.model.layers[0].mlp.experts.down_proj.detach()}
    return out


@pytest.mark.parametrize("world", [1, 2])  # the 4-way split: test_tensor_parallel_matches_one_process
def test_moe_tensor_parallel_matches_one_process(world, moe_reference):
    """MoE experts split over the ranks inside every expert (its gate, up rows and down columns; the
    router and Qwen2-MoE's shared expert whole), their outputs summed: logits and greedy tokens of one
    process; INT8 quantized after the cut; a transformers checkpoint of per-expert matrices and one of
    3-D experts read in slices and quantized as read, and the INT8 model saved split, all equal to the
    in-place INT8."""
    dirs = {**{name: ref["ckpt"] for name, ref in moe_reference.items()},
            **{name + "_3d": ref["ckpt_3d"] for name, ref in moe_reference.items()}}
    results = run_world(_moe_scenarios, world, world, dirs)
    for rank, res in enumerate(results):
        for name in MOE:
            ref = moe_reference[name]
            logits, tokens = res[name]
            torch.testing.assert_close(logits, ref["plain"][0], rtol=1e-5, atol=1e-5, msg=name)
            assert torch.equal(tokens, ref["plain"][1]), name
            inter = ref["down"].shape[2] // world
            assert torch.equal(res[name + "_down"], ref["down"][:, :, rank * inter:(rank + 1) * inter]), name
            assert torch.equal(res[name + "_loaded"], res[name + "_int8"]), name
            assert torch.equal(res[name + "_reloaded"], res[name + "_int8"]), name
            assert torch.equal(res[name + "_loaded_3d"], res[name + "_int8"]), name
            rel = ((res[name + "_int8"] - ref["int8"]).norm() / ref["int8"].norm()).item()
            assert rel < (1e-6 if world == 1 else 0.02), (name, rel)
