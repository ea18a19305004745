"""The ``kernels`` section through `lightspeed.initialize` on two gloo processes: tiny HF Llama (every kernel),
HF GPT-2 and the examples' GPT (the fused linear cross-entropy) train the same with kernels on as off, at
ZeRO 0, 2 and 3 (at stage 3 the lm_head's weight inside the fused loss must be the gathered one: the
patched lm_head refuses a partition, and the losses after the first update depend on every gradient),
and with engine.compile() (aot_eager: dynamo and AOTAutograd, no code generation, to stay fast on CPU;
stage 2 compiles the whole module, the model's and the lm_head's hooks inside, stage 3 each block).
CPU tensors take the kernels' reference path; the Triton path is tested in tests/ops and
tests/unit/runtime. One world for every case."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from lightspeed.testing.run_world import run_world

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

pytestmark = [pytest.mark.dist, pytest.mark.timeout(180)]

VOCAB, STEPS = 64, 3
RELEASE_ALL = {"stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0}


def build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "gpt":
        from examples.gpt import GPT, GPTConfig

        return GPT(GPTConfig.preset("demo", vocab_size=VOCAB, n_layer=2, n_embd=32, n_head=2, block_size=16))
    import transformers

    if name == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=32))
    else:
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))
    model.loss_type = "ForCausalLM"
    return model


def train(name: str, stage: int, kernels: bool, compiled: bool = False):
    import torch.distributed as dist

    import lightspeed

    model = build(name)
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9, "gradient_clipping": 1.0,
           "zero_optimization": {"stage": stage, **(RELEASE_ALL if stage == 3 else {})},
           "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}}
    if kernels:
        cfg["kernels"] = {"enabled": True, "chunk_size": 5}  # chunks that do not divide the 32 tokens
    engine, *_ = lightspeed.initialize(model=model, config=cfg)
    if compiled:
        engine.compile(backend="aot_eager")
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    x = torch.randint(0, VOCAB, (2, 17), generator=g)
    losses = []
    for _ in range(STEPS):
        loss = engine(x[:, :-1], x[:, 1:]) if name == "gpt" else engine(input_ids=x[:, :-1], labels=x[:, :-1]).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    patched = sorted({type(m).__name__ for m in engine.module.modules() if type(m).__name__.startswith("Fused")})
    return losses, patched


CASES = [("llama", 2, True), ("llama", 3, False), ("llama", 3, True), ("gpt2", 3, False), ("gpt", 0, True),
         ("gpt", 3, False)]


def _world():
    return {case: (train(case[0], case[1], False, case[2]), train(case[0], case[1], True, case[2]))
            for case in CASES}


def test_kernels_train_as_the_unpatched_model_at_zero_0_2_and_3():
    for rank, result in enumerate(run_world(_world, 2, timeout=170)):
        for (name, stage, compiled), ((plain, plain_patched), (fused, patched)) in result.items():
            where = f"rank {rank} {name} stage {stage}{' compiled' if compiled else ''}"
            assert plain_patched == []
            if name == "llama":
                assert patched == ["FusedLinear", "FusedLlamaAttention", "FusedLlamaMLP", "FusedLlamaRMSNorm"], where
            elif name == "gpt2":
                assert patched == ["FusedLinear"], where
            torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5, msg=where)
            assert plain[-1] < plain[0], f"{where}: did not learn"
