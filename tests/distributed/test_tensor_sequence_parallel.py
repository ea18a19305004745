"""Tensor parallelism (AutoTP training) together with Ulysses sequence parallelism, on real gloo processes:
world 4 as tp2 x sp2, a tiny HF Llama with grouped-query attention (8 heads, 4 key/value heads: 4 and 2 per
tp rank, 2 and 1 per rank after the all-to-all), in one world: ZeRO stages 0, 1 and 3 from the config alone,
stage 2 the way transformers calls it (tp_model_init, register_with_transformers, initialize(mpu=...)).
The groups must follow the mesh (tp {0,1},{2,3}; sp {0,2},{1,3}, the record too), and each step's loss,
the global gradient norm (clipping acts), the first step's gradients gathered from the tp slices and the
final parameters must match one process on the whole sequence in fp32 within 1e-5. A consecutive record
built before the split is refused, naming the key."""

from __future__ import annotations

import pytest
import torch

from lightspeed.testing.run_world import run_world
from tests.distributed.test_tensor_parallel_training import _gather, reference_run
from tests.distributed.test_topology import _members

transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

TP, SP, STEPS, BATCH, SEQ, VOCAB = 2, 2, 3, 2, 16, 64
LR, CLIP = 1e-2, 0.5
STAGES = (0, 1, 2, 3)


def _llama() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=SEQ, attn_implementation="sdpa")).float()


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input_ids, labels) per step; a different number of leading prompt tokens (-100) each step, so the sp
    ranks count different numbers of tokens."""
    gen = torch.Generator().manual_seed(3)
    out = []
    for step in range(STEPS):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        labels = ids.clone()
        labels[:, :2 + 3 * step] = -100
        out.append((ids, labels))
    return out


def _reference():
    return reference_run(_llama(), _batches(), lambda model, b: model(input_ids=b[0], labels=b[1]).loss, CLIP, LR)


def _config(stage: int) -> dict:
    # the micro batch alone: DeepSpeed's triad counts the tp ranks too (train_batch_size = micro x dp x tp)
    return {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1, "sequence_parallel_size": SP,
            "tensor_parallel": {"autotp_size": TP}, "zero_optimization": {"stage": stage},
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.99], "eps": 1e-8,
                                                      "weight_decay": 0.01}},
            "gradient_clipping": CLIP, "steps_per_print": 1000}


def _record_members(record) -> list[int]:
    import torch.distributed as dist

    gathered = [None] * record.sp_world_size
    dist.all_gather_object(gathered, dist.get_rank(), group=record.sp_group)
    return gathered


def _train(stage: int, register: bool):
    """`register`: transformers' order, tp_model_init then register_with_transformers on the split model and
    initialize(mpu=...); else the config alone (initialize's transforms split and register the model)."""
    import lightspeed
    from lightspeed.comm.sequence_groups import current_sequence_groups
    from lightspeed.sequence import UlyssesSPAttentionHF, sequence_parallel_loss
    from lightspeed.zero.param_access import safe_get_full_grad

    model, mpu = _llama(), None
    if register:
        model = lightspeed.tp_model_init(model, tp_size=TP, dtype=torch.float32, config=_config(stage))
        mpu = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", SP, micro_batch_size=BATCH)
    engine = lightspeed.initialize(model=model, config=_config(stage), mpu=mpu)[0]
    topology, record = engine.groups.topology, current_sequence_groups()
    layout = {name: _members(topology, name) for name in ("tp", "sp", "dp_sp")}
    layout["record"] = (_record_members(record), list(record.sp_ranks), record.sp_rank, record.seq_dp_world_size)
    chunk = SEQ // SP
    mine = slice(record.sp_rank * chunk, (record.sp_rank + 1) * chunk)
    positions = torch.arange(SEQ)[mine].expand(BATCH, -1)
    losses, norms, grads = [], [], None
    for ids, labels in _batches():
        shift = torch.cat([labels[:, 1:], torch.full((BATCH, 1), -100)], dim=1)[:, mine].contiguous()
        out = engine(input_ids=ids[:, mine], position_ids=positions, labels=shift, shift_labels=shift)
        loss = sequence_parallel_loss(out.loss, (shift != -100).sum())
        engine.backward(loss)
        if grads is None:
            grads = _gather(engine, {n: safe_get_full_grad(p).clone() for n, p in engine.module.named_parameters()})
        engine.step()
        losses.append(loss.item())
        norms.append(float(engine.get_global_grad_norm()))
    state = _gather(engine, {k: v.detach().float().clone() for k, v in engine.strategy.module_state_dict().items()})
    UlyssesSPAttentionHF.unregister_from_transformers()  # the next engine's model registers its own modules
    return layout, (losses, norms, grads, state)


def _refused() -> str:
    """A record built before initialize() as DeepSpeed's consecutive runs ({0,1},{2,3}) on a model not split
    yet cannot serve tp x sp, whose sp groups are strided by tp."""
    import lightspeed
    from lightspeed.comm.sequence_groups import destroy_sequence_parallel, initialize_sequence_parallel

    destroy_sequence_parallel()
    initialize_sequence_parallel(SP)
    try:
        lightspeed.initialize(model=_llama(), config=_config(1))
    except Exception as error:  # noqa: BLE001 (the test reads the message)
        return f"{type(error).__name__}: {error}"
    finally:
        destroy_sequence_parallel()
    return "accepted"


def _world():
    # one world for the stages (one start-up): 0, 1 and 3 by the config alone, stage 2 transformers' way
    trained = {stage: _train(stage, register=stage == 2) for stage in STAGES}
    return trained, _refused()


def test_tp2_sp2_llama_matches_single_process():
    ref_losses, ref_norms, ref_grads, ref_state = _reference()
    assert ref_norms[0] > CLIP  # the clip acts: the global norm steers the step
    for rank, (results, refused) in enumerate(run_world(_world, 4)):
        tp_rank, sp_rank = rank % TP, rank // TP
        assert refused.startswith("ConfigError: sequence_parallel_size=2 with tensor_parallel.autotp_size=2") and \
            f"must be the mesh's, ranks {[tp_rank, tp_rank + TP]}" in refused, refused
        for stage, (layout, (losses, norms, grads, state)) in results.items():
            assert layout["tp"] == [rank - tp_rank, rank - tp_rank + 1]
            assert layout["sp"] == layout["dp_sp"] == [tp_rank, tp_rank + TP]
            assert layout["record"] == ([tp_rank, tp_rank + TP], [tp_rank, tp_rank + TP], sp_rank, SP)
            assert losses == pytest.approx(ref_losses, rel=1e-5), stage
            assert norms == pytest.approx(ref_norms, rel=1e-5), stage
            for name, grad in ref_grads.items():
                torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"stage {stage} grad {name}: {m}")
            for name, value in ref_state.items():
                # AdamW moves a parameter by about lr whatever its gradient's size (see the tensor-parallel test)
                torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-4,
                                           msg=lambda m: f"stage {stage} {name}: {m}")
