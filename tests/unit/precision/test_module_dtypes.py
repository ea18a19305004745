"""The dtypes of a model's parameters and buffers under mixed precision (precision/module_dtypes.py, DeepSpeed
0.19.8's rules): parameters to the training dtype, buffers kept unless data_types.buffer_dtype, the buffers a
model lists for fp32 (data_types.keep_in_fp32_modules) kept in fp32, at ZeRO 0, 2 and 3 and under zero.Init.
The expected dtypes are the ones DeepSpeed 0.19.8 gives the same models (checked against it on CPU)."""

import pytest
import torch

import lightspeed
from lightspeed.config.errors import ConfigError
from lightspeed.precision.module_dtypes import cast_module, fp32_buffers, keep_in_fp32_pattern
from lightspeed.precision.policy import policy_from_config
from lightspeed.zero import Init

pytestmark = pytest.mark.timeout(120)

fp16, bf16, fp32 = torch.float16, torch.bfloat16, torch.float32
CLOSE_TO_ONE = 1 + 2**-12  # exact in fp32, rounds to 1 in bf16


@pytest.fixture(autouse=True)
def no_process_group_left_behind():
    """zero.Init starts torch.distributed where a launcher's environment says so: end what a test started."""
    initialized = torch.distributed.is_initialized()
    yield
    if not initialized and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


class Router(torch.nn.Module):
    _keep_in_fp32_modules_strict = ["bias_fp32"]  # kept under bf16 and fp16 (an HF class attribute)
    _keep_in_fp32_modules = ["fp16_only"]  # kept under fp16 only

    def __init__(self, low=bf16):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.register_buffer("bias_fp32", torch.zeros(4, dtype=low))  # arrives low, as under a bf16 default dtype
        self.register_buffer("fp16_only", torch.ones(4))
        self.register_buffer("plain", torch.ones(4))


class Model(torch.nn.Module):
    def __init__(self, low=bf16):
        super().__init__()
        self.router = Router(low)
        self.other = torch.nn.Linear(4, 4)
        self.register_buffer("bias_fp32", torch.ones(4))  # same name outside Router: not listed there
        self.register_buffer("inv_freq", 1.0 / 10 ** (torch.arange(0, 4, dtype=torch.int64).float() / 4))
        self.register_buffer("index", torch.arange(4))

    def forward(self, x, y):
        h = self.router.proj(x) * self.router.plain.to(x.dtype) + self.router.bias_fp32.to(x.dtype)
        out = self.other(h) * self.inv_freq.to(x.dtype)
        return torch.nn.functional.mse_loss(out.float(), y.float())


def dtypes(module):
    return {n: b.dtype for n, b in module.named_buffers() if b.is_floating_point()}


AS_BUILT = {"router.bias_fp32": fp32, "router.fp16_only": fp32, "router.plain": fp32, "bias_fp32": fp32,
            "inv_freq": fp32}


def test_patterns():
    m = Model()
    names = lambda dtype, setting="auto": [n for n, _ in fp32_buffers(m, keep_in_fp32_pattern(m, setting, dtype))]
    # "auto": a submodule's list matches under its own path only; fp16 adds _keep_in_fp32_modules
    assert names(bf16) == ["router.bias_fp32"]
    assert names(fp16) == ["router.bias_fp32", "router.fp16_only"]
    assert names(fp32) == [] and keep_in_fp32_pattern(m, "auto", fp32) is None  # fp32 training: nothing
    assert keep_in_fp32_pattern(m, [], bf16) is None
    # a list matches anywhere in the full name, `*` for any characters; parameters are never selected
    assert names(bf16, ["*bias_fp32"]) == ["bias_fp32", "router.bias_fp32"]
    assert names(bf16, ["inv_*", "proj.weight"]) == ["inv_freq"]
    # the root's own list matches anywhere
    Model._keep_in_fp32_modules_strict = ["plain"]
    try:
        assert names(bf16) == ["router.bias_fp32", "router.plain"]
    finally:
        del Model._keep_in_fp32_modules_strict


def test_cast_module_rules(ls_caplog):
    m = Model()
    m.other.weight.data = m.other.weight.data.double()
    tensors = {n: b for n, b in m.named_buffers()}
    cast_module(m, bf16)  # buffers keep their dtype; the listed one (built bf16) is upcast
    assert all(p.dtype == bf16 for p in m.parameters())
    assert dtypes(m) == AS_BUILT and m.index.dtype == torch.int64
    assert all(b is tensors[n] for n, b in m.named_buffers())  # in place: the same tensors
    cast_module(m, bf16, buffer_dtype=bf16)  # buffer_dtype: every floating buffer but the kept ones
    assert dtypes(m) == {**{n: bf16 for n in AS_BUILT}, "router.bias_fp32": fp32}
    m = Model()
    cast_module(m, bf16, buffer_dtype=bf16, keep_in_fp32=[])  # [] keeps nothing
    assert set(dtypes(m).values()) == {bf16} and m.index.dtype == torch.int64
    m = Model(low=fp16)
    cast_module(m, fp16, buffer_dtype=fp16)  # fp16 keeps _keep_in_fp32_modules too
    assert dtypes(m) == {**{n: fp16 for n in AS_BUILT}, "router.bias_fp32": fp32, "router.fp16_only": fp32}
    m = Model()
    cast_module(m, fp32, buffer_dtype=bf16)  # fp32 training: nothing is cast (DeepSpeed's rule), said once
    assert all(p.dtype == fp32 for p in m.parameters()) and m.router.bias_fp32.dtype == bf16
    assert "data_types.buffer_dtype=bfloat16" in ls_caplog.text


def test_policy_reads_the_keys():
    p = policy_from_config({"bf16": {"enabled": True}, "data_types": {"buffer_dtype": "BF16",
                                                                     "keep_in_fp32_modules": ["*bias"]}})
    assert (p.buffer_dtype, p.keep_in_fp32) == (bf16, ("*bias",))
    assert (policy_from_config({}).buffer_dtype, policy_from_config({}).keep_in_fp32) == (None, "auto")
    with pytest.raises(ConfigError, match="data_types.keep_in_fp32_modules"):
        policy_from_config({"data_types": {"keep_in_fp32_modules": "none"}})
    with pytest.raises(ConfigError, match="data_types.keep_in_fp32_modules"):
        lightspeed.initialize(model=Model(), config={"train_batch_size": 1,
                                                     "data_types": {"keep_in_fp32_modules": [1]}},
                              dist_init_required=False)


def _config(stage, mode="bf16", **data_types):
    return {"train_batch_size": 2, "steps_per_print": 10**6, mode: {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": stage},
            **({"data_types": data_types} if data_types else {})}


def _step(engine, dtype=bf16):
    x, y = torch.randn(2, 4, dtype=dtype), torch.randn(2, 4, dtype=dtype)
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    assert torch.isfinite(loss)


CASES = [
    ({}, AS_BUILT),
    ({"buffer_dtype": "bf16"}, {**{n: bf16 for n in AS_BUILT}, "router.bias_fp32": fp32}),
    ({"buffer_dtype": "bf16", "keep_in_fp32_modules": []}, {n: bf16 for n in AS_BUILT}),
    ({"buffer_dtype": "bf16", "keep_in_fp32_modules": ["*plain"]},
     {**{n: bf16 for n in AS_BUILT}, "router.plain": fp32}),
]


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_initialize_at_every_stage(stage):
    for data_types, expected in CASES:
        engine, *_ = lightspeed.initialize(model=Model(), config=_config(stage, **data_types), dist_init_required=False)
        assert dtypes(engine.module) == expected, data_types
        assert engine.module.router.proj.weight.dtype == bf16
    _step(engine)
    assert dtypes(engine.module) == expected


@pytest.mark.parametrize("fmt", ["lightspeed", "deepspeed"])
def test_fp32_buffers_survive_a_checkpoint(tmp_path, fmt):
    cfg = {**_config(2), "checkpoint": {"format": fmt}}
    engine, *_ = lightspeed.initialize(model=Model(), config=cfg, dist_init_required=False)
    engine.module.router.plain.fill_(CLOSE_TO_ONE)  # a value bf16 cannot hold
    engine.save_checkpoint(tmp_path, tag="t")
    for stage in (2, 3):  # loaded at another stage too
        loaded, *_ = lightspeed.initialize(model=Model(), config={**_config(stage), "checkpoint": {"format": fmt}},
                                           dist_init_required=False)
        loaded.load_checkpoint(tmp_path, tag="t")
        plain = loaded.module.router.plain
        assert plain.dtype == fp32 and torch.all(plain == CLOSE_TO_ONE)
        assert dtypes(loaded.module) == AS_BUILT


def test_fp16_keeps_its_list_too():
    engine, *_ = lightspeed.initialize(model=Model(low=fp16), config=_config(2, "fp16", buffer_dtype="fp16"),
                                       dist_init_required=False)
    assert dtypes(engine.module) == {**{n: fp16 for n in AS_BUILT}, "router.bias_fp32": fp32, "router.fp16_only": fp32}


def test_zero_init_keeps_listed_buffers_before_a_checkpoint_is_copied_in():
    cfg = _config(3)
    with Init(config_dict_or_path=cfg, seed=0):
        model = Model()
    # upcast as the block ends (the model built it in bf16), the others as constructed (Init's Note)
    assert dtypes(model) == AS_BUILT
    model.router.bias_fp32.copy_(torch.full((4,), CLOSE_TO_ONE))  # what a loader does: keeps its value
    engine, *_ = lightspeed.initialize(model=model, config=cfg, dist_init_required=False)
    assert dtypes(engine.module) == AS_BUILT and torch.all(engine.module.router.bias_fp32 == CLOSE_TO_ONE)
    _step(engine)
    with Init(config_dict_or_path=_config(3, keep_in_fp32_modules=[]), seed=0):
        model = Model()
    assert model.router.bias_fp32.dtype == bf16
    with Init(config_dict_or_path=_config(3, keep_in_fp32_modules=["*plain"]), seed=0):
        model = Model(low=fp16)  # a list: those buffers only (upcast from fp16 here)
    assert model.router.bias_fp32.dtype == fp16 and model.router.plain.dtype == fp32
    engine, *_ = lightspeed.initialize(model=model, config=_config(3, buffer_dtype="bf16"), dist_init_required=False)
    assert dtypes(engine.module) == {**{n: bf16 for n in AS_BUILT}, "router.bias_fp32": fp32}
    built = Model()
    Init(module=built, config_dict_or_path=cfg)  # an already built model: the same at once
    assert built.router.bias_fp32.dtype == fp32


transformers = pytest.importorskip("transformers")


def _tiny_deepseek_v3():
    return transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
        first_k_dense_replace=1, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4,
        num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1, kv_lora_rank=8, q_lora_rank=None,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, max_position_embeddings=64))


def _lm_step(engine):
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    assert torch.isfinite(loss)


def test_hf_llama_rotary_inv_freq_stays_fp32():
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=64))
    inv_freq = model.model.rotary_emb.inv_freq.clone()
    engine, *_ = lightspeed.initialize(model=model, config=_config(2), dist_init_required=False)
    rotary = engine.module.model.rotary_emb
    assert rotary.inv_freq.dtype == fp32 and torch.equal(rotary.inv_freq, inv_freq)
    assert engine.module.model.embed_tokens.weight.dtype == bf16
    _lm_step(engine)


def test_hf_deepseek_v3_routing_bias_under_zero_init():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(bf16)  # what from_pretrained(dtype=torch.bfloat16) builds under
    try:
        with Init(config_dict_or_path=_config(3), seed=0):
            model = _tiny_deepseek_v3()
    finally:
        torch.set_default_dtype(previous)
    gate = model.model.layers[1].mlp.gate
    assert gate.e_score_correction_bias.dtype == fp32  # listed in _keep_in_fp32_modules_strict: upcast
    engine, *_ = lightspeed.initialize(model=model, config=_config(3), dist_init_required=False)
    assert gate.e_score_correction_bias.dtype == fp32
    assert gate.weight.dtype == bf16  # `gate.weight` is listed too, but parameters follow the training dtype
    _lm_step(engine)
