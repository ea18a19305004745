"""Activation checkpointing on real gloo processes: checkpointed equals plain (dropout included) under
the engine at ZeRO stages 0-3, Hugging Face's gradient_checkpointing_enable() likewise, with the
stage-3 trace unchanged by the recomputation; and inputs partitioned over a model-parallel group of
two (or kept on the host, or in contiguous buffers) give the gradients of inputs kept whole."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import lightspeed
from lightspeed import checkpointing
from lightspeed.checkpointing import settings
from lightspeed.testing.checkpointed_models import CheckpointedNet
from lightspeed.testing.run_world import run_world

pytestmark = [pytest.mark.dist, pytest.mark.timeout(240)]

STEPS = 3
OPT = {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}}
RELEASE_ALL = {"stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0,
               "stage3_prefetch_bucket_size": 200}


def _fresh():
    settings.SETTINGS.__init__()
    checkpointing.get_cuda_rng_tracker().reset()


def _config(stage: int, micro: int, dp: int, **extra) -> dict:
    zero = {"stage": stage, **(RELEASE_ALL if stage == 3 else {})}
    return {"train_batch_size": micro * dp, "steps_per_print": 10**6, "optimizer": OPT, "zero_optimization": zero,
            **extra}


def _net_batches(rank: int, dim: int = 8):
    g = torch.Generator().manual_seed(10 + rank)
    return [(torch.randn(4, dim, generator=g), torch.randn(4, 1, generator=g)) for _ in range(STEPS)]


def _train(engine, batches, forward, layer):
    """Per step: loss, gradient norm; then the whole state, at stage 3 whether the trace held, and how
    many times `layer` ran forward (twice a step when it is recomputed)."""
    losses, norms, traces = [], [], []
    calls = []
    # a pre-hook: torch's non-reentrant recomputation stops once it has what backward needs, before the
    # last module's forward hooks
    handle = layer.register_forward_pre_hook(lambda *_: calls.append(1))
    coordinator = engine.strategy.coordinator if engine.strategy.stage == 3 else None
    for batch in batches:
        loss = forward(engine, batch)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        norms.append(engine.get_global_grad_norm())
        if coordinator is not None:
            assert coordinator._trace_done and coordinator._trace_ok
            traces.append([id(m) for m in coordinator._trace])
    handle.remove()
    state = {k: v.float().clone() for k, v in engine.strategy.module_state_dict().items()}
    return {"losses": losses, "norms": norms, "state": state, "trace_fixed": all(t == traces[0] for t in traces),
            "runs": len(calls)}


def _net_run(stage: int, mode: str, mpu=None, ckpt: dict | None = None, dp: int | None = None):
    _fresh()
    if ckpt is not None:
        checkpointing.configure(mpu, **ckpt)
    # with a model-parallel group the tracked stream differs per rank (as Megatron seeds it), which would
    # make the blocks' outputs differ between the ranks; partitioning needs them equal, as in a real TP model
    model = CheckpointedNet(mode, tracked=mpu is None)
    engine, *_ = lightspeed.initialize(model=model, config=_config(stage, 4, dp or dist.get_world_size()), mpu=mpu)
    checkpointing.model_parallel_cuda_manual_seed(7)
    rank = dist.get_rank() if mpu is None else mpu.get_data_parallel_rank()  # model-parallel ranks: the same data
    return _train(engine, _net_batches(rank), lambda e, b: e(*b), engine.module.blocks[0])


def _hf_model(kind: str, checkpointed: bool):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if kind == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2))
    else:
        model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16))
    model.config.use_cache = False
    if checkpointed:
        model.gradient_checkpointing_enable()
        assert model.is_gradient_checkpointing
    return model


def _hf_run(stage: int, kind: str, checkpointed: bool):
    _fresh()
    model = _hf_model(kind, checkpointed)
    # a module inside the first layer: transformers 5 checkpoints the layer's forward, not its __call__
    layer = model.transformer.h[0].mlp if kind == "gpt2" else model.model.layers[0].mlp
    engine, *_ = lightspeed.initialize(model=model, config=_config(stage, 2, dist.get_world_size()))
    g = torch.Generator().manual_seed(3 + dist.get_rank())
    batches = [torch.randint(0, 64, (2, 12), generator=g) for _ in range(STEPS)]
    torch.manual_seed(11)  # dropout
    return _train(engine, batches, lambda e, ids: e(input_ids=ids, labels=ids).loss, layer)


def _stages():
    out = {}
    for stage in (0, 1, 2, 3):
        for mode in ("plain", "reentrant"):
            out[("net", stage, mode)] = _net_run(stage, mode)
        for checkpointed in (False, True):
            out[("gpt2", stage, checkpointed)] = _hf_run(stage, "gpt2", checkpointed)
    out[("net", 3, "non_reentrant")] = _net_run(3, "non_reentrant")
    for checkpointed in (False, True):
        out[("llama", 3, checkpointed)] = _hf_run(3, "llama", checkpointed)
    return out


def _same(a, b, key):
    """`b` (checkpointed) equals `a` (plain), and recomputed its layers."""
    assert a["runs"] == STEPS and b["runs"] == 2 * STEPS, key
    assert a["losses"] == b["losses"], key
    assert a["norms"] == pytest.approx(b["norms"], rel=1e-6), key
    for k, v in a["state"].items():
        torch.testing.assert_close(b["state"][k], v, rtol=1e-6, atol=1e-7, msg=lambda m, k=k: f"{key} {k}: {m}")


def test_checkpointed_equals_plain_at_every_stage():
    results = run_world(_stages, 2)
    for r in results:
        for stage in (0, 1, 2, 3):
            _same(r[("net", stage, "plain")], r[("net", stage, "reentrant")], ("net", stage))
            _same(r[("gpt2", stage, False)], r[("gpt2", stage, True)], ("gpt2", stage))
        _same(r[("net", 3, "plain")], r[("net", 3, "non_reentrant")], ("net", 3, "non_reentrant"))
        _same(r[("llama", 3, False)], r[("llama", 3, True)], ("llama", 3))
        for key, got in r.items():
            if key[1] == 3:
                assert got["trace_fixed"], key
    for k, v in results[0][("net", 0, "reentrant")]["state"].items():  # data parallel: one model on both ranks
        assert torch.equal(results[1][("net", 0, "reentrant")]["state"][k], v), k


class TensorParallelMpu:
    """Megatron-style mpu: consecutive ranks in model-parallel groups of `mp`, the ranks at the same
    place in each of those in one data-parallel group."""

    def __init__(self, mp: int | None = None):
        world, rank = dist.get_world_size(), dist.get_rank()
        self.mp = mp or world
        self.dp = world // self.mp
        # every rank takes part in creating every group
        mp_groups = [dist.new_group(list(range(i * self.mp, (i + 1) * self.mp))) for i in range(self.dp)]
        dp_groups = [dist.new_group(list(range(j, world, self.mp))) for j in range(self.mp)]
        self.mp_rank, self.dp_rank = rank % self.mp, rank // self.mp
        self.mp_group, self.dp_group = mp_groups[self.dp_rank], dp_groups[self.mp_rank]

    def get_model_parallel_rank(self):
        return self.mp_rank

    def get_model_parallel_world_size(self):
        return self.mp

    def get_model_parallel_group(self):
        return self.mp_group

    def get_data_parallel_rank(self):
        return self.dp_rank

    def get_data_parallel_world_size(self):
        return self.dp

    def get_data_parallel_group(self):
        return self.dp_group


def _kept_bytes(options: dict, mpu) -> int:
    """Bytes one checkpoint keeps for an 8 x 16 fp32 input, as autograd's saved-tensor hooks see them."""
    _fresh()
    checkpointing.configure(mpu, **options)
    seen = []
    x = torch.randn(8, 16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t.numel() * t.element_size()) or t,
                                                  lambda t: t):
        out = checkpointing.checkpoint(torch.nn.Linear(16, 16), x)
    out.sum().backward()
    return sum(seen)


def _partitioned():
    mpu = TensorParallelMpu()
    variants = {"whole": {}, "partitioned": {"partition_activations": True}, "host": {"checkpoint_in_cpu": True},
                "partitioned-host": {"partition_activations": True, "checkpoint_in_cpu": True},
                "contiguous": {"partition_activations": True, "contiguous_checkpointing": True, "num_checkpoints": 3}}
    out = {name: _net_run(0, "reentrant", mpu=mpu, ckpt=opts, dp=1) for name, opts in variants.items()}
    out["non_reentrant-partitioned"] = _net_run(0, "non_reentrant", mpu=mpu, ckpt=variants["partitioned"], dp=1)
    out["plain"] = _net_run(0, "plain", mpu=mpu, dp=1)
    out["bytes"] = {name: _kept_bytes(variants[name], mpu) for name in ("whole", "partitioned")}
    return out


def test_partitioned_inputs_give_the_gradients_of_whole_ones():
    results = run_world(_partitioned, 2)
    for r in results:
        for name in ("whole", "partitioned", "host", "partitioned-host", "contiguous", "non_reentrant-partitioned"):
            _same(r["plain"], r[name], name)
        assert r["bytes"]["partitioned"] * 2 == r["bytes"]["whole"] == 8 * 16 * 4
    assert results[0]["partitioned"]["losses"] == results[1]["partitioned"]["losses"]  # one model, two ranks


def _partitioned_with_data_parallel():
    """World 4 = 2 data-parallel x 2 model-parallel: ZeRO shards over the data-parallel group while the
    checkpoints partition over the model-parallel one."""
    mpu = TensorParallelMpu(mp=2)
    out = {}
    for stage in (2, 3):
        out[("plain", stage)] = _net_run(stage, "plain", mpu=mpu, dp=2)
        out[("partitioned", stage)] = _net_run(stage, "reentrant", mpu=mpu, ckpt={"partition_activations": True},
                                               dp=2)
    return out


def test_partitioned_inputs_under_zero_with_data_parallel_world_size_4():
    results = run_world(_partitioned_with_data_parallel, 4)
    for r in results:
        for stage in (2, 3):
            _same(r[("plain", stage)], r[("partitioned", stage)], ("partitioned", stage))
    assert results[0][("partitioned", 3)]["losses"] == results[1][("partitioned", 3)]["losses"]  # one mp group
    assert results[0][("partitioned", 3)]["losses"] != results[2][("partitioned", 3)]["losses"]  # other data
