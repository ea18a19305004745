"""init_inference(checkpoint=...): tiny transformers models saved by `save_pretrained` (sharded safetensors
and torch .bin), built on the meta device under `lightspeed.OnDevice`, loaded one tensor at a time,
quantized on arrival; DeepSpeed's checkpoint JSON forms; saving the prepared model and loading it back
without re-quantizing; bad files and missing tensors."""
from __future__ import annotations

import copy
import json
import os

import pytest
import torch

import lightspeed
from lightspeed.checkpoint.errors import CheckpointError
from lightspeed.inference import QuantizedLinear, init_inference
from lightspeed.inference.checkpoint import DS_CONFIG_NAME, save_inference_checkpoint
from lightspeed.ops.wquant import reserve_scratch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

VOCAB = 96
LLAMA = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=VOCAB, max_position_embeddings=64)


def _llama_cfg(tied=False):
    return transformers.LlamaConfig(**LLAMA, tie_word_embeddings=tied)


def _gpt2_cfg(tied=True):
    return transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64,
                                   tie_word_embeddings=tied)


BUILDERS = {
    "llama": (_llama_cfg, transformers.LlamaForCausalLM),
    "llama_tied": (lambda: _llama_cfg(tied=True), transformers.LlamaForCausalLM),
    "gpt2": (_gpt2_cfg, transformers.GPT2LMHeadModel),
}


def _real(name, seed=0):
    cfg, cls = BUILDERS[name]
    torch.manual_seed(seed)
    return cls(cfg()).eval()


def _meta(name, dtype=torch.float16):
    cfg, cls = BUILDERS[name]
    with lightspeed.OnDevice(dtype=dtype, device="meta"):
        model = cls(cfg()).eval()
    assert all(p.is_meta for p in model.parameters())
    return model


def _ids():
    return torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(3))


def _assert_same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for key in sa:
        assert sa[key].dtype == sb[key].dtype and torch.equal(sa[key], sb[key]), key


@pytest.mark.parametrize("name", list(BUILDERS))
@pytest.mark.parametrize("fmt,group", [("fp6", None), ("int8", None), ("int4", 32), (None, None)])
@pytest.mark.parametrize("safe", [True, False])
def test_meta_model_from_checkpoint_equals_quantizing_the_loaded_model(tmp_path, name, fmt, group, safe):
    """Streaming load + quantize-on-arrival gives bit for bit the buffers (and so the logits) of loading
    the model whole and then calling init_inference on it; sharded files, safetensors and .bin."""
    base = _real(name)
    base.save_pretrained(tmp_path, max_shard_size="40KB", safe_serialization=safe)
    assert len([f for f in os.listdir(tmp_path) if f.endswith((".safetensors", ".bin"))]) > 2
    quant = None if fmt is None else {"weight": fmt, "group_size": group}
    ref = init_inference(copy.deepcopy(base), dtype=torch.bfloat16, device="cpu", quant=quant)
    got = init_inference(_meta(name), dtype=torch.bfloat16, device="cpu", quant=quant, checkpoint=str(tmp_path))
    _assert_same_state(ref, got)
    assert sum(isinstance(m, QuantizedLinear) for m in got.modules()) == (0 if fmt is None else 8 if "gpt2" in name
                                                                          else 14)
    if BUILDERS[name][0]().tie_word_embeddings:
        assert got.lm_head.weight is got.get_input_embeddings().weight
    with torch.no_grad():
        assert torch.equal(ref(_ids()).logits, got(_ids()).logits)


def test_float_tensors_loaded_on_cpu_are_aligned_and_give_the_same_logits(tmp_path):
    """Loaded in their own dtype on the CPU, safetensors' tensors would keep the buffer they were read into,
    which may start off 64-byte alignment (CPU BLAS then rounds differently from the same weights in
    memory): every parameter starts on 64 bytes, and the logits equal the in-memory model's bit for bit."""
    base = _real("llama")
    base.save_pretrained(tmp_path, max_shard_size="40KB")
    got = init_inference(_meta("llama", dtype=torch.float32), dtype=torch.float32, device="cpu",
                         checkpoint=str(tmp_path))
    assert all(p.data_ptr() % 64 == 0 for p in got.parameters())
    with torch.no_grad():
        assert torch.equal(base(_ids()).logits, got(_ids()).logits)


def test_deepspeed_json_forms_and_a_real_model_is_overwritten(tmp_path):
    """DeepSpeed's dict, a JSON file with base_dir, a list of files, ckpt_config: all load the same
    weights; a model with real (different) weights gets the checkpoint's."""
    base = _real("llama")
    base.save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    files = sorted(f for f in os.listdir(tmp_path / "hf") if f.endswith(".safetensors"))
    ref = init_inference(copy.deepcopy(base), dtype=torch.float32, device="cpu", quant={"weight": "int8"})
    ds = {"type": "ds_model", "checkpoints": files, "version": 1.0}
    (tmp_path / "ckpt.json").write_text(json.dumps({**ds, "base_dir": str(tmp_path / "hf")}))
    forms = [dict(checkpoint=ds, base_dir=str(tmp_path / "hf")),
             dict(checkpoint=str(tmp_path / "ckpt.json")),
             dict(checkpoint=files, base_dir=str(tmp_path / "hf")),
             dict(ckpt_config={"checkpoint_dir": str(tmp_path / "hf")}),
             dict(config={"checkpoint": ds, "base_dir": str(tmp_path / "hf")})]
    for form in forms:
        got = init_inference(_meta("llama"), dtype=torch.float32, device="cpu", quant={"weight": "int8"}, **form)
        _assert_same_state(ref, got)
    other = _real("llama", seed=5)
    got = init_inference(other, dtype=torch.float32, device="cpu", quant={"weight": "int8"},
                         checkpoint=str(tmp_path / "hf"))
    _assert_same_state(ref, got)


@pytest.mark.parametrize("fmt,group", [("fp6", None), ("int4", 16), ("int8", 32)])
def test_saved_quantized_model_loads_back_without_requantizing(tmp_path, fmt, group, monkeypatch):
    base = _real("gpt2")
    base.save_pretrained(tmp_path / "hf")
    first = init_inference(_meta("gpt2"), dtype=torch.float16, device="cpu", quant={"weight": fmt, "group_size": group},
                           checkpoint=str(tmp_path / "hf"), save_mp_checkpoint_path=str(tmp_path / "q"))
    names = os.listdir(tmp_path / "q")
    assert DS_CONFIG_NAME in names and "model.safetensors.index.json" in names
    assert transformers.AutoConfig.from_pretrained(tmp_path / "q").n_layer == 2  # a model directory: config.json
    assert not [n for n in names if ".tmp." in n]

    import lightspeed.inference.quantized_linear as ql

    def no_quantize(*args, **kwargs):
        raise AssertionError("re-quantized")

    monkeypatch.setattr(ql, "quantize", no_quantize)
    for kwargs in ({}, {"quant": {"weight": fmt, "group_size": group}}):
        again = init_inference(_meta("gpt2"), dtype=torch.float16, device="cpu", checkpoint=str(tmp_path / "q"),
                               **kwargs)
        _assert_same_state(first, again)
        with torch.no_grad():
            assert torch.equal(first(_ids()).logits, again(_ids()).logits)
    other = "int8" if fmt != "int8" else "fp6"
    with pytest.raises(ValueError, match=f"saved as {fmt}.*{other}"):
        init_inference(_meta("gpt2"), dtype=torch.float16, device="cpu", checkpoint=str(tmp_path / "q"),
                       quant={"weight": other})


def test_sharded_save_round_trip_and_json_path(tmp_path):
    model = init_inference(_real("llama_tied"), dtype=torch.bfloat16, device="cpu", quant={"weight": "fp6"})
    names = save_inference_checkpoint(model, tmp_path, max_shard_bytes=20_000)
    assert len(names) > 3
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(names)
    assert "lm_head.weight" not in index["weight_map"]  # tied: stored once
    ds = json.loads((tmp_path / DS_CONFIG_NAME).read_text())
    assert ds["checkpoints"] == names and ds["type"] == "ds_model" and ds["dtype"] == "bfloat16"
    again = init_inference(_meta("llama_tied"), dtype=torch.bfloat16, device="cpu",
                           checkpoint=str(tmp_path / DS_CONFIG_NAME))
    _assert_same_state(model, again)
    assert again.lm_head.weight is again.model.embed_tokens.weight


def test_base_model_prefix_is_mapped(tmp_path):
    """A base model from a checkpoint with a head (keys `model.` / `transformer.` prefixed) and the
    other way round, as transformers maps them."""
    llama = _real("llama")
    llama.save_pretrained(tmp_path / "llama")
    with lightspeed.OnDevice(dtype=torch.float32):
        base = transformers.LlamaModel(_llama_cfg())
    base = init_inference(base, dtype=torch.float32, device="cpu", checkpoint=str(tmp_path / "llama"))
    assert torch.equal(base.layers[1].mlp.up_proj.weight, llama.model.layers[1].mlp.up_proj.weight)
    gpt2 = transformers.GPT2Model(_gpt2_cfg())
    gpt2.save_pretrained(tmp_path / "gpt2")
    head = init_inference(_meta("gpt2"), dtype=torch.float32, device="cpu", checkpoint=str(tmp_path / "gpt2"))
    assert torch.equal(head.transformer.h[0].attn.c_attn.weight, gpt2.h[0].attn.c_attn.weight)
    assert head.lm_head.weight is head.transformer.wte.weight


def _edit_safetensors(path, edit):
    tensors = safetensors_torch.load_file(path)
    edit(tensors)
    safetensors_torch.save_file(tensors, path, metadata={"format": "pt"})


def test_bad_checkpoints_get_one_line_errors(tmp_path):
    _real("llama").save_pretrained(tmp_path / "ok")
    single = str(tmp_path / "ok" / "model.safetensors")

    def load(path, **kwargs):
        with pytest.raises((CheckpointError, ValueError)) as info:
            init_inference(_meta("llama"), dtype=torch.float32, device="cpu", checkpoint=str(path), **kwargs)
        assert "\n" not in str(info.value)
        return str(info.value)

    (tmp_path / "missing").mkdir()
    import shutil
    shutil.copy(single, tmp_path / "missing" / "model.safetensors")
    _edit_safetensors(str(tmp_path / "missing" / "model.safetensors"),
                      lambda t: t.pop("model.layers.1.post_attention_layernorm.weight"))
    assert "model.layers.1.post_attention_layernorm.weight" in load(tmp_path / "missing")
    (tmp_path / "missing_q").mkdir()
    shutil.copy(single, tmp_path / "missing_q" / "model.safetensors")
    _edit_safetensors(str(tmp_path / "missing_q" / "model.safetensors"),
                      lambda t: t.pop("model.layers.0.self_attn.k_proj.weight"))
    assert "model.layers.0.self_attn.k_proj.weight" in load(tmp_path / "missing_q", quant={"weight": "fp6"})

    (tmp_path / "shape").mkdir()
    shutil.copy(single, tmp_path / "shape" / "model.safetensors")
    _edit_safetensors(str(tmp_path / "shape" / "model.safetensors"),
                      lambda t: t.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(3, 64)}))
    for quant in (None, {"weight": "int8"}):
        assert "has shape (3, 64), the model's is (160, 64)" in load(tmp_path / "shape", quant=quant)

    (tmp_path / "trunc").mkdir()
    data = open(single, "rb").read()
    (tmp_path / "trunc" / "model.safetensors").write_bytes(data[: len(data) // 2])
    assert "safetensors" in load(tmp_path / "trunc")
    (tmp_path / "empty").mkdir()
    assert "no checkpoint files" in load(tmp_path / "empty")

    (tmp_path / "evil").mkdir()

    class Payload:
        def __reduce__(self):
            return (os.system, ("true",))

    torch.save({"x": Payload()}, tmp_path / "evil" / "pytorch_model.bin")
    assert "refused to load" in load(tmp_path / "evil")
    (tmp_path / "badjson.json").write_text("{not json")
    assert "not a readable JSON" in load(tmp_path / "badjson.json")
    (tmp_path / "index").mkdir()
    (tmp_path / "index" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "gone.safetensors"}}))
    assert "gone.safetensors: checkpoint file not found" in load(tmp_path / "index")


def test_meta_model_needs_a_checkpoint_and_real_buffers(tmp_path):
    with pytest.raises(ValueError, match="meta device.*pass checkpoint="):
        init_inference(_meta("llama"), dtype=torch.float32, device="cpu")
    _real("llama").save_pretrained(tmp_path)
    with torch.device("meta"):  # buffers on meta too: the rotary inv_freq is in no checkpoint
        model = transformers.LlamaForCausalLM(_llama_cfg())
    with pytest.raises(CheckpointError, match="inv_freq.*OnDevice"):
        init_inference(model, dtype=torch.float32, device="cpu", checkpoint=str(tmp_path))


def test_on_device():
    with lightspeed.OnDevice(dtype=torch.bfloat16, device="meta"):
        layer = torch.nn.Linear(4, 3)
        norm = torch.nn.BatchNorm1d(3)
    assert layer.weight.is_meta and layer.weight.dtype == torch.bfloat16
    assert not norm.running_mean.is_meta  # buffers stay real
    with lightspeed.OnDevice(dtype=torch.float16, device="cpu"):
        layer = torch.nn.Linear(4, 3)
        steps = torch.nn.Embedding(5, 2)
    assert layer.weight.dtype == torch.float16 and steps.weight.device.type == "cpu"
    with lightspeed.OnDevice(dtype=torch.float16, enabled=False):
        assert torch.nn.Linear(2, 2).weight.dtype == torch.float32
    assert torch.nn.Linear(2, 2).weight.device.type == "cpu"  # the hook is gone after the context
    with pytest.raises(ValueError, match="floating-point"):
        lightspeed.OnDevice(dtype=torch.int8)
    with pytest.raises(ValueError, match="not a device"):
        lightspeed.OnDevice(device="gpu0")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU memory")
def test_gpu_peak_while_loading_a_checkpoint(tmp_path):
    """192 layers of 512 x 512 saved in fp32, loaded onto the GPU in FP6 from the meta device: the GPU
    peak stays under the quantized model plus 0.4 of the fp16 model (one layer's read, cast and
    quantizer temporaries at a time, about 20 MB; loading first and quantizing after would hold all
    96 MiB), and nothing but the quantized model stays."""
    torch.manual_seed(0)
    layers, width = 192, 512
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    safetensors_torch.save_file(model.state_dict(), str(tmp_path / "model.safetensors"))
    with lightspeed.OnDevice(dtype=torch.float16, device="meta"):
        meta = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    fp16_bytes = layers * width * width * 2
    reserve_scratch(torch.device("cuda", torch.cuda.current_device()), "fp6", width)  # the kernel's, not the load's
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    got = init_inference(meta, dtype=torch.float16, quant={"weight": "fp6"}, device="cuda", checkpoint=str(tmp_path))
    torch.cuda.synchronize()
    final = torch.cuda.memory_allocated() - start
    peak = torch.cuda.max_memory_allocated() - start
    assert all(isinstance(m, QuantizedLinear) for m in got)
    assert final < 0.4 * fp16_bytes and peak < final + 0.4 * fp16_bytes, (final, peak)
    ref = init_inference(model, dtype=torch.float16, quant={"weight": "fp6"}, device="cuda")
    _assert_same_state(ref, got)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_checkpoint_onto_the_second_gpu(tmp_path):
    """device='cuda:1' while cuda:0 is current: every tensor lands on cuda:1, the buffers equal those of
    quantizing the loaded model there, and so do the logits."""
    base = _real("llama")
    base.save_pretrained(tmp_path)
    with torch.cuda.device(0):
        got = init_inference(_meta("llama"), dtype=torch.float16, device="cuda:1", quant={"weight": "fp6"},
                             checkpoint=str(tmp_path))
        assert {t.device for t in [*got.parameters(), *got.buffers()]} == {torch.device("cuda", 1)}
        ref = init_inference(copy.deepcopy(base), dtype=torch.float16, device="cuda:1", quant={"weight": "fp6"})
        _assert_same_state(ref, got)
        with torch.no_grad():
            ids = _ids().to("cuda:1")
            torch.testing.assert_close(got(ids).logits, ref(ids).logits)
