"""DeepSpeed's module-level comm functions (lightspeed.comm / deepspeed.comm) against torch.distributed,
and the engine calls accelerate and transformers make: no_sync, the optimizer's `overflow`,
zero_gather_16bit_weights_on_model_save and _zero3_consolidated_16bit_state_dict; a two-stage pipeline
whose activations change shape after `reset_activation_shape`. One world of 2 gloo
ranks runs every scenario and returns plain data; the tests assert on it."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist

import lightspeed
from lightspeed.compat.deepspeed import initialize as ds_initialize
from lightspeed.testing.models import TinyMLP, regression_data
from lightspeed.testing.run_world import run_world

pytestmark = pytest.mark.dist

WORLD, MICRO, LR = 2, 2, 0.1


def _comm() -> dict:
    from lightspeed import comm

    rank, out = dist.get_rank(), {}
    out["ids"] = (comm.is_initialized(), comm.get_rank(), comm.get_world_size(), comm.get_local_rank(),
                  comm.get_backend())
    t = torch.tensor([rank + 1.0, 10.0 * rank])
    comm.all_reduce(t)
    out["all_reduce_sum"] = t.tolist()
    t = torch.tensor([rank + 1.0])
    comm.all_reduce(t, op=comm.ReduceOp.MAX)
    out["all_reduce_max"] = t.item()
    t = torch.tensor([float(rank)])
    comm.inference_all_reduce(t)
    out["inference_all_reduce"] = t.item()
    parts = [torch.zeros(2) for _ in range(WORLD)]
    comm.all_gather(parts, torch.full((2,), float(rank)))
    out["all_gather"] = [p.tolist() for p in parts]
    with warnings.catch_warnings(record=True) as caught:  # torch 2.13's deprecation: the new names are picked
        warnings.simplefilter("always")
        gathered = torch.zeros(2 * WORLD)
        comm.all_gather_into_tensor(gathered, torch.tensor([rank, rank + 0.5]))
        shard = torch.zeros(2)
        comm.reduce_scatter_tensor(shard, torch.arange(4.0) * (rank + 1))
        handle = comm.all_gather_into_tensor(torch.zeros(2 * WORLD), torch.ones(2), async_op=True)
        handle.wait()
    out["all_gather_into_tensor"] = gathered.tolist()
    out["reduce_scatter_tensor"] = shard.tolist()
    out["future_warnings"] = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
    t = torch.tensor([float(rank * 7 + 1)])
    comm.broadcast(t, src=1)
    out["broadcast"] = t.item()
    if rank == 0:
        comm.send(torch.tensor([42.0]), dst=1)
        out["recv"] = None
    else:
        got = torch.zeros(1)
        comm.recv(got, src=0)
        out["recv"] = got.item()
    group = comm.new_group([0, 1])
    t = torch.ones(1)
    comm.all_reduce(t, group=group)
    out["group_all_reduce"] = t.item()
    # DeepSpeed's coalesced, batched point-to-point and monitored-barrier functions
    pair = [torch.tensor([rank + 1.0]), torch.tensor([2.0 * rank, 1.0])]
    comm.all_reduce_coalesced(pair)
    out["all_reduce_coalesced"] = [t.tolist() for t in pair]
    gathered = [torch.zeros(WORLD), torch.zeros(2 * WORLD)]
    comm.all_gather_coalesced(gathered, [torch.tensor([float(rank)]), torch.tensor([rank, rank + 0.5])],
                              async_op=True).wait()
    out["all_gather_coalesced"] = [t.tolist() for t in gathered]
    got = torch.zeros(1)
    for request in comm.batch_isend_irecv([comm.P2POp(comm.isend, torch.tensor([10.0 + rank]), 1 - rank),
                                           comm.P2POp(comm.irecv, got, 1 - rank)]):
        request.wait()
    out["batch_isend_irecv"] = got.item()
    comm.monitored_barrier()
    out["groups"] = (comm.get_world_group() is dist.group.WORLD, comm.get_all_ranks_from_group(group),
                     comm.get_all_ranks_from_group())
    comm.barrier()
    comm.configure(enabled=True, prof_all=True)  # the comms logger times the runtime's collectives
    out["log_summary"] = comm.log_summary(return_dict=True)
    comm.configure(enabled=False)
    # the same functions under DeepSpeed's name
    from lightspeed.compat.deepspeed import comm as ds_comm

    out["ds_comm_same"] = ds_comm.all_reduce is comm.all_reduce and ds_comm.get_rank() == rank
    # DeepSpeed's gradient helpers with an expert parameter whose gradient differs per rank
    from lightspeed.comm.topology import record_topology
    from lightspeed.compat.deepspeed.runtime import utils as ds_utils
    from lightspeed.compat.deepspeed.utils import groups

    groups._create_expert_and_data_parallel(2)
    dense, expert = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    dense.grad, expert.grad, expert.allreduce = torch.tensor([3.0]), torch.tensor([rank + 1.0]), False
    out["clip_norm"] = ds_utils.clip_grad_norm_([dense, expert], max_norm=0.1).item()
    out["clipped"] = dense.grad.item()
    expert.grad = torch.tensor([float("inf") if rank == 1 else 1.0])
    out["overflow"] = ds_utils.CheckOverflow([[dense, expert]]).check()
    record_topology(None)
    return out


def _config(stage: int, **extra) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
           "steps_per_print": float("inf"),  # what accelerate writes: never log
           "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
           "gradient_clipping": 0.0}  # the references do not clip (DeepSpeed's default does)
    cfg.update(extra)
    return cfg


def _batches():
    x, y = regression_data(4 * MICRO)
    rank = dist.get_rank()
    first = slice(rank * MICRO, (rank + 1) * MICRO)
    second = slice(WORLD * MICRO + rank * MICRO, WORLD * MICRO + (rank + 1) * MICRO)
    return (x[first], y[first]), (x[second], y[second])


def _no_sync(stage: int) -> dict:
    """Micro-batch A under no_sync at a boundary (GAS 1: every micro-step is one), then B outside."""
    from lightspeed.utils import safe_get_full_grad

    model = TinyMLP()
    plain = copy.deepcopy(model)
    engine, *_ = lightspeed.initialize(model=model, config=_config(stage),
                                       optimizer=lambda ps: torch.optim.SGD([p for p in ps if p.requires_grad], lr=LR))
    (xa, ya), (xb, yb) = _batches()
    plain(xa, ya).backward()  # this rank's own gradient of A: what the gradient reads inside no_sync give
    out = {"local_grads": {n: p.grad.clone() for n, p in plain.named_parameters() if p.grad is not None}}
    with engine.no_sync():
        before = engine.comm.stats.total_bytes()
        engine.backward(engine(xa, ya))
        params = dict(engine.module.named_parameters())
        out["grads_inside"] = {n: safe_get_full_grad(params[n]).clone() for n in out["local_grads"]}
        out["bytes_inside"] = engine.comm.stats.total_bytes() - before
        try:
            engine.step()
        except RuntimeError as e:
            out["step_inside"] = str(e)
        try:
            with engine.no_sync():
                pass
        except RuntimeError as e:
            out["reentry"] = str(e)
    before = engine.comm.stats.total_bytes()
    engine.backward(engine(xb, yb))
    engine.step()
    out["bytes_outside"] = engine.comm.stats.total_bytes() - before
    out["params"] = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    return out


def _engine_calls() -> dict:
    out = {"no_sync": {0: _no_sync(0), 1: _no_sync(1)}}
    engine, *_ = lightspeed.initialize(model=TinyMLP(), config=_config(2, optimizer={"type": "Adam",
                                                                                    "params": {"lr": 0.01}}))
    try:
        with engine.no_sync():
            pass
    except RuntimeError as e:
        out["no_sync_stage2"] = str(e)
    out["gather_flag_stage2"] = engine.zero_gather_16bit_weights_on_model_save()
    try:
        engine._zero3_consolidated_16bit_state_dict()
    except ValueError as e:
        out["consolidated_stage2"] = str(e)
    out["config_get"] = (engine.config.get("zero_optimization", {}).get("stage"), engine.config.get("fp16", {}))

    # fp16: an inf loss overflows, the step is skipped, and deepspeed.initialize's optimizer says so
    engine, optimizer, _, _ = ds_initialize(model=TinyMLP(), config=_config(
        0, fp16={"enabled": True, "initial_scale_power": 4}, optimizer={"type": "Adam", "params": {"lr": 0.01}}))
    (xa, ya), _ = _batches()
    out["overflow_before"] = optimizer.overflow
    engine.backward(engine(xa.half(), ya) * float("inf"))
    engine.step()
    out["overflow_after_inf"] = (optimizer.overflow, engine.skipped_steps)
    engine.backward(engine(xa.half(), ya))
    engine.step()
    out["overflow_after_finite"] = optimizer.overflow
    # fp16: DeepSpeed's engine.optimizer is its wrapper, what initialize returned, whose .optimizer is the base
    out["optimizer_view"] = (isinstance(optimizer, torch.optim.Optimizer), optimizer is engine.optimizer,
                             optimizer.param_groups is engine.optimizer.optimizer.param_groups)

    # ZeRO-3: the consolidated 16-bit state dict on rank 0 only, equal to the module's full state
    model = TinyMLP()
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = _config(3, bf16={"enabled": True}, optimizer={"type": "Adam", "params": {"lr": 0.01}},
                  zero_optimization={"stage": 3, "stage3_gather_16bit_weights_on_model_save": True})
    engine, *_ = lightspeed.initialize(model=model, config=cfg)
    out["gather_flag_stage3"] = engine.zero_gather_16bit_weights_on_model_save()
    state = engine._zero3_consolidated_16bit_state_dict()
    frozen = engine._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=True)
    out["consolidated"] = None if state is None else {
        "keys": sorted(state), "frozen_excluded": sorted(set(state) - set(frozen)),
        "dtypes": sorted({str(v.dtype) for v in state.values()}), "devices": sorted({v.device.type for v in state.values()}),
        "equal": all(torch.equal(state[k], reference[k].to(state[k].dtype)) for k in reference),
    }
    return out


def _pipeline_shapes() -> dict:
    """Two stages, one per rank (lr 0): a batch of [2, 6] activations, then reset_activation_shape and a
    batch of [2, 4, 6]; the losses against the whole model, gathered from both stages."""
    from lightspeed.parallel.pipeline import LayerSpec, PipelineModule

    torch.manual_seed(0)
    pipe = PipelineModule(layers=[LayerSpec(torch.nn.Linear, 6, 6), LayerSpec(torch.nn.Linear, 6, 3)], num_stages=2,
                          loss_fn=torch.nn.MSELoss())
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 10**9,
           "optimizer": {"type": "SGD", "params": {"lr": 0.0}}}
    engine, *_ = lightspeed.initialize(model=pipe, config=cfg, model_parameters=pipe.parameters())
    g = torch.Generator().manual_seed(1)
    short = [(torch.randn(2, 6, generator=g), torch.randn(2, 3, generator=g)) for _ in range(2)]
    long = [(torch.randn(2, 4, 6, generator=g), torch.randn(2, 4, 3, generator=g)) for _ in range(2)]
    losses = [float(engine.train_batch(iter(short)))]
    engine.reset_activation_shape()
    losses.append(float(engine.train_batch(iter(long))))
    parts = [None] * WORLD
    dist.all_gather_object(parts, {k: v.detach().clone() for k, v in pipe.state_dict().items()})
    whole = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Linear(6, 3))
    whole.load_state_dict({k: v for part in parts for k, v in part.items()})
    with torch.no_grad():
        want = [float(sum(torch.nn.functional.mse_loss(whole(x), y) for x, y in batch) / 2) for batch in (short, long)]
    return {"losses": losses, "want": want}


def _world() -> dict:
    return {"comm": _comm(), "engine": _engine_calls(), "pipeline": _pipeline_shapes()}


@pytest.fixture(scope="module")
def world():
    return run_world(_world, WORLD, timeout=240)


def test_comm_functions_match_torch_distributed(world):
    for rank, out in enumerate(world):
        c = out["comm"]
        assert c["ids"] == (True, rank, WORLD, rank, "gloo")
        assert c["all_reduce_sum"] == [3.0, 10.0] and c["all_reduce_max"] == 2.0 and c["inference_all_reduce"] == 1.0
        assert c["all_gather"] == [[0.0, 0.0], [1.0, 1.0]]
        assert c["all_gather_into_tensor"] == [0.0, 0.5, 1.0, 1.5]
        # sum over ranks of arange(4) * (rank + 1) = [0, 3, 6, 9]; rank r keeps elements [2r, 2r + 2)
        assert c["reduce_scatter_tensor"] == [[0.0, 3.0], [6.0, 9.0]][rank]
        assert c["future_warnings"] == []
        assert c["broadcast"] == 8.0 and c["group_all_reduce"] == 2.0
        assert c["recv"] == (42.0 if rank == 1 else None)
        assert c["all_reduce_coalesced"] == [[3.0], [2.0, 2.0]]
        assert c["all_gather_coalesced"] == [[0.0, 1.0], [0.0, 0.5, 1.0, 1.5]]
        assert c["batch_isend_irecv"] == 10.0 + (1 - rank) and c["groups"] == (True, [0, 1], [0, 1])
        assert isinstance(c["log_summary"], dict)
        assert c["ds_comm_same"]
        # the norm averaged over the data-parallel ranks: (sqrt(9 + 1) + sqrt(9 + 4)) / 2, one coefficient
        norm = (10 ** 0.5 + 13 ** 0.5) / 2
        assert c["clip_norm"] == pytest.approx(norm, rel=1e-6) and c["clipped"] == pytest.approx(3 * 0.1 / (norm + 1e-6))
        assert c["overflow"] is True  # rank 1's expert inf, agreed over the expert-parallel group


def test_call_to_str():
    from lightspeed.compat.deepspeed.runtime.utils import call_to_str

    assert call_to_str("int") == "int()" and call_to_str("hello", 1138, val=3) == "hello(1138, val=3)"


def _reference_no_sync_params() -> dict:
    """SGD on the mean over ranks of (grad of micro-batch A + grad of micro-batch B)."""
    model = TinyMLP()
    x, y = regression_data(4 * MICRO)
    for rank in range(WORLD):
        for start in (rank * MICRO, WORLD * MICRO + rank * MICRO):
            (model(x[start:start + MICRO], y[start:start + MICRO]) / WORLD).backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= LR * p.grad
    return model.state_dict()


@pytest.mark.parametrize("stage", [0, 1])
def test_no_sync_accumulates_without_reducing(world, stage):
    expected = _reference_no_sync_params()
    for out in world:
        run = out["engine"]["no_sync"][stage]
        assert run["bytes_inside"] == 0 and run["bytes_outside"] > 0
        assert "inside no_sync context manager" in run["step_inside"] and "not re-entrant" in run["reentry"]
        assert run["grads_inside"].keys() == run["local_grads"].keys() and run["local_grads"]
        for name, local in run["local_grads"].items():  # unreduced, also read through safe_*
            torch.testing.assert_close(run["grads_inside"][name], local, rtol=1e-5, atol=1e-6)
        for k, v in expected.items():
            torch.testing.assert_close(run["params"][k], v, rtol=1e-5, atol=1e-6)


def test_no_sync_is_refused_with_partitioned_gradients(world):
    for out in world:
        assert "incompatible with gradient partitioning logic of ZeRO stage 2" in out["engine"]["no_sync_stage2"]


def test_overflow_of_the_optimizer_deepspeed_initialize_returns(world):
    for out in world:
        e = out["engine"]
        assert e["overflow_before"] is False
        assert e["overflow_after_inf"] == (True, 1)
        assert e["overflow_after_finite"] is False
        assert e["optimizer_view"] == (True, True, True)


def test_16bit_weights_for_saving(world):
    for rank, out in enumerate(world):
        e = out["engine"]
        assert e["gather_flag_stage2"] is False and e["gather_flag_stage3"] is True
        assert "requires ZeRO stage 3" in e["consolidated_stage2"]
        assert e["config_get"] == (2, {})
        if rank != 0:
            assert e["consolidated"] is None
            continue
        c = e["consolidated"]
        assert c["keys"] == sorted(TinyMLP().state_dict()) and c["frozen_excluded"] == ["frozen"]
        assert c["dtypes"] == ["torch.bfloat16"] and c["devices"] == ["cpu"] and c["equal"]


def test_pipeline_activation_shape_reset(world):
    for out in world:
        assert out["pipeline"]["losses"] == pytest.approx(out["pipeline"]["want"], rel=1e-5)
