"""OffloadPolicy's rules and the NVMe swapper on a temporary directory (no processes)."""

from __future__ import annotations

import os

import pytest
import torch

from lightspeed import config as config_mod
from lightspeed.config.errors import ConfigError
from lightspeed.offload.nvme import NvmeSwapper, check_nvme_path
from lightspeed.offload.overlap import optimizer_snapshot
from lightspeed.offload.policy import AioOptions, OffloadPolicy

BASE = {"train_batch_size": 4}


def _policy(zero: dict, **extra) -> OffloadPolicy:
    return OffloadPolicy.from_config(config_mod.load({**BASE, "zero_optimization": zero, **extra}, world_size=1))


def test_policy_from_config_and_deepspeed_rules(tmp_path, ls_caplog):
    p = _policy({"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                 "offload_param": {"device": "nvme", "nvme_path": str(tmp_path), "max_in_cpu": 7},
                 "sub_group_size": 1000}, aio={"block_size": 8192, "thread_count": 3})
    assert (p.optimizer, p.param, p.param_nvme_path, p.max_in_cpu) == ("cpu", "nvme", str(tmp_path), 7)
    assert p.optimizer_pin_memory and p.sub_group_size == 1000 and p.aio.block_size == 8192 and p.aio.thread_count == 3
    assert not _policy({"stage": 2}).enabled
    with pytest.raises(ConfigError, match="offload_optimizer: needs ZeRO stage 1, 2 or 3"):
        _policy({"stage": 0, "offload_optimizer": {"device": "cpu"}})
    # DeepSpeed reads it at stage 3 only
    assert not _policy({"stage": 2, "offload_param": {"device": "cpu"}}).offloads_params
    assert "offload_param has no effect at ZeRO stage 2" in ls_caplog.text
    with pytest.raises(ConfigError, match="overlap_step"):
        _policy({"stage": 2, "offload_optimizer": {"device": "none", "overlap_step": True}})
    with pytest.raises(ConfigError, match="ratio"):
        _policy({"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}})
    assert _policy({"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}).ratio == 0.5


def test_bad_nvme_paths_are_clear_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        check_nvme_path(str(tmp_path / "missing"), "zero_optimization.offload_param.nvme_path")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if not os.access(ro, os.W_OK):  # root may write anywhere
            with pytest.raises(ConfigError, match="not writable"):
                NvmeSwapper(str(ro), AioOptions(), key="k")
    finally:
        ro.chmod(0o700)
    s = NvmeSwapper(str(tmp_path), AioOptions(), key="zero_optimization.offload_optimizer.nvme_path")
    with pytest.raises(ConfigError, match="free; the swap files need"):
        s.require_space(1 << 62)
    s.close()


@pytest.mark.parametrize("block", [4096, 1 << 20])
def test_swapper_round_trip_frees_memory_and_removes_files(tmp_path, block):
    s = NvmeSwapper(str(tmp_path), AioOptions(block_size=block, queue_depth=2, thread_count=2), key="k")
    a = torch.randn(12345)  # not a multiple of a block
    b = torch.randn(3000, dtype=torch.float32).bfloat16()
    va, vb = a.clone(), b.clone()
    view = a[100:200]  # a view (an optimizer piece) sees the values again after the read
    s.register(a, "a")
    s.register(b, "b")
    s.swap_out(a)
    s.swap_out(b)
    s.ensure_in(b)
    assert s.location(a) == "nvme" and s.location(b) == "cpu"
    s.prefetch(a)
    s.ensure_in(a)
    assert a.untyped_storage().nbytes() == a.numel() * 4
    torch.testing.assert_close(a, va, rtol=0, atol=0)
    torch.testing.assert_close(b, vb, rtol=0, atol=0)
    torch.testing.assert_close(view, va[100:200], rtol=0, atol=0)
    a.add_(1)
    s.mark_dirty(a)
    s.swap_out(a)
    s.ensure_in(a)
    torch.testing.assert_close(a, va + 1, rtol=0, atol=0)
    directory = s.directory
    assert os.listdir(directory)
    s.close()
    assert not os.path.exists(directory)


def test_optimizer_snapshot_keeps_its_hyperparameters():
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.5)
    snap = optimizer_snapshot(opt)
    opt.param_groups[0]["lr"] = 0.0  # the LR schedule, while the background step runs
    p.grad = torch.ones(3)
    snap.step()
    torch.testing.assert_close(p.detach(), torch.full((3,), 0.5))
    assert snap.state is opt.state


def test_which_offloaded_steps_the_cpu_optimizer_fuses():
    """CPU optimizer offload hands the CPU optimizer the coefficient and the device copies (the piece
    pipeline); not NVMe, partial offload, parameters on NVMe, the overlapped step, or a torch optimizer."""
    from lightspeed.ops.adam import CPUAdam, FusedAdam
    from lightspeed.offload.policy import OffloadPolicy
    from lightspeed.zero.optimizers import fused_step

    p = [torch.nn.Parameter(torch.zeros(3))]
    cpu = CPUAdam(p)
    assert fused_step(cpu, OffloadPolicy(optimizer="cpu"))
    assert fused_step(cpu, OffloadPolicy(optimizer="cpu", param="cpu"))
    assert not fused_step(cpu, OffloadPolicy(optimizer="nvme", optimizer_nvme_path="/x"))
    assert not fused_step(cpu, OffloadPolicy(optimizer="cpu", param="nvme", param_nvme_path="/x"))
    assert not fused_step(cpu, OffloadPolicy(optimizer="cpu", ratio=0.5))
    assert not fused_step(cpu, OffloadPolicy(optimizer="cpu", overlap_step=True))
    assert not fused_step(torch.optim.AdamW(p), OffloadPolicy(optimizer="cpu"))
    assert not fused_step(cpu) and not fused_step(cpu, OffloadPolicy())  # no offload: only device optimizers
    assert fused_step(FusedAdam(p)) == FusedAdam(p).fuses_lowp_out


def test_early_step_ranges_equal_the_whole_step_and_finish_steps_what_no_range_covered():
    """`EarlyStep`: ranges of one param stepped in a background thread, in any split, plus a param no
    range covered (stepped by `finish`), equal the fused CPU step of both; a param half covered is an
    error, raised by `finish`."""
    from lightspeed.offload.early_step import EarlyStep
    from lightspeed.ops.adam import CPUAdam

    g = torch.Generator().manual_seed(3)
    ps = [torch.randn(1001, generator=g), torch.randn(37, generator=g)]
    grads = [torch.randn(p.shape, generator=g) for p in ps]
    whole = [p.clone() for p in ps]
    ref = CPUAdam(whole, lr=1e-2, weight_decay=0.1)
    ref.step(grads=dict(zip(whole, grads)))
    opt = CPUAdam(ps, lr=1e-2, weight_decay=0.1)
    early = EarlyStep(opt, opt.begin_zero_step(dict(zip(ps, grads))))
    for lo, hi in ((0, 300), (300, 301), (301, 1001)):
        early.submit(None, ps[0], lo, hi)
    early.finish()
    assert early.ranges == 3
    for p, q in zip(ps, whole):
        assert torch.equal(p, q)
    early = EarlyStep(opt, opt.begin_zero_step(dict(zip(ps, grads))))
    early.submit(None, ps[0], 0, 10)
    with pytest.raises(RuntimeError, match="covered 10 of 1001"):
        early.finish()


def test_overlap_step_warmup_needs_overlap_step():
    with pytest.raises(ConfigError, match="overlap_step_warmup: needs overlap_step"):
        OffloadPolicy(optimizer="cpu", overlap_step_warmup=3)
    assert OffloadPolicy(optimizer="cpu", overlap_step=True, overlap_step_warmup=3).overlap_step_warmup == 3


def test_super_offload_rollback_key():
    """`offload_optimizer.super_offload_rollback` (lightspeed's own key): "inverse" | "copy", unset by
    default (the step runner then picks the inverse where the optimizer has one); anything else is an
    error naming the key."""
    opt = {"device": "cpu", "super_offload": True}
    assert _policy({"stage": 2, "offload_optimizer": opt}).super_offload_rollback is None
    for mode in ("inverse", "copy"):
        zero = {"stage": 2, "offload_optimizer": {**opt, "super_offload_rollback": mode}}
        assert _policy(zero).super_offload_rollback == mode
    with pytest.raises(ConfigError, match="offload_optimizer.super_offload_rollback"):
        _policy({"stage": 2, "offload_optimizer": {**opt, "super_offload_rollback": "exact"}})
    with pytest.raises(ConfigError, match="super_offload_rollback"):
        OffloadPolicy(optimizer="cpu", super_offload=True, super_offload_rollback="exact")
