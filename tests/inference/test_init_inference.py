"""init_inference on tiny transformers models (GPT-2 with Conv1D, Llama; random init, no downloads):
layers swapped, lm_head kept, logits close to the unquantized model, generate runs; argument errors."""
from __future__ import annotations

import copy

import pytest
import torch

import lightspeed
from lightspeed.inference import QuantizedLinear, init_inference

transformers = pytest.importorskip("transformers")

VOCAB = 128


def _gpt2():
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64)
    return transformers.GPT2LMHeadModel(cfg).eval()


def _llama():
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg).eval()


# (model, number of swapped layers: gpt2 4 Conv1D per block, llama 7 Linear per block)
MODELS = {"gpt2": (_gpt2, 8), "llama": (_llama, 14)}
# relative logits error bound vs the unquantized model (measured ~0.04-0.06 for fp6)
LOGITS_BOUND = {"fp6": 0.15, "int8": 0.03, "int4": 0.5}


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("fmt", ["fp6", "int8", "int4"])
def test_quantized_model_close_to_unquantized(name, fmt):
    torch.manual_seed(0)
    build, num_swapped = MODELS[name]
    base = build()
    ref = init_inference(copy.deepcopy(base), dtype=torch.float32, device="cpu")
    q = lightspeed.init_inference(copy.deepcopy(base), dtype=torch.float32, device="cpu",
                                  quant={"weight": fmt, "group_size": 32 if fmt == "int4" else None})
    assert sum(isinstance(m, QuantizedLinear) for m in q.modules()) == num_swapped
    assert not isinstance(q.lm_head, QuantizedLinear)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = ref(ids).logits, q(ids).logits
    rel = ((a - b).norm() / a.norm()).item()
    assert 0 < rel < LOGITS_BOUND[fmt], rel


@pytest.mark.parametrize("name", list(MODELS))
def test_generate_bf16(name):
    torch.manual_seed(0)
    model = init_inference(MODELS[name][0](), dtype=torch.bfloat16, device="cpu", quant={"weight": "fp6"})
    assert model.transformer.h[0].attn.c_attn.bias.dtype == torch.bfloat16 if name == "gpt2" else True
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(2))
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False,
                         pad_token_id=0)
    assert out.shape == (1, 11)


def test_include_exclude_and_config_dict():
    model = init_inference(_llama(), config={"dtype": "fp32", "quant": {"weight": "int8", "include": ["lm_head"],
                                                                         "exclude": ["*.mlp.*"]}}, device="cpu")
    assert isinstance(model.lm_head, QuantizedLinear)
    assert not isinstance(model.model.layers[0].mlp.up_proj, QuantizedLinear)
    assert isinstance(model.model.layers[0].self_attn.q_proj, QuantizedLinear)


@pytest.mark.parametrize("kwargs,exc,match", [
    ({"quant": {"weight": "fp6", "bits": 6}}, ValueError, "unknown quant key 'bits'"),
    ({"quant": {"weight": "nf4"}}, ValueError, "quant\\['weight'\\]"),
    ({"quant": {"weight": "int4", "group_size": 20}}, ValueError, "group_size"),
    ({"dtype": torch.int8, "quant": {"weight": "fp6"}}, ValueError, "dtype=int8 asks for INT8 weights.*fp6"),
    ({"dtype": "int8", "quant": {"enabled": False}}, ValueError, "enabled=False"),
    ({"quant": {"weight": {"num_bits": 6}}}, ValueError, "quant\\['weight'\\]\\['num_bits'\\] must be 8 or 4"),
    ({"quant": {"weight": {"num_bits": 8, "q_type": "asymmetric"}}}, NotImplementedError, "q_type"),
    ({"quant": {"weight": {"post_init_quant": {"fc": {"num_bits": 4}}}}}, NotImplementedError, "post_init_quant"),
    ({"quant": {"weight": {"bits": 8}}}, ValueError, "unknown quant\\['weight'\\] key 'bits'"),
    ({"dtype": "bfloat"}, ValueError, "dtype"),
    ({"config": {"checkpoint": "no/such/x.pt"}}, ValueError, "no/such/x.pt: checkpoint file not found"),
    ({"checkpoint": "no_such_ckpt.json"}, ValueError, "no_such_ckpt.json: checkpoint file not found"),
    ({"checkpoint": {"type": "Megatron", "checkpoints": ["a.pt"], "version": 1.0}}, NotImplementedError,
     "checkpoint\\['type'\\]='Megatron'"),
    ({"checkpoint": {"type": "ds_model", "checkpoints": {"tp": [], "non_tp": []}}}, NotImplementedError,
     "checkpoint\\['checkpoints'\\]"),
    ({"checkpoint": {"type": "ds_model"}}, ValueError, "'checkpoints' list"),
    ({"checkpoint": 3}, ValueError, "checkpoint must be a path"),
    ({"ckpt_config": {"checkpoint_file": "x"}}, ValueError, "unknown checkpoint_config key 'checkpoint_file'"),
    ({"set_empty_params": True}, NotImplementedError, "set_empty_params"),
    ({"enable_cuda_graph": True}, ValueError, "enable_cuda_graph=True needs a CUDA device \\(this call: cpu\\)"),
    ({"config": {"enable_cuda_graph": "yes"}}, ValueError, "enable_cuda_graph must be true or false"),
    ({"config": {"zero": {"stage": 3}}}, NotImplementedError, "zero"),
    ({"injection_policy_tuple": ("attn.c_proj",)}, NotImplementedError, "injection_policy_tuple"),
    ({"kernel_inject": "yes"}, ValueError, "replace_with_kernel_inject must be true or false"),
    ({"tp": {"tp_size": 2}}, ValueError, "tp_size=2 needs torch.distributed with 2 ranks"),
    ({"tp": {"tp_size": 2, "tp_grp": None}}, ValueError, "unknown tensor_parallel key 'tp_grp'"),
    ({"tp": {"tp_size": 2}, "mp_size": 4}, ValueError, "disagree"),
    ({"max_new_tokens": 5}, ValueError, "unknown argument 'max_new_tokens'"),
    ({"config": {"bogus": 1}}, ValueError, "unknown argument 'bogus'"),
    ({"mp_size": 2}, ValueError, "tp_size=2 needs torch.distributed"),
    ({"config": {"replace_with_kernel_inject": 1}}, ValueError, "replace_with_kernel_inject must be true or false"),
])
def test_argument_errors(kwargs, exc, match):
    with pytest.raises(exc, match=match) as info:
        init_inference(torch.nn.Linear(64, 8), device="cpu", **kwargs)
    assert "\n" not in str(info.value)


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("device", DEVICES)
def test_layers_quantized_on_their_way_match_cast_then_quantize(name, device):
    """init_inference moves and casts each linear layer on its own, then quantizes it there: the packed
    buffers equal those of casting and moving the whole model first (the order before), and the fp32
    model handed in is left fp32 on the CPU in its swapped-out layers."""
    from lightspeed.inference.engine import quantize_linears

    torch.manual_seed(0)
    base = MODELS[name][0]()
    old = copy.deepcopy(base).to(device=device, dtype=torch.bfloat16)
    quantize_linears(old, "fp6")
    new = init_inference(copy.deepcopy(base), dtype=torch.bfloat16, quant={"weight": "fp6"}, device=device)
    old_state, new_state = old.state_dict(), new.state_dict()
    assert list(old_state) == list(new_state)
    for key, value in old_state.items():
        assert new_state[key].device.type == device and new_state[key].dtype == value.dtype, key
        assert torch.equal(new_state[key], value), key


@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU memory")
def test_gpu_never_holds_the_whole_unquantized_model():
    """96 fp32 CPU layers of 1024 x 1024 (192 MiB in fp16) quantized onto the GPU: the peak of GPU memory
    stays under the quantized model plus half the fp16 model (one layer's cast and quantizer
    temporaries at a time; casting the whole model first would hold all 192 MiB)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024, bias=False) for _ in range(96)])
    fp16_bytes = 96 * 1024 * 1024 * 2
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    model = init_inference(model, dtype=torch.float16, quant={"weight": "fp6"}, device="cuda")
    torch.cuda.synchronize()
    final = torch.cuda.memory_allocated() - start
    peak = torch.cuda.max_memory_allocated() - start
    assert all(isinstance(m, QuantizedLinear) for m in model)
    assert final < 0.4 * fp16_bytes and peak < final + 0.5 * fp16_bytes, (final, peak)


def test_engine_module_is_the_model():
    """DeepSpeed scripts use `engine.module`: it is the returned model, not a registered submodule (the
    module tree, state_dict and copies are those of the model alone)."""
    torch.manual_seed(0)
    base = _llama()
    names = [n for n, _ in base.named_modules()]
    keys = list(base.state_dict())
    engine = init_inference(base, dtype=torch.float32, device="cpu")
    assert engine.module is engine
    assert [n for n, _ in engine.named_modules()] == names and list(engine.state_dict()) == keys
    twin = copy.deepcopy(engine)
    assert twin.module is twin
    ids = torch.tensor([[1, 2, 3]])
    out = engine.module.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False,
                                 pad_token_id=0)
    assert out.shape == (1, 5)
    wrapped = torch.nn.Sequential(torch.nn.Linear(4, 4))
    wrapped.module = torch.nn.Linear(4, 4)  # a model with its own `module` keeps it
    assert init_inference(wrapped, dtype=torch.float32, device="cpu").module is wrapped[1]


def test_deepspeed_arguments_that_change_nothing_here_are_taken():
    """A DeepSpeed call's kernel-only settings (any value) and the unimplemented ones at DeepSpeed's
    defaults, as keywords or in the config dict, run like the plain call."""
    torch.manual_seed(0)
    base = _llama()
    plain = init_inference(copy.deepcopy(base), dtype=torch.float32, device="cpu", quant={"weight": "int8"})
    ds = init_inference(copy.deepcopy(base), dtype=torch.float32, device="cpu", quant={"weight": "int8"},
                        max_out_tokens=2048, replace_method="auto", checkpoint=None, enable_cuda_graph=False,
                        tp={"tp_size": 1}, config={"triangular_masking": True, "return_tuple": True, "moe": False,
                                                   "zero": {}, "min_tokens": 1, "kernel_inject": False})
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    torch.testing.assert_close(ds(ids).logits, plain(ids).logits, rtol=0, atol=0)


def test_deepspeed_quant_forms():
    """DeepSpeed's `dtype=torch.int8` (int8 weights, fp16 activations) and its `quant` dict
    ({"weight": {"num_bits", "q_groups", ...}, "activation": ..., "qkv": ...}) give the same model as
    lightspeed's own form."""
    torch.manual_seed(0)
    base = _llama()

    def build(**kwargs):
        return init_inference(copy.deepcopy(base), device="cpu", **kwargs).state_dict()

    def same(a, b):
        assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)

    plain8 = build(dtype=torch.float16, quant={"weight": "int8"})
    same(build(dtype=torch.int8), plain8)
    same(build(config={"dtype": "int8", "quant": {"weight": {"num_bits": 8}, "activation": {"enabled": True}}}), plain8)
    same(build(dtype=torch.float16, quant={"enabled": True, "weight": {"num_bits": 4, "q_groups": 2,
                                                                         "q_type": "symmetric"},
                                            "qkv": {"enabled": True}}),
         build(dtype=torch.float16, quant={"weight": "int4"}))
    off = init_inference(copy.deepcopy(base), device="cpu", quant={"weight": {"enabled": False, "num_bits": 8}})
    assert not any(isinstance(m, QuantizedLinear) for m in off.modules())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_profile_model_time_and_model_times(device):
    """DeepSpeed's engine methods on the returned model: each call of the model, generate's steps
    included, timed in ms once profiling is on (the GPU synchronized around each); model_times() hands
    them over and starts again."""
    dtype = torch.float16 if device == "cuda" else torch.float32
    model = init_inference(MODELS["llama"][0](), dtype=dtype, device=device)
    with pytest.raises(RuntimeError, match="call profile_model_time\\(\\) first"):
        model.model_times()
    ids = torch.randint(0, VOCAB, (1, 5), device=device)
    with torch.no_grad():
        model(ids)  # not timed yet
        model.profile_model_time()
        model.profile_model_time(use_cuda_events=False)  # once is enough: no second set of hooks
        model(ids)
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, min_new_tokens=3, do_sample=False,
                       pad_token_id=0)
    times = model.model_times()
    assert len(times) == 1 + 3 and all(t > 0 for t in times)
    assert model.model_times() == []
