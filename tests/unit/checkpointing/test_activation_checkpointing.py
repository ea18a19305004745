"""lightspeed.checkpointing in one process: checkpointed equals plain (losses and gradients, dropout
included), outputs and errors as DeepSpeed's, the RNG tracker, configure() and the config block,
what a checkpoint keeps (saved-tensor bytes), contiguous buffers, and the ZeRO-3 trace under
recomputation."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

import lightspeed
from lightspeed import checkpointing
from lightspeed.checkpointing import settings
from lightspeed.config.errors import ConfigError
from lightspeed.testing.checkpointed_models import CheckpointedNet

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def fresh_settings():
    settings.SETTINGS.__init__()
    checkpointing.get_cuda_rng_tracker().reset()
    yield
    settings.SETTINGS.__init__()
    checkpointing.get_cuda_rng_tracker().reset()


def _data(seed=1, n=4, dim=8):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, dim, generator=g), torch.randn(n, 1, generator=g)


def _loss_and_grads(mode, steps=1, tracked=True):
    model = CheckpointedNet(mode, tracked=tracked)
    checkpointing.model_parallel_cuda_manual_seed(123)
    losses = []
    for s in range(steps):
        x, y = _data(s)
        loss = model(x, y)
        loss.backward()
        losses.append(loss.detach())
    return losses, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant", "torch", "torch_non_reentrant"])
def test_checkpointed_equals_plain_with_dropout(mode):
    tracked = not mode.startswith("torch")  # torch.utils.checkpoint does not replay the tracker's stream
    plain_losses, plain_grads = _loss_and_grads("plain", steps=2, tracked=tracked)
    losses, grads = _loss_and_grads(mode, steps=2, tracked=tracked)
    assert torch.equal(torch.stack(losses), torch.stack(plain_losses))
    for name, g in plain_grads.items():
        assert torch.equal(grads[name], g), name
    # the dropout masks really differ between steps and streams, so replaying them is what made this equal
    assert not torch.equal(plain_losses[0], plain_losses[1])


def test_torch_checkpoint_does_not_replay_the_tracker():
    """Why DeepSpeed has its own checkpoint: torch.utils.checkpoint reruns a tracker fork from the
    advanced state, so the gradients (and the next step) differ from the plain model's."""
    plain_losses, _ = _loss_and_grads("plain", steps=2)
    losses, _ = _loss_and_grads("torch", steps=2)
    assert not torch.equal(torch.stack(losses), torch.stack(plain_losses))


def test_without_rng_replay_the_recomputation_would_differ():
    """A control: rerunning the block from a different generator state gives other gradients."""
    checkpointing.model_parallel_cuda_manual_seed(123)
    block = CheckpointedNet().blocks[0]
    x = torch.randn(4, 8, requires_grad=True)
    out = checkpointing.checkpoint(block, x)
    torch.manual_seed(999)  # moves the host generator: the snapshot, not the current state, must be replayed
    out.sum().backward()
    replayed = x.grad.clone()
    x.grad = None
    snapshot = torch.get_rng_state()
    block(x).sum().backward()  # plain, from another state
    torch.set_rng_state(snapshot)
    assert not torch.equal(replayed, x.grad)


def test_outputs_follow_deepspeed():
    lin = torch.nn.Linear(3, 3)
    x = torch.randn(2, 3, requires_grad=True)
    single = checkpointing.checkpoint(lin, x)
    assert torch.is_tensor(single) and single.requires_grad
    assert torch.is_tensor(checkpointing.checkpoint(lambda t: (lin(t),), x))  # one element: the element
    out, flag, idx = checkpointing.checkpoint(lambda t: (lin(t), "tag", t.argmax(-1)), x)
    assert flag == "tag" and not idx.requires_grad and idx.dtype == torch.long
    (out.sum() * 2).backward()
    expected = torch.autograd.grad((lin(x).sum() * 2), x)[0]
    assert torch.allclose(x.grad, expected)
    with pytest.raises(TypeError, match="tensor or a tuple"):
        checkpointing.checkpoint(lambda t: {"a": t}, x)
    x.grad = None
    same = checkpointing.checkpoint(lambda t: t, x)  # an input returned as is still carries the gradient
    (same * 3).sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 3.0))
    all_outputs = []  # DeepSpeed's signature, called directly
    tensors = checkpointing.CheckpointFunction.apply(lambda t: (lin(t), 7), all_outputs, x)
    assert len(tensors) == 1 and all_outputs[1] == 7 and torch.is_tensor(all_outputs[0])


def test_a_second_backward_through_a_checkpoint_is_refused():
    x = torch.randn(2, 3, requires_grad=True)
    out = checkpointing.checkpoint(torch.nn.Linear(3, 3), x).sum()
    out.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        out.backward()


def test_reentrant_refuses_autograd_grad_and_non_reentrant_allows_it():
    lin = torch.nn.Linear(3, 3)
    x = torch.randn(2, 3, requires_grad=True)
    with pytest.raises(RuntimeError, match="torch.autograd.grad"):
        torch.autograd.grad(checkpointing.checkpoint(lin, x).sum(), x)
    grad = torch.autograd.grad(checkpointing.non_reentrant_checkpoint(lin, x).sum(), x)[0]
    assert torch.allclose(grad, torch.autograd.grad(lin(x).sum(), x)[0])


def test_non_reentrant_reaches_parameters_when_no_input_needs_grad():
    lin = torch.nn.Linear(3, 3)
    x = torch.randn(2, 3)
    checkpointing.non_reentrant_checkpoint(lin, x).sum().backward()
    assert lin.weight.grad is not None and torch.allclose(lin.weight.grad, x.sum(0).expand(3, 3))


# ---------------------------------------------------------------------------------------------- RNG
def test_rng_tracker_fork_add_states():
    tracker = checkpointing.CudaRNGStatesTracker()
    tracker.add("a", 7)
    with pytest.raises(ValueError, match="seed 7"):
        tracker.add("b", 7)
    with pytest.raises(ValueError, match="'a'"):
        tracker.add("a", 8)
    with pytest.raises(KeyError, match="'zzz'"):
        with tracker.fork("zzz"):
            pass
    outside = torch.get_rng_state()
    with tracker.fork("a"):
        first = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), outside)  # the default stream did not move
    assert torch.equal(first, torch.rand(4, generator=torch.Generator().manual_seed(7)))
    snapshot = tracker.get_states()
    with tracker.fork("a"):
        second = torch.rand(4)
    assert not torch.equal(first, second)
    tracker.set_states(snapshot)
    with tracker.fork("a"):
        assert torch.equal(torch.rand(4), second)


class _Mpu:
    """Megatron-style mpu of one process, claiming tensor-parallel rank `rank` of `size`."""

    def __init__(self, rank=1, size=2, group=None):
        self.rank, self.size, self.group = rank, size, group

    def get_tensor_model_parallel_rank(self):
        return self.rank

    def get_tensor_model_parallel_world_size(self):
        return self.size

    def get_tensor_model_parallel_group(self):
        return self.group

    def get_data_parallel_rank(self):
        return 0

    def get_data_parallel_world_size(self):
        return 1


def test_model_parallel_seed_uses_the_tensor_parallel_rank():
    checkpointing.configure(_Mpu(rank=1))
    checkpointing.model_parallel_cuda_manual_seed(10)
    assert torch.equal(torch.rand(3), torch.rand(3, generator=torch.Generator().manual_seed(10)))
    with checkpointing.get_cuda_rng_tracker().fork():
        tracked = torch.rand(3)
    assert torch.equal(tracked, torch.rand(3, generator=torch.Generator().manual_seed(10 + 2718 + 1)))


# ---------------------------------------------------------------------------------------------- configure
def test_configure_reads_the_block_then_the_arguments():
    assert not checkpointing.is_configured()
    cfg = {"train_batch_size": 2, "activation_checkpointing": {"cpu_checkpointing": True, "profile": True,
                                                               "number_checkpoints": 4}}
    checkpointing.configure(None, deepspeed_config=cfg, profile=False, synchronize=True)
    o = settings.SETTINGS.options
    assert checkpointing.is_configured()
    assert (o.cpu_checkpointing, o.profile, o.synchronize_checkpoint_boundary, o.number_checkpoints) == (True, False,
                                                                                                       True, 4)
    mpu = _Mpu(rank=0, size=1)
    checkpointing.configure(mpu, partition_activations=True)  # starts from the defaults again
    o = settings.SETTINGS.options
    assert (o.partition_activations, o.cpu_checkpointing, o.number_checkpoints) == (True, False, None)
    checkpointing.configure(None)  # None keeps the mpu given before
    assert settings.SETTINGS.mpu is mpu and settings.SETTINGS.model_parallel.size == 1


def test_configure_from_a_file_and_bad_combinations(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"train_batch_size": 4, "activation_checkpointing": {"partition_activations": true}}')
    checkpointing.configure(None, deepspeed_config=str(path))
    assert settings.SETTINGS.options.partition_activations
    with pytest.raises(ConfigError, match="contiguous_memory_optimization needs activation_checkpointing.partition"):
        checkpointing.configure(None, contiguous_checkpointing=True)
    with pytest.raises(ConfigError, match="needs activation_checkpointing.number_checkpoints"):
        checkpointing.configure(None, partition_activations=True, contiguous_checkpointing=True)
    with pytest.raises(ConfigError, match="number_checkpoints"):
        checkpointing.configure(None, deepspeed_config={"activation_checkpointing": {"number_checkpoints": 0}})
    with pytest.raises(ConfigError, match="contiguous_memory_optimization: needs activation_checkpointing.partition"):
        lightspeed.config.load({"train_batch_size": 1, "activation_checkpointing": {
            "contiguous_memory_optimization": True, "number_checkpoints": 2}})
    with pytest.raises(TypeError, match="get_model_parallel_rank"):
        checkpointing.configure(object())


@pytest.mark.parametrize("options", [dict(checkpoint_in_cpu=True), dict(partition_activations=True),
                                     dict(partition_activations=True, checkpoint_in_cpu=True),
                                     dict(partition_activations=True, contiguous_checkpointing=True,
                                          num_checkpoints=3)])
def test_kept_inputs_give_the_same_gradients(options):
    """At world size 1 every way of keeping the inputs reproduces the plain gradients."""
    plain_losses, plain_grads = _loss_and_grads("plain", steps=2)
    checkpointing.configure(None, **options)
    for mode in ("reentrant", "non_reentrant"):
        checkpointing.get_cuda_rng_tracker().reset()
        losses, grads = _loss_and_grads(mode, steps=2)
        assert torch.equal(torch.stack(losses), torch.stack(plain_losses))
        assert all(torch.equal(grads[n], g) for n, g in plain_grads.items())


def test_configure_takes_deepspeeds_config_object_and_partition_needs_even_splits():
    from lightspeed.compat.deepspeed.runtime.config import DeepSpeedConfig

    checkpointing.configure(None, deepspeed_config=DeepSpeedConfig(
        {"train_batch_size": 2, "activation_checkpointing": {"cpu_checkpointing": True}}))
    assert settings.SETTINGS.options.cpu_checkpointing
    checkpointing.configure(_Mpu(rank=0, size=2), partition_activations=True)
    with pytest.raises(ValueError, match="does not split evenly over the model-parallel group of 2"):
        checkpointing.checkpoint(torch.nn.Linear(3, 3), torch.randn(1, 3, requires_grad=True))
    assert lightspeed.checkpointing is checkpointing


def test_profile_logs_each_forward_and_backward(ls_caplog):
    ls_caplog.set_level(logging.INFO, logger="lightspeed")
    checkpointing.configure(None, profile=True, synchronize=True)
    x = torch.randn(2, 3, requires_grad=True)
    checkpointing.checkpoint(torch.nn.Linear(3, 3), x).sum().backward()
    text = ls_caplog.text
    assert "activation checkpointing: forward" in text and "activation checkpointing: backward" in text


def test_contiguous_buffers_hold_number_checkpoints():
    checkpointing.configure(None, partition_activations=True, contiguous_checkpointing=True, num_checkpoints=2)
    model = CheckpointedNet("reentrant", num_blocks=3)
    checkpointing.model_parallel_cuda_manual_seed(1)
    with pytest.raises(ValueError, match="number_checkpoints is 2"):
        model(*_data())
    checkpointing.reset()
    checkpointing.set_num_layers(3)
    model(*_data()).backward()  # three fit
    lin = torch.nn.Linear(8, 8)
    checkpointing.checkpoint(lin, torch.randn(2, 8, requires_grad=True))
    with pytest.raises(ValueError, match="same sizes"):
        checkpointing.checkpoint(lin, torch.randn(3, 8, requires_grad=True))


def _saved_bytes(fn) -> int:
    """Bytes of the tensors autograd keeps for backward while `fn()` runs forward (distinct storages)."""
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    out.backward()
    return sum(seen.values())


def test_checkpointing_keeps_fewer_bytes():
    x, y = _data(n=64)
    checkpointing.model_parallel_cuda_manual_seed(5)
    plain = _saved_bytes(lambda: CheckpointedNet("plain", dim=32, num_blocks=4)(x.repeat(1, 4), y))
    checkpointed = _saved_bytes(lambda: CheckpointedNet("reentrant", dim=32, num_blocks=4)(x.repeat(1, 4), y))
    weights = sum(p.numel() * 4 for p in CheckpointedNet(dim=32, num_blocks=4).parameters())
    # the plain run keeps every block's activations; the checkpointed one each block's input and the head's
    assert checkpointed - weights < (plain - weights) / 4, (plain, checkpointed, weights)


# ---------------------------------------------------------------------------------------------- engine
def _engine(model, stage=3, **extra):
    cfg = {"train_batch_size": 4, "steps_per_print": 10**6,
           "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                                 "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 100}, **extra}
    engine, *_ = lightspeed.initialize(model=model, config=cfg, dist_init_required=False)
    return engine


def test_engine_configures_checkpointing_from_the_block():
    _engine(torch.nn.Linear(2, 2), stage=0)
    assert not checkpointing.is_configured()  # a default block configures nothing, as DeepSpeed
    _engine(torch.nn.Linear(2, 2), stage=0, activation_checkpointing={"cpu_checkpointing": True})
    assert checkpointing.is_configured() and settings.SETTINGS.options.cpu_checkpointing
    checkpointing.configure(None, profile=True)
    _engine(torch.nn.Linear(2, 2), stage=0, activation_checkpointing={"partition_activations": True})
    assert settings.SETTINGS.options.profile and not settings.SETTINGS.options.partition_activations  # it stands


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant", "torch", "torch_non_reentrant"])
def test_zero3_recomputation_keeps_the_trace(mode, ls_caplog, monkeypatch):
    """Stage 3 with every group released after use: losses equal the plain model's, and the trace
    recorded on the first step is followed on the next ones (the reruns are not recorded). One process
    runs the gathering machinery as more ranks do (a world of one would view the shards instead)."""
    from lightspeed.zero.stage3 import options as stage3_options

    monkeypatch.setattr(stage3_options, "ONE_RANK_VIEWS", False)
    traces, losses = {}, {}
    for m in ("plain", mode):
        checkpointing.get_cuda_rng_tracker().reset()
        engine = _engine(CheckpointedNet(m, tracked=not mode.startswith("torch")))
        checkpointing.model_parallel_cuda_manual_seed(3)
        coordinator = engine.strategy.coordinator
        losses[m], traces[m] = [], []
        for s in range(3):
            loss = engine(*_data(s))
            engine.backward(loss)
            engine.step()
            losses[m].append(loss.item())
            traces[m].append([type(u).__name__ for u in coordinator._trace])
            assert coordinator._trace_done and coordinator._trace_ok, (m, s)
            assert not coordinator._in_backward
    assert losses[mode] == losses["plain"]
    assert traces[mode][0] == traces[mode][1] == traces[mode][2]
    forward = traces["plain"][0][:len(CheckpointedNet().blocks) + 3]
    assert traces[mode][0][:len(forward)] == forward  # the forward order, then the backward's, once
    assert "module order differs" not in ls_caplog.text


class _Twice(torch.nn.Module):
    """Runs one layer twice, each time through `ckpt`."""

    def __init__(self, ckpt):
        super().__init__()
        torch.manual_seed(0)
        self.ckpt = ckpt
        self.inp = torch.nn.Linear(4, 4)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4)])
        self.head = torch.nn.Linear(4, 1)

    def forward(self, x, y):
        x = self.inp(x)
        for _ in range(2):
            x = self.ckpt(self.layers[0], x) if self.ckpt else self.layers[0](x)
        return F.mse_loss(self.head(x), y)


@pytest.mark.parametrize("stage", [0, 3])
def test_a_layer_in_two_reentrant_checkpoints_is_refused_not_lost(stage):
    """Each reentrant checkpoint runs its own backward, so the layer's gradient arrives twice; ZeRO-3
    had reduced the group after the first and would have lost the second. The non-reentrant one equals
    the plain model."""
    x, y = torch.randn(4, 4), torch.randn(4, 1)
    losses = {}
    for ckpt in (None, checkpointing.non_reentrant_checkpoint):
        engine = _engine(_Twice(ckpt), stage=stage)
        losses[ckpt] = []
        for _ in range(2):
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses[ckpt].append(loss.item())
    assert losses[None] == losses[checkpointing.non_reentrant_checkpoint]
    engine = _engine(_Twice(checkpointing.checkpoint), stage=stage)
    with pytest.raises(RuntimeError, match="gradient"):
        engine.backward(engine(x, y))


@pytest.mark.parametrize("ckpt", ["checkpoint", "non_reentrant_checkpoint"])
def test_flops_profiler_does_not_count_the_recomputation(ckpt):
    from lightspeed.profiling.flops_profiler import FlopsProfiler

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.block = torch.nn.Linear(8, 8, bias=False)

        def forward(self, x):
            return getattr(checkpointing, ckpt)(self.block, x)

    model = Model()
    prof = FlopsProfiler(model)
    prof.start_profile()
    model(torch.randn(4, 8, requires_grad=True)).sum().backward()  # the backward reruns the block
    assert prof.get_total_flops() == 2 * 4 * 8 * 8  # the forward's matmul once: the rerun is not counted
    prof.end_profile()
