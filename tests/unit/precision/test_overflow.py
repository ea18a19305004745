"""Overflow check: inf / -inf / NaN found anywhere, in every float dtype, at awkward sizes; no false alarms."""

import pytest
import torch

from lightspeed.precision.overflow import flat_has_inf_or_nan, has_inf_or_nan

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
SIZES = [1, 3, 7, 127, 1000, 4099]
BAD = [float("inf"), float("-inf"), float("nan")]


def flag(t):
    assert isinstance(t, torch.Tensor) and t.dim() == 0 and t.dtype == torch.float32
    return t.item()


def tensors(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g).to(dtype) for n in SIZES]


@pytest.mark.parametrize("dtype", DTYPES)
def test_finite_is_clean(dtype):
    ts = tensors(dtype)
    assert flag(has_inf_or_nan(ts)) == 0.0
    for t in ts:
        assert flag(flat_has_inf_or_nan(t)) == 0.0


@pytest.mark.parametrize("dtype", DTYPES)
def test_largest_finite_values_are_not_overflow(dtype):
    # fp16's max squared is inf in fp16: a norm-based check would raise a false alarm here.
    big = torch.full((513,), torch.finfo(dtype).max, dtype=dtype)
    big[::2] *= -1
    assert flag(has_inf_or_nan([big, big.clone()])) == 0.0
    assert flag(flat_has_inf_or_nan(big)) == 0.0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", BAD)
def test_each_position_is_found(dtype, bad):
    for which in range(len(SIZES)):
        n = SIZES[which]
        for pos in sorted({0, n // 2, n - 1}):
            ts = tensors(dtype, seed=which)
            ts[which][pos] = bad
            assert flag(has_inf_or_nan(ts)) == 1.0, (which, pos)
            assert flag(flat_has_inf_or_nan(ts[which])) == 1.0, (which, pos)
            assert flag(flat_has_inf_or_nan(torch.cat(ts))) == 1.0


@pytest.mark.parametrize("bad", BAD)
def test_mixed_dtypes_none_and_empty(bad):
    ts = [torch.randn(5).half(), None, torch.empty(0), torch.randn(3, 4).bfloat16(), torch.empty(0, 3).half(),
          torch.randn(17)]
    assert flag(has_inf_or_nan(ts)) == 0.0
    ts[3][2, 1] = bad
    assert flag(has_inf_or_nan(ts)) == 1.0


def test_non_contiguous_and_multidim():
    x = torch.randn(33, 65, dtype=torch.float16).t()
    assert not x.is_contiguous()
    assert flag(has_inf_or_nan([x])) == 0.0
    assert flag(flat_has_inf_or_nan(x)) == 0.0
    x[64, 32] = float("nan")
    assert flag(has_inf_or_nan([x])) == 1.0
    assert flag(flat_has_inf_or_nan(x)) == 1.0


def test_empty_inputs():
    assert flag(has_inf_or_nan([])) == 0.0
    assert flag(has_inf_or_nan(iter([]))) == 0.0
    assert flag(has_inf_or_nan([None, torch.empty(0, dtype=torch.float16)])) == 0.0
    for dtype in DTYPES:
        assert flag(flat_has_inf_or_nan(torch.empty(0, dtype=dtype))) == 0.0
    assert has_inf_or_nan([], device="cpu").device.type == "cpu"


def test_flag_stays_a_tensor_for_all_reduce():
    out = has_inf_or_nan([torch.randn(4)])
    assert out.device.type == "cpu" and out.shape == ()
    combined = torch.maximum(out, has_inf_or_nan([torch.tensor([float("inf")])]))  # what a MAX all-reduce does
    assert combined.item() == 1.0


def test_generator_input_and_many_tensors():
    ts = [torch.randn(3) for _ in range(500)]
    ts[-1][1] = float("nan")
    assert flag(has_inf_or_nan(t for t in ts)) == 1.0


def test_integer_tensors_are_rejected():
    with pytest.raises(TypeError):
        has_inf_or_nan([torch.ones(3, dtype=torch.int64)])
    with pytest.raises(TypeError):
        flat_has_inf_or_nan(torch.ones(3, dtype=torch.int32))
