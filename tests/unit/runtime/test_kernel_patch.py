"""runtime/kernel_patch.py (the ``kernels`` section): tiny random HF Llama and GPT-2 causal LMs and the
examples' GPT with the fused kernels swapped in give the unpatched model's logits, loss (labels shifted as
HF's ForCausalLMLoss does, num_items_in_batch, shift_labels, tuple outputs) and gradients, on the
reference path and on the Triton path (interpreted on CPU); parameter names stay; eval mode keeps HF's
logits and loss; transformers' own functions are not modified; misuse is a ConfigError naming the key."""
from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

import pytest
import torch

from lightspeed.config import load
from lightspeed.config.errors import ConfigError
from lightspeed.runtime.kernel_patch import apply_kernels

REPO = Path(__file__).resolve().parents[3]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from examples.gpt import GPT, GPTConfig  # noqa: E402

transformers = pytest.importorskip("transformers")
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
VOCAB = 96


def kernels(**over):
    return load({"train_batch_size": 1, "kernels": {"enabled": True, **over}}).kernels


def llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(cfg)
    model.loss_type = "ForCausalLM"
    return model


def gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg)
    model.loss_type = "ForCausalLM"
    return model


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _batch(seed=1, shape=(2, 11)):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, shape, generator=g)
    labels = ids.clone()
    labels[0, :3] = -100
    return ids, labels


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=pytest.mark.skipif(
    not (INTERPRET or torch.cuda.is_available()), reason="no CUDA, TRITON_INTERPRET=0"))])
def test_llama_with_kernels_matches_unpatched(backend):
    base = llama()
    model = copy.deepcopy(base)
    keys = list(model.state_dict())
    done = apply_kernels(model, kernels(backend=backend))
    assert sorted({d.split(": ")[1] for d in done}) == ["fused linear cross-entropy (lm_head)", "rms_norm", "rope",
                                                       "swiglu"]
    assert len(done) == 1 + 2 * 4 + 1  # the loss; per layer attention, MLP, 2 norms; the final norm
    assert list(model.state_dict()) == keys and isinstance(model.model.norm, type(base.model.norm))
    triton = backend == "triton"  # interpreted on CPU: a short batch, one loss form
    ids, labels = _batch(shape=(2, 5) if triton else (2, 11))
    model.eval(), base.eval()
    torch.testing.assert_close(model(ids).logits, base(ids).logits, rtol=1e-5, atol=1e-5)
    model.train(), base.train()
    for kwargs in ({"num_items_in_batch": torch.tensor(3)},) if triton else ({}, {"num_items_in_batch": 13}):
        out, ref = model(input_ids=ids, labels=labels, **kwargs), base(input_ids=ids, labels=labels, **kwargs)
        assert out.logits is None and ref.logits is not None
        torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-6)
        out.loss.backward(), ref.loss.backward()
        got, want = _grads(model), _grads(base)
        assert got.keys() == want.keys()
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
        model.zero_grad(), base.zero_grad()
    loss, *_ = model(input_ids=ids, labels=labels, return_dict=False)
    torch.testing.assert_close(loss, base(input_ids=ids, labels=labels).loss, rtol=1e-5, atol=1e-6)


def test_gpt2_and_examples_gpt_fused_loss():
    base = gpt2()
    model = copy.deepcopy(base)
    assert apply_kernels(model, kernels()) == ["<root>: fused linear cross-entropy (lm_head)"]
    ids, labels = _batch(2)
    shift = torch.roll(labels, -1, dims=1)
    for kwargs in ({"labels": labels}, {"labels": labels, "shift_labels": shift}):
        out, ref = model(input_ids=ids, **kwargs), base(input_ids=ids, **kwargs)
        torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-6)
    out.loss.backward(), ref.loss.backward()
    tied = "transformer.wte.weight"  # the lm_head's weight: tied, one Parameter
    torch.testing.assert_close(_grads(model)[tied], _grads(base)[tied], rtol=1e-4, atol=1e-6)

    torch.manual_seed(0)
    gpt = GPT(GPTConfig.preset("demo", vocab_size=VOCAB, n_layer=1, n_embd=32, n_head=2, block_size=16))
    ref_gpt = copy.deepcopy(gpt)
    done = apply_kernels(gpt, kernels(chunk_size=3))
    assert done == ["<root>: fused linear cross-entropy (lightspeed_fused_lm_loss)"]
    loss, want = gpt(ids[:, :-1], ids[:, 1:]), ref_gpt(ids[:, :-1], ids[:, 1:])
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    loss.backward(), want.backward()
    torch.testing.assert_close(gpt.wte.weight.grad, ref_gpt.wte.weight.grad, rtol=1e-4, atol=1e-6)
    assert gpt(ids).shape == (2, 11, VOCAB)  # no targets: the logits


def test_eval_mode_disabled_switches_and_errors():
    from transformers.models.llama import modeling_llama

    original = modeling_llama.apply_rotary_pos_emb
    base, model = llama(), llama()
    apply_kernels(model, kernels(rms_norm=False, swiglu=False))
    assert modeling_llama.apply_rotary_pos_emb is original  # nothing global changed
    assert type(model.model.norm) is modeling_llama.LlamaRMSNorm and type(model.model.layers[0].mlp).__name__ == \
        "LlamaMLP" and type(model.model.layers[0].self_attn).__name__ == "FusedLlamaAttention"
    ids, labels = _batch()
    model.eval(), base.eval()
    out, ref = model(input_ids=ids, labels=labels), base(input_ids=ids, labels=labels)
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-5, atol=1e-5)  # eval: real logits, HF's loss
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-6)
    assert apply_kernels(llama(), load({"train_batch_size": 1}).kernels) == []
    with pytest.raises(ConfigError, match="kernels.enabled: nothing in Sequential has a fused kernel"):
        apply_kernels(torch.nn.Sequential(torch.nn.Linear(2, 2)), kernels())
    odd = gpt2()
    odd.lm_head.__class__ = type("SplitHead", (torch.nn.Linear,), {})
    with pytest.raises(ConfigError, match="output embeddings are a SplitHead, not a plain nn.Linear"):
        apply_kernels(odd, kernels())
    with pytest.raises(Exception, match="kernels.backend"):
        kernels(backend="cuda")


@pytest.mark.parametrize("family,count", [("Qwen2", 10), ("Qwen3", 14), ("Mistral", 10)])
def test_llama_family_models_take_every_kernel(family, count):
    """Qwen3's per-head q / k norms are RMSNorms too (4 more modules)."""
    cfg = getattr(transformers, f"{family}Config")(vocab_size=VOCAB, hidden_size=32, intermediate_size=40,
                                                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                    max_position_embeddings=64, head_dim=8)
    torch.manual_seed(0)
    base = getattr(transformers, f"{family}ForCausalLM")(cfg)
    base.loss_type = "ForCausalLM"
    model = copy.deepcopy(base)
    done = apply_kernels(model, kernels())
    assert len(done) == count and {d.split(": ")[1] for d in done} == {
        "fused linear cross-entropy (lm_head)", "rms_norm", "rope", "swiglu"}
    ids, labels = _batch(3, (2, 9))
    out, ref = model(input_ids=ids, labels=labels), base(input_ids=ids, labels=labels)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-6)
    out.loss.backward(), ref.loss.backward()
    got, want = _grads(model), _grads(base)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
