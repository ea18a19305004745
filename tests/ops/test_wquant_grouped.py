"""The grouped (mixture-of-experts) quantized matmul: `wq_grouped_matmul`'s Triton kernel (TRITON_INTERPRET=1 on
CPU, for real on CUDA) against the per-expert dequantize + fp32 matmul reference, in route order: experts
no route chose, routes to no expert, one expert for several routes, both slot modes (fewer routes than
experts or not), odd N, padded K, split-K with per-expert counters, per-group scales; the dispatcher's
checks."""
from __future__ import annotations

import copy
import os

import pytest
import torch

from lightspeed.ops.wquant import (
    MAX_GROUPED_ROWS,
    grouped_quantized_matmul,
    quantize,
    reference_grouped_matmul,
    reference_matmul,
    stack_weights,
)

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
RUN_HERE = INTERPRET or DEVICE == "cuda"
# tests/conftest.py sets TRITON_INTERPRET=1 on a machine without CUDA, unless the environment says otherwise
kernel_test = pytest.mark.skipif(not RUN_HERE, reason="TRITON_INTERPRET=0 and no CUDA: the kernel cannot run")
TOL = {torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 8e-3)}


def _experts(e, n, k, fmt, group_size, seed):
    gen = torch.Generator().manual_seed(seed)
    return stack_weights([quantize(torch.randn(n, k, generator=gen) * 0.05, fmt, group_size)
                          for _ in range(e)]).to(DEVICE)


def _check(y, x, qw, experts):
    """Each route's row against its expert's reference product; routes to no expert are zero rows."""
    per_x = experts.shape[1]
    assert y.shape == (experts.numel(), qw.shape[0]) and y.dtype == x.dtype
    for r, e in enumerate(experts.reshape(-1).tolist()):
        if not 0 <= e < qw.scales.shape[0]:
            assert int((y[r] != 0).sum()) == 0
            continue
        ref = reference_matmul(x[r // per_x:r // per_x + 1], qw.expert(e))
        rtol, atol = TOL[x.dtype]
        torch.testing.assert_close(y[r:r + 1].float(), ref.float(), rtol=rtol,
                                   atol=atol * max(ref.float().abs().max().item(), 1e-3) + 1e-6)


def _routes(rows):
    return torch.tensor(rows, dtype=torch.int64, device=DEVICE)


# (routes [tokens, top-k]) over 5 experts: fewer routes than experts (route slots: a repeated expert, a
# route to no expert), then more (expert slots: 2 experts unused, every route of a token distinct)
ROUTES = [[[3, 1]], [[4, 4], [5, 0]], [[2, 0], [0, 3], [3, 2], [6, 0]], [[1], [1], [1], [1], [1], [1]]]


@kernel_test
@pytest.mark.parametrize("fmt,group_size", [("fp6", None), ("int8", None), ("int4", None), ("int4", 48)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_grouped_kernel_matches_each_experts_reference(fmt, group_size, dtype):
    """5 experts of N = 70 (a partial N block) x K = 200 (2 K-tiles, padded; 240 = 5 groups of 48), the
    routes above, SPLIT_K 1 and 2 (per-expert counters, left at zero)."""
    from lightspeed.ops.wquant import launch
    from lightspeed.ops.wquant import grouped as wt

    n, k = 70, 240 if group_size else 200
    qw = _experts(5, n, k, fmt, group_size, seed=3)
    gen = torch.Generator().manual_seed(4)
    for rows in ROUTES:
        experts = _routes(rows)
        x = torch.randn(experts.shape[0], k, generator=gen).to(device=DEVICE, dtype=dtype)
        for split_k in (1, 2):
            cfg = {"BLOCK_N": 32, "SPLIT_K": split_k, "ONE_DOT": 1, "num_warps": 4, "num_stages": 2}
            _check(wt.wq_grouped_matmul(x, qw, experts, config=cfg), x, qw, experts)
    assert all(int(c.abs().sum()) == 0 for c in launch.counters.values())


@kernel_test
def test_grouped_kernel_default_config_and_dispatcher():
    """The config `grouped_config` picks (the interpreter's fixed one on CPU), through the dispatcher on
    CUDA, for route counts of a decode step up to MAX_GROUPED_ROWS (top-2 of 4 experts)."""
    from lightspeed.ops.wquant import grouped as wt

    qw = _experts(4, 96, 256, "fp6", None, seed=5)
    gen = torch.Generator().manual_seed(6)
    for tokens in (1, 2, 16, MAX_GROUPED_ROWS // 2):
        x = torch.randn(tokens, 256, generator=gen).to(device=DEVICE, dtype=torch.float16)
        experts = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(tokens)]).to(DEVICE)
        y = wt.wq_grouped_matmul(x, qw, experts) if DEVICE == "cpu" else grouped_quantized_matmul(x, qw, experts)
        _check(y, x, qw, experts)


def test_reference_and_checks():
    """CPU dispatch = the reference; malformed inputs are refused."""
    qw = stack_weights([quantize(torch.randn(24, 64) * 0.05, "int8") for _ in range(3)])
    x = torch.randn(2, 64, dtype=torch.float16)
    experts = torch.tensor([[2, 0], [3, 2]])
    y = grouped_quantized_matmul(x, qw, experts)
    torch.testing.assert_close(y, reference_grouped_matmul(x, qw, experts))
    torch.testing.assert_close(y[0:1], reference_matmul(x[0:1], qw.expert(2)))
    torch.testing.assert_close(y[1:2], reference_matmul(x[0:1], qw.expert(0)))
    torch.testing.assert_close(y[3:4], reference_matmul(x[1:2], qw.expert(2)))
    assert int(y[2].abs().sum()) == 0  # expert 3 does not exist: a dropped route
    with pytest.raises(ValueError, match=r"experts must be \[2, top_k\] integers"):
        grouped_quantized_matmul(x, qw, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"experts must be \[2, top_k\] integers"):
        grouped_quantized_matmul(x, qw, experts.float())
    with pytest.raises(ValueError, match=r"x must be \[tokens, 64\]"):
        grouped_quantized_matmul(x[:, :32], qw, experts)
    with pytest.raises(ValueError, match="scales must be"):
        grouped_quantized_matmul(x, qw.expert(0), experts)
    strided = copy.copy(qw)  # the kernel steps through scales as [experts, N, groups] contiguous
    strided.scales = qw.scales.transpose(0, 1).contiguous().transpose(0, 1)
    with pytest.raises(ValueError, match="scales must be a contiguous"):
        grouped_quantized_matmul(x, strided, experts)
    with pytest.raises(ValueError, match="differ in format"):
        stack_weights([quantize(torch.randn(24, 64), "int8"), quantize(torch.randn(24, 64), "int4")])
    with pytest.raises(ValueError, match="no backward"):
        grouped_quantized_matmul(x.float().requires_grad_(True), qw, experts)


@pytest.mark.parametrize("fmt,group_size", [("fp6", None), ("int4", 32)])
def test_grouped_operator_passes_opcheck(fmt, group_size):
    """The torch.compile operator: schema, fake implementation against the real one (CPU), and its value."""
    gen = torch.Generator().manual_seed(8)
    qw = stack_weights([quantize(torch.randn(40, 64, generator=gen), fmt, group_size) for _ in range(3)])
    x = torch.randn(3, 64, generator=gen)
    experts = torch.tensor([[0, 2], [2, 1], [3, 0]])
    op = torch.ops.lightspeed.grouped_quantized_matmul.default
    args = (x, list(qw.planes), qw.scales, experts, qw.format, 40, 64, qw.group_size, qw.dtype, qw.tile)
    torch.library.opcheck(op, args)
    torch.testing.assert_close(op(*args), reference_grouped_matmul(x, qw, experts))


@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA")
@pytest.mark.parametrize("fmt", ["int4", "fp6"])
def test_cuda_grouped_kernel_block_n_128_configs_repeatedly(fmt):
    """BLOCK_N 128 with 4 warps, 3 and 4 stages, the splits the heuristic picks from, 5 calls each: the
    configs where a K-tile's wgmmas left in flight across the loop corrupt int4 (a runtime 1.0 that the
    compiler could fold did that here: wrong int4 configs in every cell of an H200 sweep)."""
    from lightspeed.ops.wquant import grouped as wt

    qw = _experts(6, 1024, 2048, fmt, None, seed=9)
    gen = torch.Generator().manual_seed(10)
    for rows in ([[1, 4]], [[0, 2], [3, 5], [2, 5], [1, 0]]):
        experts = _routes(rows)
        x = torch.randn(experts.shape[0], 2048, generator=gen).to(device=DEVICE, dtype=torch.float16)
        for split_k in (1, 2, 6):
            for stages in (3, 4):
                cfg = {"BLOCK_N": 128, "SPLIT_K": split_k, "ONE_DOT": 1, "num_warps": 4, "num_stages": stages}
                for _ in range(5):
                    _check(wt.wq_grouped_matmul(x, qw, experts, config=cfg), x, qw, experts)


class _FakeKernel:
    """Stands in for `_wq_grouped_kernel`: `kernel[grid](...)` counts the call, returns the fake compiled one."""

    def __init__(self, arg_names, compiled):
        self.arg_names, self.compiled, self.calls = arg_names, compiled, []

    def __getitem__(self, grid):
        def call(*args, **kwargs):
            self.calls.append(grid)
            return self.compiled

        return call


@pytest.mark.parametrize("split_k", [1, 2])
def test_grouped_launch_plan_plumbing(split_k, monkeypatch, fake_compiled):
    """The grouped plan's bookkeeping without a GPU (fake kernel and launcher): the first call keeps a plan
    with its grid and every kernel parameter in order; later calls of the class (other x, weights, routes)
    skip the JIT launch and pass the new addresses (the workspace is y at SPLIT_K 1); other routes' shapes
    are another class; `config=` calls never use plans; growing a scratch buffer drops them."""
    from types import SimpleNamespace

    pytest.importorskip("triton")
    from lightspeed.ops.wquant import grouped as wt
    from lightspeed.ops.wquant import launch

    compiled = fake_compiled
    kernel = _FakeKernel(wt._wq_grouped_kernel.arg_names, compiled)
    fake_driver = SimpleNamespace(active=SimpleNamespace(get_current_device=lambda: 0,
                                                         get_current_stream=lambda device: 77))
    monkeypatch.setattr(wt, "_wq_grouped_kernel", kernel)
    monkeypatch.setattr(wt, "INTERPRET", False)
    monkeypatch.setattr(wt, "driver", fake_driver)
    monkeypatch.setattr(launch, "driver", fake_driver)
    cfg = {"BLOCK_N": 64, "SPLIT_K": split_k, "ONE_DOT": 1, "STREAM": 0, "num_warps": 4, "num_stages": 4}
    tunings = []
    monkeypatch.setattr(wt, "_tune", lambda *a: tunings.append(a) or dict(cfg))
    monkeypatch.setattr(wt, "_tuned", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    for name in ("plans", "workspaces", "counters"):  # fresh state
        monkeypatch.setattr(launch, name, {})
    monkeypatch.setattr(wt, "plans", launch.plans)
    names = wt._wq_grouped_kernel.arg_names
    qws = [stack_weights([quantize(torch.randn(96, 128), "fp6") for _ in range(3)]) for _ in range(2)]
    x = torch.randn(2, 128, dtype=torch.float16)
    experts = torch.tensor([[2, 0], [1, 2]])
    wt.wq_grouped_matmul(x, qws[0], experts)
    assert len(kernel.calls) == 1 and not compiled.launches and len(tunings) == 1
    (key, plan), = launch.plans.items()
    assert key == wt.grouped_plan_key(x, qws[0], experts) and plan.grid == (2, split_k, 3)
    assert len(plan.args) == len(names) and plan.config["SPLIT_K"] == split_k
    assert plan.args[names.index("K")] == 128 and plan.args[names.index("R")] == 4
    assert plan.args[names.index("ROUTE_SLOTS")] is False
    for qw in qws:
        x2, experts2 = torch.randn(2, 128, dtype=torch.float16), torch.tensor([[0, 1], [2, 0]])
        y = wt.wq_grouped_matmul(x2, qw, experts2)
        grid, stream, args = compiled.launches[-1]
        assert len(kernel.calls) == 1 and grid == plan.grid and stream == 77
        w = qw.planes[0].data_ptr()
        assert list(args[:5]) == [x2.data_ptr(), w, w, qw.scales.data_ptr(), y.data_ptr()]
        assert args[7] == experts2.data_ptr() and y.shape == (4, 96) and int(y.abs().sum()) == 0
        ws = args[5]
        assert (ws == y.data_ptr()) if split_k == 1 else (ws is launch.workspaces[x.device])
        assert list(args[6:7]) + list(args[8:]) == plan.args[6:7] + plan.args[8:]
    wt.wq_grouped_matmul(x[:1], qws[0], experts[:1])  # another route count: its own class, tuned
    assert len(kernel.calls) == 2 and len(launch.plans) == 2 and len(tunings) == 2
    wt.wq_grouped_matmul(x, qws[0], experts, config=dict(cfg))
    assert len(kernel.calls) == 3 and len(launch.plans) == 2
    launch.workspace(x.device, launch.workspace(x.device, 1).numel() + 1)
    assert not launch.plans
    wt.wq_grouped_matmul(x, qws[1], experts)  # a new plan from the kept tuning: no timing
    assert len(kernel.calls) == 4 and len(tunings) == 2 and len(launch.plans) == 1


def test_grouped_tuning_picks_the_fastest_candidate(monkeypatch):
    """`_tune` times every candidate (fake timer), skips those that do not fit the GPU, returns the fastest;
    candidates: each split gets >= 2 K-tiles, within `max_split_k(R)`, 3 and 4 stages."""
    pytest.importorskip("triton")
    from triton.runtime.errors import OutOfResources

    from lightspeed.ops.wquant import grouped as wt

    assert [(c["SPLIT_K"], c["num_stages"]) for c in wt.grouped_candidates(2, 4096, 1024, 128)] == [
        (sk, st) for sk in (1, 2, 3, 4) for st in (3, 4)]  # 8 K-tiles: splits of >= 2
    assert {c["SPLIT_K"] for c in wt.grouped_candidates(64, 4096, 14336, 128)} == {1, 2, 3, 4}  # max_split_k(64)
    assert {c["BLOCK_N"] for c in wt.grouped_candidates(2, 48, 14336, 128)} == {64}
    launched = []

    def fake_bench(call, copies):
        assert copies == 1
        call(0)
        cfg = launched[-1]
        if cfg["SPLIT_K"] == 4:
            raise OutOfResources(1, 0, "shared memory")
        return {1: 3.0, 2: 2.0, 3: 1.5}[cfg["SPLIT_K"]] + (0.1 if cfg["num_stages"] == 4 else 0.0)

    monkeypatch.setattr(wt, "rotation_bench", fake_bench)
    monkeypatch.setattr(wt, "rotated_routes", lambda experts, num_experts, nbytes: [experts])
    monkeypatch.setattr(wt, "cached_pick", lambda kernel, key, candidates, tune: tune()[0])
    monkeypatch.setattr(wt, "refuse_capture", lambda: None)  # CPU torch has no capture state to ask
    monkeypatch.setattr(wt, "_launch", lambda x, qw, experts, cfg: launched.append(cfg))
    monkeypatch.setattr(wt, "driver", type("D", (), {"active": type("A", (), {"get_current_device": lambda: 0})}))
    qw = stack_weights([quantize(torch.randn(4096, 1024), "int4") for _ in range(2)])
    best = wt._tune(torch.zeros(1, 1024, dtype=torch.float16), qw, torch.tensor([[0, 1]]))
    assert len(launched) == 8 and best["SPLIT_K"] == 3 and best["num_stages"] == 3


def test_rotated_routes_send_each_copy_to_other_experts(monkeypatch):
    """The routes the grouped tuner cycles over: the first is the call's own; each other maps the routed
    experts one to one onto experts no earlier copy used (routes to no expert kept), as many copies as
    `rotation_copies` asks and disjoint sets allow."""
    pytest.importorskip("triton")
    from lightspeed.ops.wquant import grouped as wt

    experts = torch.tensor([[5, 2], [2, -1], [7, 5]], dtype=torch.int32)
    for wanted, got in ((2, 2), (10, 3), (1, 1)):  # 9 experts: 3 disjoint sets of the 3 routed
        monkeypatch.setattr(wt, "rotation_copies", lambda nbytes, wanted=wanted: wanted)
        routes = wt.rotated_routes(experts, 9, 1000)
        assert len(routes) == got and torch.equal(routes[0], experts)
        seen = set()
        for r in routes:
            assert r.dtype == experts.dtype and r.shape == experts.shape and r[1, 1] == -1
            used = set(r[r >= 0].tolist())
            assert len(used) == 3 and not used & seen
            seen |= used
            assert (r[0, 1] == r[1, 0]) and (r[0, 0] == r[2, 1])  # one to one: equal experts stay equal
    monkeypatch.setattr(wt, "rotation_copies", lambda nbytes: 4)
    assert len(wt.rotated_routes(torch.tensor([[-1, 9]]), 9, 1000)) == 1


@pytest.mark.skipif(DEVICE != "cuda", reason="launch plans keep compiled kernels: CUDA only")
@pytest.mark.parametrize("fmt", ["fp6", "int8", "int4"])
def test_cuda_grouped_launch_plans_match_the_reference(fmt, monkeypatch):
    """After a class's first call, `wq_grouped_matmul` launches its kept plan: with the kernel's JIT launch
    made to fail, calls with other x, routes and experts' weights of the same shapes still match the
    reference (fp16 and bf16, route slots and expert slots)."""
    from lightspeed.ops.wquant import grouped as wt

    qws = [_experts(5, 200, 256, fmt, None, seed) for seed in (21, 22)]
    gen = torch.Generator().manual_seed(23)
    for dtype in (torch.float16, torch.bfloat16):
        for rows in ([[3, 1]], [[2, 0], [0, 3], [3, 2], [1, 0]]):
            experts = _routes(rows)
            x = torch.randn(experts.shape[0], 256, generator=gen).to(device=DEVICE, dtype=dtype)
            _check(wt.wq_grouped_matmul(x, qws[0], experts), x, qws[0], experts)
            assert wt.grouped_plan_key(x, qws[0], experts) in wt.plans
            with monkeypatch.context() as patch:
                patch.setattr(wt, "_wq_grouped_kernel", None)  # a JIT launch would fail
                for qw in qws:
                    other = experts.flip(0).contiguous()
                    x2 = torch.randn(experts.shape[0], 256, generator=gen).to(device=DEVICE, dtype=dtype)
                    _check(wt.wq_grouped_matmul(x2, qw, other), x2, qw, other)


@pytest.mark.skipif(DEVICE != "cuda", reason="tuning and CUDA graphs: CUDA only")
def test_cuda_grouped_tunes_on_first_call_and_captures_an_untuned_class(monkeypatch):
    """A class's first call times the candidates and keeps the fastest; a class first called inside a
    CUDA-graph capture runs the untuned `grouped_config` (no timing there) and is right on replay."""
    from lightspeed.ops.wquant import grouped as wt

    monkeypatch.setattr(wt, "_tuned", {})
    wt.plans.clear()  # a kept plan would skip the tuning
    qw = _experts(4, 256, 1024, "int4", None, seed=31)
    wt.reserve_grouped_scratch(torch.device(DEVICE), "int4", 256, 4)
    gen = torch.Generator().manual_seed(32)
    experts = _routes([[1, 3]])
    x = torch.randn(1, 1024, generator=gen).to(device=DEVICE, dtype=torch.float16)
    _check(wt.wq_grouped_matmul(x, qw, experts), x, qw, experts)
    (cfg,) = wt._tuned.values()
    assert cfg in wt.grouped_candidates(2, 256, 1024, qw.tile)
    experts3 = _routes([[0, 2], [1, 3], [2, 0]])
    x3 = torch.randn(3, 1024, generator=gen).to(device=DEVICE, dtype=torch.float16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y3 = wt.wq_grouped_matmul(x3, qw, experts3)
    graph.replay()
    torch.cuda.synchronize()
    _check(y3, x3, qw, experts3)
    assert len(wt._tuned) == 1
