"""The demo's model and data (examples/gpt.py, examples/data.py): shapes, init, sizes, tokenizer, windows."""

import math
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from examples.data import DEFAULT_CORPUS, ByteTokenizer, TokenWindows, train_val_datasets  # noqa: E402
from examples.gpt import GPT, PRESETS, GPTConfig  # noqa: E402

pytestmark = pytest.mark.timeout(30)

TINY = GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=32)


def _meta_model(name: str) -> GPT:
    with torch.device("meta"):  # sizes only: no memory, no init cost
        return GPT(GPTConfig.preset(name))


def test_forward_shapes_logits_and_loss():
    torch.manual_seed(0)
    model = GPT(TINY)
    idx = torch.randint(0, 256, (3, 10))
    logits = model(idx)
    assert logits.shape == (3, 10, 256) and logits.dtype == torch.float32
    loss = model(idx, idx)
    assert loss.dim() == 0 and torch.isfinite(loss)


def test_too_long_sequence_is_refused():
    with pytest.raises(ValueError, match="block_size"):
        GPT(TINY)(torch.zeros(1, TINY.block_size + 1, dtype=torch.long))


def test_initial_loss_is_about_uniform_for_the_demo_preset():
    torch.manual_seed(0)
    config = GPTConfig.preset("demo")
    model = GPT(config)
    idx = torch.randint(0, 256, (4, config.block_size))
    with torch.no_grad():
        loss = model(idx, torch.roll(idx, -1, dims=1)).item()
    assert abs(loss - math.log(256)) < 0.1


def test_lm_head_is_tied_to_token_embedding():
    model = GPT(TINY)
    assert model.lm_head.weight is model.wte.weight
    names = [n for n, _ in model.named_parameters()]
    assert "wte.weight" in names and "lm_head.weight" not in names  # counted once


def test_gpt2_init_scales_residual_projections():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=16, n_layer=8, n_head=4, n_embd=256))
    expected = 0.02 / math.sqrt(2 * 8)
    assert model.blocks[0].attn.c_proj.weight.std().item() == pytest.approx(expected, rel=0.1)
    assert model.blocks[0].mlp.c_fc.weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert torch.all(model.blocks[0].mlp.c_fc.bias == 0)


def test_num_params_and_flops_of_presets():
    n = {name: _meta_model(name).num_params() for name in PRESETS}
    assert n["demo"] < 2e6
    assert 3.3e8 < n["gpt2-medium"] < 3.7e8
    assert 1.2e9 < n["1.3b"] < 1.4e9
    model = _meta_model("1.3b")
    c = model.config
    assert model.num_params(non_embedding=True) == n["1.3b"] - (c.vocab_size + c.block_size) * c.n_embd
    n_matmul = n["1.3b"] - c.block_size * c.n_embd
    assert model.flops_per_token() == 6 * n_matmul + 12 * c.n_layer * c.n_embd * c.block_size


def test_unknown_preset_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown GPT preset 'huge'"):
        GPTConfig.preset("huge")
    assert GPTConfig.preset("demo", block_size=32).block_size == 32


def test_generate_extends_the_prompt():
    torch.manual_seed(0)
    model = GPT(TINY).eval()
    prompt = torch.tensor([[1, 2, 3]])
    out = model.generate(prompt, 20, temperature=0)  # longer than block_size: the context is cropped
    assert out.shape == (1, 23) and torch.equal(out[:, :3], prompt)
    assert torch.equal(out, model.generate(prompt, 20, temperature=0))


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "ROMEO: But soft! what light through yonder window breaks? \u2014 caf\u00e9"
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids) and len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.decode(torch.tensor(ids)) == text
    assert tok.decode(ids[:-1]).endswith("\ufffd")  # half a character decodes, it does not raise


def test_windows_target_is_input_shifted_by_one():
    tokens = torch.arange(100, dtype=torch.uint8)
    ds = TokenWindows(tokens, block_size=8)
    assert len(ds) == (100 - 9) // 8 + 1
    for i in (0, 5, len(ds) - 1):
        x, y = ds[i]
        assert x.dtype == torch.long and x.shape == y.shape == (8,)
        assert torch.equal(x, torch.arange(8 * i, 8 * i + 8))
        assert torch.equal(y[:-1], x[1:]) and y[-1] == x[-1] + 1
    with pytest.raises(IndexError):
        ds[len(ds)]
    strided = TokenWindows(tokens, block_size=8, stride=3)
    assert torch.equal(strided[2][0], torch.arange(6, 14))


def test_corpus_split_by_position():
    assert DEFAULT_CORPUS.stat().st_size > 300_000
    train, val = train_val_datasets(block_size=64)
    assert len(train) > 8 * len(val) > 0
    raw = DEFAULT_CORPUS.read_bytes()
    x, y = train[0]
    assert bytes(x.tolist()) == raw[:64] and bytes(y.tolist()) == raw[1:65]
    split = int(len(raw) * 0.9)
    assert bytes(val[0][0].tolist()) == raw[split : split + 64]


def test_width_by_layers_shapes():
    c = GPTConfig.preset("4096x8", block_size=512)
    assert (c.n_embd, c.n_head, c.n_layer, c.vocab_size, c.block_size) == (4096, 32, 8, 50304, 512)
    assert GPTConfig.preset("4096x32", block_size=2048) == GPTConfig.preset("6.7b")  # GPT-3 6.7B's shape
    with pytest.raises(ValueError, match="WIDTHxLAYERS"):
        GPTConfig.preset("4096x")
