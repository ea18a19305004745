"""Ulysses sequence parallelism on real gloo processes, against one process on the whole sequence: the
all-to-all's gradient, DistributedAttention in a plain model and a tiny HF Llama through
register_with_transformers + UlyssesSPDataLoaderAdapter, at sp2 (world 2) and sp2 x dp2 (world 4, the plain
model's MoE layer expert-parallel over the two dp ranks; and pp2 x sp2 through a PipelineModule), under
ZeRO stages 0-3 (SGD with an active gradient clip, so a gradient off by sp shows); transformers' loss
against real DeepSpeed 0.19.8's grad norms; and the errors for sizes that do not fit."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import lightspeed
from lightspeed.comm.differentiable import seq_all_to_all
from lightspeed.comm.sequence_groups import current_sequence_groups, initialize_sequence_parallel
from lightspeed.config.errors import ConfigError
from lightspeed.parallel.experts.layer import MoE
from lightspeed.parallel.pipeline import PipelineModule
from lightspeed.sequence import (DistributedAttention, UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter,
                                 sequence_parallel_loss)
from lightspeed.testing import deepspeed_env
from lightspeed.testing.run_world import run_world
from lightspeed.zero.param_access import safe_get_full_fp32_param, safe_get_full_grad

pytestmark = pytest.mark.dist

RTOL, ATOL = 1e-5, 1e-7
SP = 2
STAGES = (0, 1, 2, 3)
LR, CLIP = 0.1, 0.05  # the attention test's SGD; its gradient clip, below every step's norm
DS_WORKER = Path(__file__).resolve().parents[1] / "deepspeed" / "deepspeed_sp_worker.py"


# ---------------------------------------------------------------- the all-to-all and its gradient
def _all_to_all_worker(sp: int):
    groups = initialize_sequence_parallel(sp)
    torch.manual_seed(0)
    full = torch.randn(2, 8, 4, 3, dtype=torch.float64)  # [b, s, h, d], the same on every rank
    weight = torch.randn(2, 8, 4, 3, dtype=torch.float64)
    ref = full.clone().requires_grad_()
    (ref.sin() * weight).sum().backward()  # the single-process computation
    r, chunk, heads = groups.sp_rank, 8 // sp, 4 // sp
    local = full[:, r * chunk:(r + 1) * chunk].clone().requires_grad_()
    out = seq_all_to_all(local, groups.sp_group, 2, 1)  # -> [b, s, h/sp, d]
    head_slice = slice(r * heads, (r + 1) * heads)
    forward_ok = torch.equal(out, full[:, :, head_slice])
    (out.sin() * weight[:, :, head_slice]).sum().backward()
    back = seq_all_to_all(out.detach(), groups.sp_group, 1, 2)
    return forward_ok, torch.equal(back, local.detach()), local.grad, ref.grad[:, r * chunk:(r + 1) * chunk]


@pytest.mark.parametrize("world", [2, 4])
def test_all_to_all_and_its_backward_match_single_process_autograd(world):
    for forward_ok, round_trip_ok, grad, want in run_world(_all_to_all_worker, world, SP):
        assert forward_ok and round_trip_ok
        torch.testing.assert_close(grad, want, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- DistributedAttention in a plain model
HIDDEN, HEADS, SEQ, BATCH, EXPERTS = 16, 4, 8, 2, 4


def _causal_sdpa(q, k, v):  # [b, s, h, d] in and out
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    return out.transpose(1, 2)


class AttentionBlock(torch.nn.Module):
    """qkv projection, attention, an MoE layer (EXPERTS experts, top-1, no token dropped, `ep` of them
    expert-parallel; its balance loss left out: it is not a sum over tokens), output projection,
    per-token MSE (mean over this module's tokens)."""

    def __init__(self, group=None, sp: int = 1, ep: int = 1):
        super().__init__()
        self.qkv = torch.nn.Linear(HIDDEN, 3 * HIDDEN)
        self.out = torch.nn.Linear(HIDDEN, HIDDEN)
        self.attn = DistributedAttention(_causal_sdpa, group, scatter_idx=2, gather_idx=1) if sp > 1 else None
        expert = torch.nn.Sequential(torch.nn.Linear(HIDDEN, 2 * HIDDEN), torch.nn.GELU(),
                                     torch.nn.Linear(2 * HIDDEN, HIDDEN))
        self.moe = MoE(HIDDEN, expert, num_experts=EXPERTS, ep_size=ep, k=1, drop_tokens=False)

    def forward(self, x, y):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, HEADS, HIDDEN // HEADS).unbind(2)
        ctx = self.attn(q, k, v, 0) if self.attn is not None else _causal_sdpa(q, k, v)
        ctx = ctx.reshape(b, s, HIDDEN)
        return F.mse_loss(self.out(ctx + self.moe(ctx)[0]).tanh(), y)


def _global_names(engine, values: dict) -> dict:
    """`values` by parameter name with each local expert renamed to its global index (ep rank x local
    experts + local index), as one process names it."""
    ep_rank = engine.groups.topology.rank("ep") if engine.groups.topology is not None else 0
    local = engine.module.moe.num_local_experts

    def rename(name):
        m = re.search(r"deepspeed_experts\.(\d+)\.", name)
        return name if m is None else f"{name[:m.start(1)]}{ep_rank * local + int(m.group(1))}{name[m.end(1):]}"

    return {rename(n): v for n, v in values.items()}


def _attention_batches(dp: int, steps: int):
    gen = torch.Generator().manual_seed(1)
    return [[(torch.randn(BATCH, SEQ, HIDDEN, generator=gen), torch.randn(BATCH, SEQ, HIDDEN, generator=gen))
             for _ in range(dp)] for _ in range(steps)]


def _attention_reference(dp: int, steps: int):
    """One process, the whole sequence: SGD with the gradient clipped (active) at CLIP."""
    torch.manual_seed(0)
    model = AttentionBlock()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], []
    for batches in _attention_batches(dp, steps):
        per_replica = [model(x, y) for x, y in batches]
        loss = sum(per_replica) / dp
        loss.backward()
        losses.append([v.item() for v in per_replica])
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        assert norm > CLIP  # the clip is active: a gradient sp times too large or too small changes the step
        opt.step()
        opt.zero_grad()
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def _config(stage: int, **extra):
    return {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1, "sequence_parallel_size": SP,
            "gradient_clipping": 0.0,
            "zero_optimization": {"stage": stage}, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
            "steps_per_print": 1000, **extra}


def _attention_worker(steps: int):
    """Every ZeRO stage in turn, each a fresh engine (stages 0-2 sum the sp ranks' gradients, stage 3
    averages them: the loss follows the engine initialized last); then, per stage, the grad norms of the
    DeepSpeed comparison's per-token MLP under transformers' loss (tests/deepspeed/deepspeed_sp_worker.py)."""
    groups = initialize_sequence_parallel(SP)
    chunk = SEQ // SP
    mine = slice(groups.sp_rank * chunk, (groups.sp_rank + 1) * chunk)
    out = {}
    for stage in STAGES:
        torch.manual_seed(0)
        model = AttentionBlock(groups.sp_group, SP, ep=dist.get_world_size() // SP)
        config = {k: v for k, v in _config(stage, gradient_clipping=CLIP).items() if k != "optimizer"}
        engine, _, _, _ = lightspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR),
                                                config=config)
        assert (engine.dp_world_size, engine.seq_dp_world_size) == (dist.get_world_size() // SP,
                                                                    dist.get_world_size())
        losses, grads = [], []
        for batches in _attention_batches(engine.dp_world_size, steps):
            x, y = batches[groups.dp_rank]
            local = engine(x[:, mine], y[:, mine])  # mean over this rank's tokens
            loss = sequence_parallel_loss(local, y[:, mine].numel())
            engine.backward(loss)
            losses.append(loss.item())
            grads.append(_global_names(engine, {n: safe_get_full_grad(p).clone()
                                                for n, p in engine.module.named_parameters()}))
            engine.step()
        params = _global_names(engine, {n: safe_get_full_fp32_param(p).clone()
                                        for n, p in engine.module.named_parameters()})
        out[stage] = losses, grads, params
    ds = _ds_worker()
    norms = {}
    for stage in STAGES:
        model = ds.build()
        engine, _, _, _ = lightspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=ds.LR),
                                                config=ds.config(stage))
        norms[stage] = []
        for x, y in (step[groups.dp_rank] for step in ds.batches(engine.dp_world_size)):
            engine.backward(ds.sp_loss(engine, x, y, groups.sp_rank, groups.sp_group, times_sp=stage == 3))
            engine.step()
            norms[stage].append(float(engine.get_global_grad_norm()))
    piped = _pipeline_run(groups, mine) if dist.get_world_size() == 4 else None
    return groups.dp_rank, out, norms, piped


# ---------------------------------------------------------------- pipeline x sequence parallel (world 4)
PIPE_STEPS, PIPE_GAS = 3, 2


class _PipeAttention(torch.nn.Module):
    """A residual attention layer for a PipelineModule."""

    def __init__(self, group=None, sp: int = 1):
        super().__init__()
        self.qkv = torch.nn.Linear(HIDDEN, 3 * HIDDEN)
        self.attn = DistributedAttention(_causal_sdpa, group, scatter_idx=2, gather_idx=1) if sp > 1 else None

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, HEADS, HIDDEN // HEADS).unbind(2)
        ctx = self.attn(q, k, v, 0) if self.attn is not None else _causal_sdpa(q, k, v)
        return x + ctx.reshape(b, s, HIDDEN)


def _pipe_layers(group=None, sp: int = 1):
    torch.manual_seed(0)
    return [torch.nn.Linear(HIDDEN, HIDDEN), _PipeAttention(group, sp), torch.nn.Linear(HIDDEN, HIDDEN),
            _PipeAttention(group, sp), torch.nn.Linear(HIDDEN, HIDDEN)]


def _pipe_batches():
    gen = torch.Generator().manual_seed(2)
    return [[(torch.randn(BATCH, SEQ, HIDDEN, generator=gen), torch.randn(BATCH, SEQ, HIDDEN, generator=gen))
             for _ in range(PIPE_GAS)] for _ in range(PIPE_STEPS)]


def _pipeline_run(groups, mine: slice):
    """pp 2 x sp 2: a PipelineModule whose attention layers are DistributedAttention, each sp rank fed its
    share of the sequence, ZeRO 0-3; (train_batch's losses, the stage's weights) per ZeRO stage."""
    runs = {}
    for stage in STAGES:
        net = PipelineModule(_pipe_layers(groups.sp_group, SP), num_stages=2, partition_method="uniform",
                             loss_fn=lambda out, y: sequence_parallel_loss(F.mse_loss(out.tanh(), y), y.numel()))
        config = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": PIPE_GAS,
                  "sequence_parallel_size": SP, "zero_optimization": {"stage": stage}, "steps_per_print": 1000}
        engine, _, _, _ = lightspeed.initialize(model=net, optimizer=torch.optim.SGD(net.parameters(), lr=LR),
                                                config=config)
        assert (engine.dp_world_size, engine.groups.topology.size("pp")) == (1, 2)
        losses = [float(engine.train_batch(iter([(x[:, mine], y[:, mine]) for x, y in step])))
                  for step in _pipe_batches()]
        runs[stage] = losses, {n: safe_get_full_fp32_param(p).clone() for n, p in net.named_parameters()}
    return runs


def test_pipeline_with_sequence_parallelism_matches_one_process(attention_runs):
    """pp 2 x sp 2 (world 4) at ZeRO 0-3: train_batch's losses and each stage's weights after SGD steps
    equal one process's on the whole sequence and the whole model."""
    model = torch.nn.Sequential(*_pipe_layers())
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    ref_losses = []
    for step in _pipe_batches():
        loss = sum(F.mse_loss(model(x).tanh(), y) for x, y in step) / PIPE_GAS
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss.item())
    ref_state = dict(model.named_parameters())
    held = set()
    for _, _, _, piped in attention_runs[4]:
        assert sorted(piped) == list(STAGES)
        for stage, (losses, state) in piped.items():
            assert losses == pytest.approx(ref_losses, rel=RTOL, abs=ATOL), stage
            for name, value in state.items():
                torch.testing.assert_close(value, ref_state[name].detach(), rtol=RTOL, atol=ATOL,
                                           msg=f"stage {stage} {name}")
            held |= set(state)
    assert held == set(ref_state)


def _ds_worker():
    """tests/deepspeed/deepspeed_sp_worker.py as a module: its model, data and loss."""
    spec = importlib.util.spec_from_file_location("deepspeed_sp_worker", DS_WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def attention_runs():
    return {world: run_world(_attention_worker, world, 3) for world in (2, 4)}


@pytest.mark.parametrize("world", [2, 4])
def test_distributed_attention_matches_single_process(world, attention_runs):
    """sequence_parallel_loss at ZeRO 0-3, sp2 (world 2) and dp2 x sp2 (world 4, the experts ep 2): the
    losses, the reduced gradients and the parameters after SGD steps with an active gradient clip equal one
    process's on the whole sequence (a gradient sp times too large or too small fails all three but the
    loss), the MoE layer's experts and gate included."""
    ref_losses, ref_grads, ref_params = _attention_reference(world // SP, 3)
    held = set()
    for dp_rank, by_stage, _, _ in attention_runs[world]:
        assert sorted(by_stage) == list(STAGES)
        for stage, (losses, grads, params) in by_stage.items():
            assert losses == pytest.approx([step[dp_rank] for step in ref_losses], rel=RTOL, abs=ATOL), stage
            # a rank holds its ep rank's experts (world 4: ep 2) and every other parameter
            assert set(params) <= set(ref_params)
            assert all("deepspeed_experts" in n for n in set(ref_params) - set(params)), stage
            held |= set(params)
            for got, want in zip(grads, ref_grads):
                assert set(got) == set(params)
                for name, value in got.items():
                    torch.testing.assert_close(value, want[name], rtol=RTOL, atol=ATOL, msg=f"stage {stage} {name}")
            for name, value in params.items():
                torch.testing.assert_close(value, ref_params[name], rtol=RTOL, atol=ATOL, msg=f"stage {stage} {name}")
    assert held == set(ref_params)


def test_grad_norms_equal_deepspeed_0_19_8_under_transformers_loss(attention_runs, tmp_path):
    """transformers' sequence-parallel loss on a per-token MLP, sp 2: lightspeed's grad norms at ZeRO 0-3
    equal one process's on the whole sequence at world 2 (sp 2) and world 4 (dp 2 x sp 2), and real
    DeepSpeed 0.19.8's at ZeRO 1-3 at world 2 (its stage 0 keeps no global norm)."""
    ds = _ds_worker()
    for world in (2, 4):
        model, ref = ds.build(), []
        opt = torch.optim.SGD(model.parameters(), lr=ds.LR)
        for step in ds.batches(world // SP):
            (sum(((model(x) - y) ** 2).mean() for x, y in step) / len(step)).backward()
            ref.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), ds.CLIP)))
            opt.step()
            opt.zero_grad()
        assert min(ref) > ds.CLIP  # the clip is active
        for _, _, norms, _ in attention_runs[world]:
            for stage in STAGES:
                assert norms[stage] == pytest.approx(ref, rel=1e-6), (world, stage)
    py = deepspeed_env.python()
    if py is None:
        pytest.skip(deepspeed_env.missing_reason())
    spec = {"world_size": 2, "stages": [1, 2, 3], "result": str(tmp_path / "norms.json")}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    run = subprocess.run([str(py), str(DS_WORKER), str(tmp_path / "spec.json")], capture_output=True, text=True,
                         timeout=240, env=deepspeed_env.worker_env())
    assert run.returncode == 0, run.stderr[-3000:]
    deepspeed_norms = json.loads((tmp_path / "norms.json").read_text())
    lightspeed_norms = attention_runs[2][0][2]
    for stage in (1, 2, 3):
        assert deepspeed_norms[str(stage)] == pytest.approx(lightspeed_norms[stage], rel=1e-6), stage


# ---------------------------------------------------------------- a tiny HF Llama, transformers' way
LLAMA_SEQ = 15  # not a multiple of sp: the adapter pads


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         attn_implementation="sdpa")
    return LlamaForCausalLM(config).float()


def _llama_batches(world: int):
    """One batch per rank (the loader each rank starts from); prompt tokens are -100 in labels, a different
    number per batch, so the ranks' token counts differ."""
    gen = torch.Generator().manual_seed(2)
    batches = []
    for rank in range(world):
        ids = torch.randint(0, 64, (BATCH, LLAMA_SEQ), generator=gen)
        labels = ids.clone()
        labels[:, :3 + 2 * rank] = -100
        # a bool [b, s] tensor is sliced like the others (Ulysses drops the attention mask itself)
        batches.append({"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids, dtype=torch.bool)})
    return batches


def _llama_reference(world: int):
    """sp micro-steps, one optimizer step each: step k averages, over the dp replicas d, the whole-sequence
    loss of the batch of global rank d*sp + k (what the adapter hands the sp groups)."""
    model = _llama()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    batches, dp = _llama_batches(world), world // SP
    losses, grads = [], []
    for k in range(SP):
        per_replica = [model(**batches[d * SP + k]).loss for d in range(dp)]
        (sum(per_replica) / dp).backward()
        losses.append([v.item() for v in per_replica])
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    return losses, grads


def _llama_worker(stage: int, register: bool):
    model = _llama()
    mpu = None
    if register:
        mpu = UlyssesSPAttentionHF.register_with_transformers(
            model_name_or_path=model, core_attn_implementation="sdpa", sequence_parallel_size=SP,
            micro_batch_size=BATCH, seq_length_is_variable=True)
    engine, _, _, _ = lightspeed.initialize(model=model, config=_config(stage), mpu=mpu)
    groups = current_sequence_groups()
    loader = torch.utils.data.DataLoader([_llama_batches(dist.get_world_size())[dist.get_rank()]],
                                         batch_size=None)
    adapter = UlyssesSPDataLoaderAdapter(loader, sp_rank=groups.sp_rank, sp_group=groups.sp_group,
                                         sp_world_size=groups.sp_world_size, device=torch.device("cpu"))
    assert len(adapter) == SP
    losses, grads = [], []
    for batch in adapter:
        assert batch["input_ids"].shape == (BATCH, (LLAMA_SEQ + 1) // SP) and "labels" not in batch
        assert batch["attention_mask"].dtype == torch.bool and batch["attention_mask"].shape == batch["input_ids"].shape
        shift = batch["shift_labels"]
        out = engine(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=shift,
                     shift_labels=shift)
        loss = sequence_parallel_loss(out.loss, (shift != -100).sum())
        engine.backward(loss)
        losses.append(loss.item())
        grads.append({n: safe_get_full_grad(p).clone() for n, p in engine.module.named_parameters()})
        engine.step()
    return groups.dp_rank, losses, grads


# register=False: `sequence_parallel_size` in the config alone registers the model (the sp model transform)
@pytest.mark.parametrize("world, stage, register", [(2, 0, False), (4, 3, True)])
def test_hf_llama_matches_single_process(world, stage, register):
    ref_losses, ref_grads = _llama_reference(world)
    for dp_rank, losses, grads in run_world(_llama_worker, world, stage, register):
        assert losses == pytest.approx([step[dp_rank] for step in ref_losses], rel=RTOL, abs=ATOL)
        for got, want in zip(grads, ref_grads):
            for name, value in want.items():
                torch.testing.assert_close(got[name], value, rtol=RTOL, atol=ATOL, msg=name)


# ---------------------------------------------------------------- sizes that do not fit
def _bad_world_worker():
    with pytest.raises(ConfigError, match=r"sequence_parallel_size=3 does not divide the world size 2"):
        lightspeed.initialize(model=torch.nn.Linear(2, 2), config=_config(0, sequence_parallel_size=3))
    return True


def _bad_heads_worker():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=16, hidden_size=24, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=3, num_key_value_heads=3, attn_implementation="sdpa")
    with pytest.raises(ValueError, match=r"sequence_parallel_size=2 does not divide the model's 3 attention heads"):
        lightspeed.initialize(model=LlamaForCausalLM(config), config=_config(0))
    with pytest.raises(ValueError, match="sequence_parallel_size=2 does not divide the model's 3 attention heads"):
        UlyssesSPAttentionHF.register_with_transformers(LlamaForCausalLM(config), "sdpa", 2, micro_batch_size=1)
    groups = initialize_sequence_parallel(SP)
    with pytest.raises(ValueError, match="not divisible by the sequence-parallel size 2"):
        DistributedAttention(_causal_sdpa, groups.sp_group)(*(torch.ones(4, 1, 3, 2) for _ in range(3)))
    with pytest.raises(ValueError, match="already built with size 2"):
        initialize_sequence_parallel(1)
    return True


def _refusals_worker():
    return _bad_world_worker(), _bad_heads_worker(), _adapter_errors_worker()


def test_sizes_that_do_not_fit_and_bad_batches_are_refused_naming_the_key():
    """Sizes that do not fit (the world, the heads) and the data loader adapter's errors, one world."""
    assert run_world(_refusals_worker, 2) == [(True, True, True)] * 2


def test_one_process_cannot_be_sequence_parallel():
    with pytest.raises(RuntimeError, match="sequence_parallel_size=2 needs torch.distributed"):
        lightspeed.initialize(model=torch.nn.Linear(2, 2), config=_config(0), dist_init_required=False)


def _adapter_errors_worker():
    groups = initialize_sequence_parallel(SP)
    loader = [{"input_ids": torch.ones(1, 3, dtype=torch.long), "labels": torch.ones(1, 3, dtype=torch.long)}]
    strict = UlyssesSPDataLoaderAdapter(loader, groups.sp_rank, groups.sp_group, SP, "cpu", pad_to_sp_multiple=False)
    with pytest.raises(ValueError, match="sequence length 3 is not divisible by sequence_parallel_size=2"):
        next(strict)
    no_labels = UlyssesSPDataLoaderAdapter([{"input_ids": torch.ones(1, 4, dtype=torch.long)}], groups.sp_rank,
                                           groups.sp_group, SP, "cpu")
    with pytest.raises(ValueError, match="need `labels`"):
        next(no_labels)
    # a one-bit optimizer averages its compressed momentum over dp x sp, where stage 0 sums the sp ranks
    with pytest.raises(NotImplementedError, match="sequence_parallel_size=2 with OneBitAdam"):
        lightspeed.initialize(model=torch.nn.Linear(2, 2), config=_config(
            0, optimizer={"type": "OneBitAdam", "params": {"lr": 1e-3, "freeze_step": 2}}))
    # no engine yet (every initialize() above was refused): the loss cannot know how gradients are combined
    with pytest.raises(RuntimeError, match="no engine with sequence_parallel_size > 1 was initialized"):
        sequence_parallel_loss(torch.ones(()), 3)
    return True






# ---------------------------------------------------------------- checkpoints under sp: shards per dp x sp rank
def _checkpoint_worker(stage: int, save_dir: str):
    torch.manual_seed(0)
    groups = initialize_sequence_parallel(SP)
    chunk = SEQ // SP
    mine = slice(groups.sp_rank * chunk, (groups.sp_rank + 1) * chunk)

    def step(engine, batches):
        x, y = batches[groups.dp_rank]
        loss = sequence_parallel_loss(engine(x[:, mine], y[:, mine]), y[:, mine].numel())
        engine.backward(loss)
        engine.step()
        return loss.item()

    data = _attention_batches(dist.get_world_size() // SP, 3)
    engine, _, _, _ = lightspeed.initialize(model=AttentionBlock(groups.sp_group, SP), config=_config(stage))
    step(engine, data[0])
    engine.save_checkpoint(save_dir, tag="one")
    expected = [step(engine, batches) for batches in data[1:]]
    torch.manual_seed(1)  # different initial weights: the load must bring the saved ones
    fresh, _, _, _ = lightspeed.initialize(model=AttentionBlock(groups.sp_group, SP), config=_config(stage))
    fresh.load_checkpoint(save_dir, tag="one")
    return expected, [step(fresh, batches) for batches in data[1:]]


@pytest.mark.parametrize("stage", [2])
def test_checkpoint_resumes_under_sequence_parallelism(stage, tmp_path):
    for expected, resumed in run_world(_checkpoint_worker, 4, stage, str(tmp_path)):
        assert resumed == pytest.approx(expected, rel=1e-6, abs=1e-7)
