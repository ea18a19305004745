"""The Triton kernel of lightspeed.ops.wquant (run by TRITON_INTERPRET=1 on CPU) vs the dequantize +
fp32 matmul reference, for fp6 / int8 / int4, fp16 and bf16 activations, every M in 1..64 across the
file, odd N, K not a multiple of the pack tile (padding), per-group scales (every scale-span mode),
split-K with both reductions, bias, and all 64 fp6 codes exactly."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from lightspeed.ops.wquant import dequantize, quantize, reference_matmul

# triton.jit (its own tl.* helpers included) reads TRITON_INTERPRET when functions are defined, i.e. at
# `import triton`: too late once anything in this process imported triton. So on a CPU machine the
# kernel tests run in one child pytest with TRITON_INTERPRET=1 (test_interpreted_in_subprocess); on a
# GPU they run in-process on CUDA.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
RUN_HERE = INTERPRET or DEVICE == "cuda"
kernel_test = pytest.mark.skipif(not RUN_HERE, reason="runs in the TRITON_INTERPRET=1 child (see below)")

# (rtol, atol relative to max |y|) per activation dtype: fp32 sums in a different order, then one rounding
TOL = {torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 8e-3)}
FORMATS = [("fp6", None), ("int8", None), ("int4", None)]
DTYPES = [torch.float16, torch.bfloat16]
# every M in 1..64 appears at least once across the (format, dtype) cases below
M_CHUNKS = [list(range(i, 65, 6)) for i in range(1, 7)]
assert sorted(m for chunk in M_CHUNKS for m in chunk) == list(range(1, 65))


@pytest.mark.skipif(RUN_HERE, reason="already interpreting or on CUDA")
def test_interpreted_in_subprocess():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__],
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout


@pytest.fixture(scope="module")
def wt():
    pytest.importorskip("triton")
    from lightspeed.ops.wquant import triton as module

    assert module.INTERPRET == INTERPRET
    return module


@pytest.fixture(scope="module")
def launch(wt):
    from lightspeed.ops.wquant import launch as module

    return module


@pytest.fixture(scope="module")
def wdq(wt):
    from lightspeed.ops.wquant import dequant

    return dequant


def _check(y, x, qw, bias=None):
    ref = reference_matmul(x, qw, bias)
    assert y.dtype == x.dtype and y.shape == ref.shape
    rtol, atol = TOL[x.dtype]
    torch.testing.assert_close(y.float(), ref.float(), rtol=rtol, atol=atol * ref.float().abs().max().item() + 1e-6)


def _weight(n, k, fmt, group_size, seed):
    gen = torch.Generator().manual_seed(seed)
    return quantize(torch.randn(n, k, generator=gen) * 0.05, fmt, group_size).to(DEVICE)


def _randn(*shape, gen, dtype):
    return torch.randn(*shape, generator=gen).to(device=DEVICE, dtype=dtype)


@kernel_test
@pytest.mark.parametrize("case", range(6))
def test_kernel_matches_reference_every_m(wt, case):
    fmt, group_size = FORMATS[case % 3]
    dtype = DTYPES[case // 3]
    n, k = (48, 128) if case % 2 == 0 else (80, 192)
    qw = _weight(n, k, fmt, group_size, seed=case)
    gen = torch.Generator().manual_seed(100 + case)
    for m in M_CHUNKS[case]:
        x = _randn(m, k, gen=gen, dtype=dtype)
        _check(wt.wq_matmul(x, qw), x, qw)


def _cfg(block_n=16, split_k=1):
    return {"BLOCK_N": block_n, "SPLIT_K": split_k, "num_warps": 4, "num_stages": 2}


@kernel_test
@pytest.mark.parametrize("fmt", ["fp6", "int8", "int4"])
def test_kernel_single_output(wt, fmt):
    """N = 1 (Qwen2-MoE's shared-expert gate, a [1, hidden] linear): triton turns an integer argument of 1
    into a constant, which the kernel's runtime 1.0 must not come from (it did: a compile error on the GPU)."""
    qw = _weight(1, 64, fmt, None, seed=11)
    gen = torch.Generator().manual_seed(12)
    for m in (1, 3):
        x = _randn(m, 64, gen=gen, dtype=torch.float16)
        _check(wt.wq_matmul(x, qw), x, qw)


@kernel_test
@pytest.mark.parametrize("fmt", ["fp6", "int8", "int4"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_odd_n_odd_k_bias_split_k(wt, launch, fmt, dtype):
    """N = 37 (partial N block), K = 200 (padded to 256: 2 K-tiles, the second partly padding), split-K
    3 (one split gets no tile) and 2 through the in-kernel fixup and the two-kernel reduction."""
    n, k = 37, 200
    qw = _weight(n, k, fmt, None, seed=7)
    gen = torch.Generator().manual_seed(8)
    bias = _randn(n, gen=gen, dtype=dtype)
    for m, split_k, reduce in ((1, 3, "fixup"), (13, 2, "kernel"), (33, 1, None)):
        x = _randn(m, k, gen=gen, dtype=dtype)
        _check(wt.wq_matmul(x, qw, bias, config=_cfg(16, split_k), reduce=reduce), x, qw, bias)
        assert wt.last_config()["SPLIT_K"] == split_k
    # the fixup leaves every arrival counter at zero for the next call
    assert all(int(c.abs().sum()) == 0 for c in launch.counters.values())


@kernel_test
@pytest.mark.parametrize("fmt,group_size", [("fp6", None), ("int8", None), ("int4", None), ("int4", 48)])
def test_kernel_stream_k(wt, launch, fmt, group_size):
    """Stream-K: N = 200 (7 blocks of 32, the last partial) x K = 700 (6 K-tiles, padding) = 42 units cut
    into P ranges; P = 5 (ranges of 8-9 units: some blocks inside one range, others split in two),
    13 (2-3 programs per block) and 42 (one unit per program: 6 per block, every block through the
    fixup); bias, fp16/bf16, M = 1, 2, 13, 16. Under the interpreter P = STREAM (one "SM"); on a GPU
    P = min(42, STREAM x SMs) = 42. Counters are left at zero; M > 16 is refused (tuning.MAX_STREAM_M)."""
    n, k = 200, 720 if group_size else 700
    qw = _weight(n, k, fmt, group_size, seed=41)
    gen = torch.Generator().manual_seed(42)
    bias = _randn(n, gen=gen, dtype=torch.float16)
    cases = ((1, 5, torch.float16, bias), (13, 13, torch.bfloat16, None), (16, 42, torch.float16, bias),
             (2, 5, torch.bfloat16, None))
    for m, stream, dtype, b in cases:
        x = _randn(m, k, gen=gen, dtype=dtype)
        b = None if b is None else b.to(dtype)
        _check(wt.wq_matmul(x, qw, b, config={**_cfg(32), "STREAM": stream}), x, qw, b)
        assert wt.last_config()["STREAM"] == stream
    assert all(int(c.abs().sum()) == 0 for c in launch.counters.values())
    with pytest.raises(ValueError, match="STREAM needs M <= 16"):
        wt.wq_matmul(_randn(17, k, gen=gen, dtype=torch.float16), qw, config={**_cfg(32), "STREAM": 2})


@kernel_test
@pytest.mark.parametrize("fmt,group_size", [("fp6", None), ("int8", None), ("int4", None), ("int4", 48),
                                            ("int8", 80)])
def test_dequantize_weight_is_bit_identical_to_the_reference(wdq, fmt, group_size):
    """The one-pass Triton dequantizer (the prefill path's first step) gives exactly the reference's
    value * scale rounded once (bf16 in the interpreter: within its truncation's ulp), for N not a
    multiple of the 32-row storage group and K with padding."""
    qw = _weight(45, 240, fmt, group_size, seed=31)
    for dtype in DTYPES:
        got, ref = wdq.dequantize_weight(qw, dtype), dequantize(qw, dtype)
        assert got.dtype == dtype and got.shape == (45, 240)
        if dtype == torch.bfloat16 and INTERPRET:  # the interpreter rounds fp32 -> bf16 toward zero: 1 ulp
            torch.testing.assert_close(got.float(), ref.float(), rtol=2**-7, atol=0)
        else:
            assert torch.equal(got, ref)


@kernel_test
def test_large_m_runs_dequantize_then_matmul(wt, wdq, monkeypatch):
    """From DEQUANT_MIN_M rows on (lowered here to keep the interpreter fast) wq_matmul dequantizes once and
    calls torch.matmul, in row chunks when the weight is larger than DEQUANT_CHUNK_ELEMS; an explicit
    config still runs the kernel."""
    monkeypatch.setitem(wt.DEQUANT_MIN_M, "fp6", 8)
    qw = _weight(40, 200, "fp6", None, seed=32)
    gen = torch.Generator().manual_seed(33)
    bias = _randn(40, gen=gen, dtype=torch.float16)
    x = _randn(9, 200, gen=gen, dtype=torch.float16)
    _check(wt.wq_matmul(x, qw, bias), x, qw, bias)
    assert wt.last_config() == {"PATH": "dequant+matmul"}
    _check(wt.wq_matmul(x, qw, bias, config=_cfg(32, 1)), x, qw, bias)
    assert wt.last_config()["BLOCK_N"] == 32
    _check(wt.wq_matmul(x[:7], qw, bias), x[:7], qw, bias)
    assert "PATH" not in wt.last_config()
    monkeypatch.setattr(wdq, "DEQUANT_CHUNK_ELEMS", 32 * 200)  # row chunks of 32: [0, 32) and [32, 40)
    _check(wt.wq_matmul(x, qw, bias), x, qw, bias)
    _check(wt.wq_matmul(x, qw), x, qw)
    assert torch.equal(wdq.dequantize_weight(qw, torch.float16, (32, 40)), dequantize(qw, torch.float16)[32:40])
    with pytest.raises(ValueError, match="multiple of 32"):
        wdq.dequantize_weight(qw, torch.float16, (16, 40))


@kernel_test
@pytest.mark.parametrize("fmt,group_size,dtype", [("fp6", None, torch.float16), ("int8", None, torch.bfloat16),
                                                   ("int4", 32, torch.float16)])
def test_dense_grad_input_matches_reference(wdq, fmt, group_size, dtype, monkeypatch):
    """grad @ W (the input gradient the quantized operator's backward needs) by the Triton dequantizer:
    whole, and in row chunks [0, 32) [32, 64) [64, 72) summed in fp32, against the reference weight."""
    qw = _weight(72, 192 if group_size else 200, fmt, group_size, seed=41)
    gen = torch.Generator().manual_seed(42)
    grad = _randn(11, 72, gen=gen, dtype=dtype)
    ref = grad.float() @ dequantize(qw, torch.float32)
    rtol, atol = TOL[dtype]
    for chunk in (None, 32 * qw.shape[1]):
        if chunk is not None:
            monkeypatch.setattr(wdq, "DEQUANT_CHUNK_ELEMS", chunk)
        got = wdq.dense_grad_input(grad, qw)
        assert got.dtype == dtype and got.shape == (11, qw.shape[1])
        torch.testing.assert_close(got.float(), ref, rtol=rtol, atol=atol * ref.abs().max().item())


@kernel_test
@pytest.mark.parametrize("fmt", ["fp6", "int4"])
def test_kernel_both_product_forms(wt, fmt):
    """ONE_DOT 1 (the four field tiles joined into one K-tile product) and 0 (one product per field), which
    the autotuner chooses between, agree with the reference (fp16 and bf16, several M, K with padding)."""
    qw = _weight(40, 200, fmt, None, seed=21)
    gen = torch.Generator().manual_seed(22)
    for m, dtype in ((1, torch.float16), (16, torch.bfloat16), (40, torch.float16)):
        x = _randn(m, 200, gen=gen, dtype=dtype)
        for one_dot in (0, 1):
            _check(wt.wq_matmul(x, qw, config={**_cfg(32, 2 if m <= 64 else 1), "ONE_DOT": one_dot}), x, qw)
            assert wt.last_config()["ONE_DOT"] == one_dot


@kernel_test
@pytest.mark.parametrize("fmt,group_size,k", [("int4", 64, 128), ("int8", 32, 128), ("fp6", 64, 128),
                                              ("int4", 48, 240), ("int8", 256, 512), ("fp6", 256, 512),
                                              ("int8", 48, 240)])
def test_kernel_per_group_scales(wt, fmt, group_size, k):
    """Groups of 32/64 (several per K-tile), 48 (straddling K-tiles: scale per 16-value sub-tile) and 256
    (several K-tiles per group), with and without split-K."""
    qw = _weight(24, k, fmt, group_size, seed=9)
    gen = torch.Generator().manual_seed(10)
    for m, dtype, split_k in ((5, torch.float16, 1), (17, torch.bfloat16, 2)):
        x = _randn(m, k, gen=gen, dtype=dtype)
        _check(wt.wq_matmul(x, qw, config=_cfg(16, split_k)), x, qw)


@kernel_test
def test_group_layout_modes(wt):
    assert wt.group_layout("fp6", 512, None, 128) == (False, 512, 32, 1)
    assert wt.group_layout("int4", 512, 64, 128) == (True, 64, 32, 2)
    assert wt.group_layout("int4", 512, 256, 128) == (True, 256, 32, 4)
    assert wt.group_layout("int4", 480, 48, 128) == (True, 48, 16, 1)  # odd multiple of 16: fields split
    assert wt.group_layout("int4", 512, 16, 128) == (True, 16, 16, 1)
    assert wt.group_layout("int8", 512, 64, 128) == (True, 64, 32, 2)  # int8 has the same fields
    assert wt.group_layout("int8", 480, 48, 128) == (True, 48, 16, 1)
    assert wt.group_layout("int8", 512, None, 128) == (False, 512, 32, 1)
    assert wt.group_layout("int8", 512, 512, 128) == (False, 512, 32, 1)  # one group == per channel


@kernel_test
@pytest.mark.parametrize("fmt", ["fp6", "int8", "int4"])
def test_kernel_storage_geometry_matches_the_reference(wdq, fmt):
    # the kernels' compile-time chunk sizes (dequant.chunk_bytes & co) against reference.py's layout
    from lightspeed.ops.wquant.reference import ROW_GROUP, _row_plane_bytes, plane_specs, tile_bytes

    f = wdq.FORMAT_ID[fmt]
    for tile in (32, 128):
        assert wdq.chunk_bytes(f, tile, ROW_GROUP) == ROW_GROUP * tile_bytes(fmt, tile)
        assert wdq.hi_row_bytes(f, tile) == _row_plane_bytes(fmt, tile)[0]  # the w elements' plane comes first
        assert plane_specs(fmt, 70, 3 * tile, tile)[0][0][2] == wdq.chunk_bytes(f, tile, ROW_GROUP)
    assert wdq.unit_bytes(f) == wdq.packed_units(quantize(torch.zeros(32, 128), fmt)).element_size()


@kernel_test
def test_kernel_large_m_tiles_over_m(wt):
    qw = _weight(40, 64, "fp6", None, seed=11)
    x = _randn(130, 64, gen=torch.Generator().manual_seed(12), dtype=torch.float16)
    _check(wt.wq_matmul(x, qw), x, qw)
    with pytest.raises(ValueError, match="SPLIT_K > 1 needs M <= 64"):
        wt.wq_matmul(x, qw, config=_cfg(16, 2))


@kernel_test
def test_kernel_rejects_foreign_planes(wt):
    qw = _weight(8, 128, "fp6", None, seed=13)
    qw.planes = (qw.planes[0].view(torch.int16),)
    with pytest.raises(ValueError, match="plane must be a contiguous"):
        wt.wq_matmul(torch.zeros(1, 128, dtype=torch.float16, device=DEVICE), qw)
    # the kernels address packed bytes with 32-bit offsets: 2 GiB or more is refused, not overrun
    huge = torch.empty((2**31,), dtype=torch.int8, device="meta")
    qw.planes = (huge,)
    with pytest.raises(ValueError, match="< 2 GiB per layer"):
        wt.wq_matmul(torch.zeros(1, 128, dtype=torch.float16, device=DEVICE), qw)


@kernel_test
def test_kernel_extreme_codes_are_exact(wt):
    """All 64 e3m2 codes in every field position, saturated and zero rows: fp16 x = one-hot rows reads
    back dequant(W).T exactly."""
    k = 128
    w = torch.zeros(4, k)
    w[0] = torch.linspace(-28, 28, k)
    w[1, :64] = torch.arange(64, dtype=torch.float32) - 32  # mixed magnitudes, subnormals after scaling
    w[1, 64:] = -(torch.arange(64, dtype=torch.float32) - 31)
    qw = quantize(w, "fp6").to(DEVICE)
    codes = torch.arange(64, dtype=torch.uint8).repeat(2)
    from lightspeed.ops.wquant.reference import pack_fp6

    from lightspeed.ops.wquant.reference import row_planes, tile_major

    hi, lo = pack_fp6(torch.stack([codes, codes.roll(16)]))  # each code in several field positions
    rows = row_planes(qw)
    qw.planes = (tile_major((torch.cat([rows[0][:2], hi.to(DEVICE)]), torch.cat([rows[1][:2], lo.to(DEVICE)])),
                            "fp6", 4, k),)
    qw.shape = (4, k)
    qw.scales = torch.cat([qw.scales[:2], torch.ones(2, 1, dtype=torch.float16, device=DEVICE)])
    x = torch.eye(k, dtype=torch.float16, device=DEVICE)
    for m0 in (0, 64):
        xs = x[m0:m0 + 64]
        y = wt.wq_matmul(xs, qw)
        torch.testing.assert_close(y.float(), reference_matmul(xs, qw).float(), rtol=0, atol=0)
        assert torch.isfinite(y).all()
    y = wt.wq_matmul(x[:64], qw).float()
    from lightspeed.ops.wquant import fp6_decode

    assert torch.equal(y[:, 2].cpu(), fp6_decode(codes[:64]).cpu())  # all 64 codes, exactly


class _FakeKernel:
    """Stands in for the jitted kernel: `kernel[grid](...)` returns the fake compiled kernel."""

    def __init__(self, compiled, arg_names):
        self.compiled, self.arg_names, self.calls = compiled, arg_names, 0

    def __getitem__(self, grid):
        def call(*args, **kwargs):
            self.calls += 1
            return self.compiled

        return call


@kernel_test
def test_launch_plan_plumbing(wt, launch, monkeypatch, fake_compiled):
    """The plan's bookkeeping without a GPU (a fake tuner, kernel and launcher): the first call tunes and
    keeps a plan with the chosen config's grid and every kernel parameter in order; later calls of the
    class skip the tuner and pass the new tensors' addresses in the first six places; another M is another
    class; `config=` calls never use plans; growing a scratch buffer drops them."""
    from types import SimpleNamespace

    from lightspeed.ops.wquant import tuning

    compiled = fake_compiled
    config = tuning.make_config(64, 4, 4, 3)
    kernel = _FakeKernel(compiled, wt._wq_matmul_kernel.arg_names)
    tunings = []
    fake_driver = SimpleNamespace(active=SimpleNamespace(get_current_device=lambda: 0,
                                                         get_current_stream=lambda device: 1234))
    monkeypatch.setattr(wt, "_wq_matmul_kernel", kernel)
    monkeypatch.setattr(wt, "_tune", lambda x, qw, bias, red: tunings.append(x.shape[0]) or dict(config))
    monkeypatch.setattr(wt, "_tuned", {})
    monkeypatch.setattr(wt, "INTERPRET", False)  # as on the GPU: tuned and planned
    monkeypatch.setattr(wt, "REDUCE", 1)
    monkeypatch.setattr(launch, "driver", fake_driver)
    monkeypatch.setattr(wt, "driver", fake_driver)
    monkeypatch.setattr(wt, "num_sms", lambda: 1)  # stream-K's room as under the interpreter: M sizes the buffer
    for name in ("plans", "workspaces", "counters"):  # fresh state: this test's buffers grow as it says
        monkeypatch.setattr(launch, name, {})
    monkeypatch.setattr(wt, "plans", launch.plans)
    n, k = 200, 384
    qws = [_weight(n, k, "fp6", None, seed) for seed in (41, 42)]
    gen = torch.Generator().manual_seed(43)
    bias = _randn(n, gen=gen, dtype=torch.float16)
    x = _randn(3, k, gen=gen, dtype=torch.float16)
    wt.wq_matmul(x, qws[0], bias)
    assert tunings == [3] and kernel.calls == 1 and not compiled.launches
    (key, plan), = launch.plans.items()
    assert key == launch.plan_key(x, qws[0], bias, 1)
    assert plan.grid == (triton_cdiv(n, 64), 4, 1) and plan.config["SPLIT_K"] == 4
    names = wt._wq_matmul_kernel.arg_names
    assert len(plan.args) == len(names)
    assert plan.args[names.index("K")] == k and plan.args[names.index("BLOCK_N")] == 64
    assert plan.args[names.index("M")] == 3 and plan.args[names.index("HAS_BIAS")] is True
    for qw in qws:
        x2 = _randn(3, k, gen=gen, dtype=torch.float16)
        y = wt.wq_matmul(x2, qw, bias)
        grid, stream, args = compiled.launches[-1]
        assert kernel.calls == 1 and grid == plan.grid and stream == 1234
        w, s = qw.planes[0].data_ptr(), qw.scales.data_ptr()
        assert list(args[:6]) == [x2.data_ptr(), w, w, s, bias.data_ptr(), y.data_ptr()]
        assert list(args[6:]) == plan.args[6:] and y.shape == (3, n) and y.dtype == torch.float16
        assert wt.last_config() == plan.config
    x4 = _randn(4, k, gen=gen, dtype=torch.float16)
    wt.wq_matmul(x4, qws[0], bias)  # M = 4: its own class (its larger workspace dropped M = 3's plan)
    assert tunings == [3, 4] and kernel.calls == 2 and list(launch.plans) == [launch.plan_key(x4, qws[0], bias, 1)]
    wt.wq_matmul(x4, qws[1])  # another plan class (no bias), the same tuning class: not tuned again
    assert tunings == [3, 4] and kernel.calls == 3 and len(launch.plans) == 2
    wt.wq_matmul(x, qws[0], bias, config=_cfg(16, 1))
    assert tunings == [3, 4] and kernel.calls == 4 and len(compiled.launches) == 2 and len(launch.plans) == 2
    launch.workspace(x.device, launch.workspace(x.device, 1).numel() + 1)
    assert not launch.plans


def triton_cdiv(a, b):
    return -(-a // b)


@pytest.mark.skipif(DEVICE != "cuda", reason="launch plans keep compiled kernels: CUDA only")
@pytest.mark.parametrize("fmt", ["fp6", "int8", "int4"])
def test_launch_plans_match_the_reference(wt, launch, fmt, monkeypatch):
    """After its first autotuned call, a (shape, M, dtype, alignment) class launches its kept plan
    (`launch.py`'s Note: launch plans): with another weight of the same shape, another x, bias or none, fp16
    and bf16; an x whose rows start 2 bytes off 16-byte alignment is a class of its own. Launching the
    kernel any other way fails once the plan exists, so a passing second call went through the plan."""
    n, k = 200, 384
    qws = [_weight(n, k, fmt, None, seed) for seed in (11, 12)]
    gen = torch.Generator().manual_seed(13)
    for dtype in DTYPES:
        bias = _randn(n, gen=gen, dtype=dtype)
        for m in (1, 5):
            for b in (None, bias):
                wide = _randn(m, k + 1, gen=gen, dtype=dtype)
                for x in (_randn(m, k, gen=gen, dtype=dtype), wide[:, 1:]):
                    _check(wt.wq_matmul(x, qws[0], b), x, qws[0], b)
                    assert launch.plan_key(x, qws[0], b, wt.REDUCE) in launch.plans
                    config = wt.last_config()
                    with monkeypatch.context() as patch:
                        patch.setattr(wt, "_launch", _refuse)
                        for qw in qws:
                            x2 = _randn(*x.shape, gen=gen, dtype=dtype)
                            _check(wt.wq_matmul(x2, qw, b), x2, qw, b)
                    assert wt.last_config() == config
    assert all(int(c.abs().sum()) == 0 for c in launch.counters.values())


@pytest.mark.skipif(DEVICE != "cuda", reason="quantized_matmul runs the reference on CPU")
def test_quantized_matmul_takes_a_strided_bias(wt):
    from lightspeed.ops.wquant import quantized_matmul

    qw = _weight(96, 256, "int8", None, seed=31)
    gen = torch.Generator().manual_seed(32)
    bias = _randn(192, gen=gen, dtype=torch.float16)[::2]
    x = _randn(2, 256, gen=gen, dtype=torch.float16)
    for _ in range(2):  # the second call through the launch plan
        _check(quantized_matmul(x, qw, bias), x, qw, bias)


def _refuse(*args, **kwargs):
    raise AssertionError("the kernel was launched without its plan although one exists")


def _refuse_tuning(*args, **kwargs):
    raise AssertionError("the autotuner tuned again inside a tuned M bucket")


@pytest.mark.skipif(DEVICE != "cuda", reason="the autotuner runs on CUDA only")
def test_prefill_lengths_share_a_tuning(wt, monkeypatch):
    """Above 64 rows the tune key holds M's power-of-two bucket (`tuning.tune_m`): a prompt of a new
    length inside a tuned bucket runs without tuning again (neither the timer nor the disk cache is
    asked), matches the reference, and the next bucket tunes once."""
    qw = _weight(200, 384, "fp6", None, seed=51)
    gen = torch.Generator().manual_seed(52)
    x = _randn(70, 384, gen=gen, dtype=torch.float16)
    _check(wt.wq_matmul(x, qw), x, qw)
    keys = set(wt._tuned)
    with monkeypatch.context() as patch:
        patch.setattr(wt, "_tune", _refuse_tuning)
        for m in (65, 100, 128):
            x = _randn(m, 384, gen=gen, dtype=torch.float16)
            _check(wt.wq_matmul(x, qw), x, qw)
    assert set(wt._tuned) == keys
    x = _randn(129, 384, gen=gen, dtype=torch.float16)
    _check(wt.wq_matmul(x, qw), x, qw)
    assert len(set(wt._tuned) - keys) == 1


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs")
def test_launch_plan_replays_in_a_cuda_graph(wt, launch):
    """A warmed-up call (plan kept) captured in a CUDA graph and replayed with new inputs copied in."""
    qw = _weight(256, 512, "fp6", None, seed=21)
    gen = torch.Generator().manual_seed(22)
    x = _randn(3, 512, gen=gen, dtype=torch.float16)
    wt.wq_matmul(x, qw)
    assert launch.plan_key(x, qw, None, wt.REDUCE) in launch.plans
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        wt.wq_matmul(x, qw)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = wt.wq_matmul(x, qw)
    for _ in range(3):
        x.copy_(_randn(3, 512, gen=gen, dtype=torch.float16))
        graph.replay()
        torch.cuda.synchronize()
        _check(y, x, qw)


@pytest.mark.skipif(DEVICE != "cuda", reason="tunes on the GPU")
def test_tuning_picks_the_fastest_it_timed(wt, monkeypatch, tmp_path):
    """A class's first call times every candidate (the disk cache pointed at an empty directory) over
    rotated weight copies, runs the fastest, and matches the reference; the copies are freed."""
    from lightspeed.ops.wquant import tuning

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(wt, "_tuned", {})
    rotations = []
    monkeypatch.setattr(wt, "rotation_bench", lambda call, copies: rotations.append(copies)
                        or tuning.rotation_bench(call, copies))
    qw = _weight(4000, 4096, "int4", None, seed=71)  # 8 MB: < MAX_COPIES copies
    gen = torch.Generator().manual_seed(72)
    x = _randn(5, 4096, gen=gen, dtype=torch.float16)
    wt.reserve_scratch(x.device, "int4", 4000)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    y = wt.wq_matmul(x, qw)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - before < qw.num_bytes  # y, no copy kept
    _check(y, x, qw)  # (after: its reference's first cuBLAS call may allocate a workspace)
    timings = wt.autotune_timings()
    cands = wt.candidate_configs(5, 4000, 4096, qw.tile, wt.num_sms())
    assert timings is not None and len(timings) == len(cands)
    assert len(rotations) >= len(cands) and set(rotations) == {tuning.rotation_copies(qw.num_bytes)}
    assert rotations[0] > 1
    config = {k: v for k, v in wt.last_config().items() if k != "BLOCK_M"}
    assert wt.describe(config) == min(timings, key=timings.get)
    assert list(tmp_path.rglob("_wq_matmul_kernel.tuning.json"))


@pytest.mark.skipif(DEVICE != "cuda" or torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("fmt", ["fp6", "int4"])
def test_quantized_matmul_on_another_gpu_than_the_current(fmt):
    """Triton launches on the current device: `quantized_matmul` switches to x's device, so tensors on
    cuda:1 while cuda:0 is current give the reference's result (twice: the second through the plan)."""
    from lightspeed.ops.wquant import quantized_matmul

    qw = _weight(96, 256, fmt, None, seed=61).to("cuda:1")
    gen = torch.Generator().manual_seed(62)
    bias = torch.randn(96, generator=gen).to("cuda:1", torch.float16)
    with torch.cuda.device(0):
        for m in (1, 3, 3):
            x = torch.randn(m, 256, generator=gen).to("cuda:1", torch.float16)
            y = quantized_matmul(x, qw, bias)
            torch.cuda.synchronize(1)
            assert y.device == x.device
            _check(y, x, qw, bias)


@pytest.mark.skipif(DEVICE != "cuda" or torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_grad_input_on_another_gpu_than_the_current():
    """The backward's operator (Triton dequantizer + cuBLAS) on cuda:1 while cuda:0 is current."""
    qw = _weight(96, 256, "fp6", None, seed=63).to("cuda:1")
    grad = torch.randn(5, 96, generator=torch.Generator().manual_seed(64)).to("cuda:1", torch.float16)
    args = (grad, list(qw.planes), qw.scales, qw.format, 96, 256, qw.group_size, qw.dtype, qw.tile)
    with torch.cuda.device(0):
        got = torch.ops.lightspeed.quantized_matmul_grad_input(*args)
        torch.cuda.synchronize(1)
    ref = grad.float() @ dequantize(qw, torch.float32)
    assert got.device == grad.device
    torch.testing.assert_close(got.float(), ref, rtol=2e-3, atol=2e-3 * ref.abs().max().item())
