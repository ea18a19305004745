"""The flops profiler against hand counts: nn.Linear (2*M*K*N), attention through
F.scaled_dot_product_attention and through matmuls, the demo GPT; the DeepSpeed API
(get_model_profile, FlopsProfiler) and the printed profile; peak throughput and MFU."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from lightspeed.profiling.flops_profiler import (
    FlopsProfiler, flops_to_string, get_model_profile, macs_to_string, number_to_string, params_to_string,
)  # fmt: skip
from lightspeed.profiling.peak_flops import mfu, peak_tflops

REPO = Path(__file__).resolve().parents[3]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from examples.gpt import GPT, GPTConfig  # noqa: E402

pytestmark = pytest.mark.timeout(120)


class SDPAAttention(nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class MatmulAttention(nn.Module):
    def forward(self, q, k, v):
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        return torch.matmul(scores.softmax(dim=-1), v)


def _numel(model):
    return sum(p.numel() for p in model.parameters())


def test_linear_is_2mkn():
    M, K, N = 6, 16, 32
    layer = nn.Linear(K, N)
    flops, macs, params = get_model_profile(layer, input_shape=(2, 3, K), print_profile=False, as_string=False)
    assert (flops, macs, params) == (2 * M * K * N, M * K * N, K * N + N)


@pytest.mark.parametrize("attention", [SDPAAttention, MatmulAttention])
def test_attention_is_two_batched_matmuls(attention):
    B, H, S, D = 2, 4, 8, 16
    q, k, v = (torch.randn(B, H, S, D) for _ in range(3))
    flops, macs, _ = get_model_profile(attention(), args=[q, k, v], print_profile=False, as_string=False)
    assert flops == 2 * (2 * B * H * S * S * D) and macs == flops // 2  # q @ k^T and p @ v


def _tiny_gpt():
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))


def test_small_gpt_total_per_module_and_tree():
    model = _tiny_gpt()
    B, T = 3, 10
    C, L, V = model.config.n_embd, model.config.n_layer, model.config.vocab_size
    attn = 2 * B * T * C * 3 * C + 2 * B * T * C * C + 4 * B * T * T * C  # c_attn, c_proj, sdpa
    mlp = 2 * B * T * C * 4 * C * 2  # c_fc and c_proj
    head = 2 * B * T * C * V
    prof = FlopsProfiler(model)
    prof.start_profile()
    model(torch.randint(0, V, (B, T)))
    assert prof.get_total_flops() == L * (attn + mlp) + head
    assert prof.get_total_macs() == prof.get_total_flops() // 2
    assert prof.get_total_params() == _numel(model)  # the tied head counted once
    assert prof.get_total_duration() > 0
    root = prof.module_stats()
    by_name = {}

    def walk(stats, prefix):
        by_name[prefix + stats.name] = stats
        for child in stats.children:
            walk(child, prefix + stats.name + "." if stats.name else prefix)

    walk(root, "")
    assert by_name["blocks.0.attn"].flops == attn and by_name["blocks.1.mlp"].flops == mlp
    assert by_name["blocks"].flops == L * (attn + mlp)  # a ModuleList: the sum of its blocks
    assert by_name["blocks.0.attn.c_attn"].params == C * 3 * C + 3 * C
    assert by_name["lm_head"].flops == head and by_name["wte"].flops == 0
    assert by_name["blocks.0"].duration >= by_name["blocks.0.attn"].duration > 0
    text = prof.profile_text(profile_step=7)
    prof.end_profile()
    assert "Profile Summary at step 7:" in text
    rows = {row.split(":")[0]: row.split(":", 1)[1].strip() for row in text.splitlines() if ":" in row}
    assert rows["fwd flops per GPU"] == number_to_string(L * (attn + mlp) + head).strip()
    assert rows["params per GPU"] == params_to_string(_numel(model))
    for line in ("GPT: ", "  blocks (ModuleList): ", "    0 (Block): ", "      attn (CausalSelfAttention): ",
                 "        c_attn (Linear): ", "  lm_head (Linear): "):
        assert any(row.startswith(line) for row in text.splitlines()), line
    assert "MFU (fwd flops / fwd latency / peak):" in text and "unknown" in text  # CPU: no peak


def test_profiler_counts_forward_only_and_every_forward():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    one = 2 * 5 * 8 * 8 + 2 * 5 * 8 * 4
    x = torch.randn(5, 8)
    prof = FlopsProfiler(model)
    prof.start_profile()
    model(x).sum().backward()  # the backward's matmuls are not counted
    assert prof.get_total_flops() == one
    model(x)
    assert prof.get_total_flops() == 2 * one and prof.module_stats().calls == 2
    prof.stop_profile()
    model(x)  # hooks removed: not counted, counts still readable
    assert prof.get_total_flops() == 2 * one
    prof.reset_profile()
    assert prof.get_total_flops() == 0
    prof.end_profile()
    assert not prof.started
    with pytest.raises(RuntimeError, match="between start_profile"):
        prof.get_total_flops()


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
        self.reentrant = reentrant

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=self.reentrant)


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_recompute_is_not_forward(reentrant):
    model = Checkpointed(reentrant)
    prof = FlopsProfiler(model)
    prof.start_profile()
    model(torch.randn(4, 8, requires_grad=True)).sum().backward()  # the backward re-runs the block
    assert prof.get_total_flops() == 2 * (2 * 4 * 8 * 8)
    assert prof.module_stats().children[0].calls == 1
    prof.end_profile()


def test_submodule_called_alone_and_ignore_list():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    prof = FlopsProfiler(model)
    prof.start_profile(ignore_list=[nn.Linear])
    model(torch.randn(2, 8))  # Linear layers are not hooked: their work counts in the Sequential
    stats = prof.module_stats()
    assert prof.get_total_flops() == 2 * (2 * 2 * 8 * 8) == stats.flops
    assert [c.flops for c in stats.children] == [0, 0]
    prof.end_profile()
    prof.start_profile()
    model[1](torch.randn(3, 8))  # the model itself not called: its submodule's work is the total
    assert prof.get_total_flops() == 2 * 3 * 8 * 8
    prof.end_profile()


def test_print_to_output_file_with_depth_and_top_modules(tmp_path):
    model = _tiny_gpt()
    out = tmp_path / "sub" / "profile.txt"
    flops, macs, params = get_model_profile(model, args=[torch.randint(0, 64, (2, 8))], module_depth=1,
                                            top_modules=2, detailed=False, output_file=str(out))
    text = out.read_text()
    assert (flops, macs, params) == (number_to_string(_flops_of(model, 2, 8)),
                                     macs_to_string(_flops_of(model, 2, 8) // 2), params_to_string(_numel(model)))
    assert "depth 0:" in text and "depth 1:" in text and "depth 2:" not in text
    depth1 = text.split("depth 1:")[1].splitlines()[1]  # params at depth 1: the two largest classes
    assert depth1.strip().startswith("params      - {'ModuleList': ") and "'Embedding': " in depth1
    assert "Detailed Profile" not in text


def _flops_of(model, B, T):
    C, L, V = model.config.n_embd, model.config.n_layer, model.config.vocab_size
    return L * (24 * B * T * C * C + 4 * B * T * T * C) + 2 * B * T * C * V


def test_print_model_profile_logs(ls_caplog):
    import logging

    ls_caplog.set_level(logging.INFO, logger="lightspeed")
    model = nn.Linear(4, 4)
    prof = FlopsProfiler(model)
    prof.print_model_profile()  # not started: nothing
    prof.start_profile()
    model(torch.randn(1, 4))
    prof.print_model_profile(profile_step=3)
    prof.end_profile()
    text = "\n".join(r.getMessage() for r in ls_caplog.records)
    assert "Profile Summary at step 3:" in text and "Linear: 20 = 100% Params, 16 MACs = 100% MACs" in text
    assert (prof.flops, prof.macs, prof.params) == (32, 16, 20)


class Generator(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return self.proj(x)

    def generate(self, x, steps=3):
        for _ in range(steps):
            x = self(x).tanh()
        return x


def test_generate_mode_counts_every_forward():
    flops, _, _ = get_model_profile(Generator(), args=[torch.randn(2, 4)], kwargs={"steps": 3}, mode="generate",
                                    print_profile=False, as_string=False, warm_up=0)
    assert flops == 3 * 2 * 2 * 4 * 4


def test_bad_arguments():
    with pytest.raises(ValueError, match="mode must be 'forward' or 'generate'"):
        get_model_profile(nn.Linear(2, 2), input_shape=(1, 2), mode="backward")
    with pytest.raises(ValueError, match="give input_shape, args or kwargs"):
        get_model_profile(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="input_shape must be a non-empty tuple"):
        get_model_profile(nn.Linear(2, 2), input_shape=[1, 2])
    with pytest.raises(TypeError, match="must be a torch.nn.Module"):
        FlopsProfiler(lambda x: x)


def test_number_formats():
    assert number_to_string(1.5e12) == "1.5 T" and number_to_string(0) == "0 " and number_to_string(2e-4) == "200 u"
    assert flops_to_string(3.2e9) == "3.2 GFLOPS" and macs_to_string(1234) == "1.23 KMACs"
    assert params_to_string(1.3e9) == "1.3 B" and params_to_string(125e6) == "125 M"


@pytest.mark.parametrize("name, dtype, peak", [
    ("NVIDIA H200", torch.bfloat16, 989.0), ("NVIDIA H100 80GB HBM3", torch.float16, 989.0),
    ("NVIDIA H100 PCIe", torch.bfloat16, 756.0), ("NVIDIA A100-SXM4-80GB", torch.float32, 19.5),
    ("NVIDIA L4", torch.bfloat16, 121.0), ("NVIDIA L40S", torch.bfloat16, 362.0),
    ("Tesla V100-SXM2-32GB", torch.bfloat16, None), ("cpu", torch.float32, None), ("NVIDIA B300", torch.bfloat16, None),
])  # fmt: skip
def test_peak_table(name, dtype, peak):
    assert peak_tflops(name, dtype) == peak
    assert mfu(494.5e12, name, dtype) == (None if peak is None else pytest.approx(494.5 / peak))
