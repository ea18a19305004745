"""QuantizedLinear: from_linear (nn.Linear and transformers Conv1D), forward vs the dequantized weight,
dequantize_weight dtype, state_dict round trip, dtype casts leaving scales alone, bad input."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from lightspeed.inference import QuantizedLinear

CASES = [("fp6", None), ("int8", None), ("int4", None), ("int4", 32), ("int8", 64)]


def _linear(k=64, n=24, bias=True, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return nn.Linear(k, n, bias=bias).to(dtype)


@pytest.mark.parametrize("fmt,group_size", CASES)
@pytest.mark.parametrize("bias", [True, False])
def test_forward_matches_dequantized_linear(fmt, group_size, bias):
    lin = _linear(bias=bias)
    q = QuantizedLinear.from_linear(lin, weight=fmt, group_size=group_size)
    w = q.dequantize_weight()
    assert w.shape == lin.weight.shape and w.dtype == lin.weight.dtype
    rel = ((w - lin.weight).norm() / lin.weight.norm()).item()
    assert 0 < rel < {"fp6": 0.06, "int8": 0.01, "int4": 0.2}[fmt]
    x = torch.randn(2, 5, 64)
    torch.testing.assert_close(q(x), nn.functional.linear(x, w, lin.bias))


@pytest.mark.parametrize("fmt", ["fp6", "int8", "int4"])
def test_in_features_not_a_multiple_of_the_tile(fmt):
    lin = _linear(k=40, n=6)
    q = QuantizedLinear.from_linear(lin, weight=fmt)
    assert q.qweight.shape[:2] == (1, 1)  # one row group (N padded to 32) x one K-tile (K padded to 128)
    x = torch.randn(3, 40)
    torch.testing.assert_close(q(x), nn.functional.linear(x, q.dequantize_weight(), lin.bias))
    fresh = QuantizedLinear(40, 6, weight=fmt, dtype=torch.float32)
    fresh.load_state_dict(q.state_dict())
    assert torch.equal(fresh.dequantize_weight(), q.dequantize_weight())


def test_state_dict_round_trip_and_casts():
    lin = _linear(dtype=torch.bfloat16)
    q = QuantizedLinear.from_linear(lin, weight="fp6")
    assert q.dequantize_weight().dtype == torch.bfloat16
    fresh = QuantizedLinear(64, 24, bias=True, weight="fp6", dtype=torch.bfloat16)
    fresh.load_state_dict(q.state_dict())
    assert torch.equal(fresh.dequantize_weight(), q.dequantize_weight())
    assert set(q.state_dict()) == {"qweight", "scales", "bias", "layout_version"}
    before = q.scales.clone()
    q.half()  # casts the bias, never the scales (stored as fp16 bits)
    assert torch.equal(q.scales, before) and q.bias.dtype == torch.float16
    x = torch.randn(3, 64, dtype=torch.float16)
    assert q(x).dtype == torch.float16
    q.to("cpu")
    assert q.qweight.device.type == "cpu"


def test_packed_view_follows_the_buffers():
    """`quantized_weight` is made once per buffers (an eager decode step is bound by the host) and always
    shows the current ones: after load_state_dict (in place), an in-place scale change, a deepcopy, and
    buffers replaced outright."""
    import copy

    q = QuantizedLinear.from_linear(_linear(seed=1), weight="int8")
    other = QuantizedLinear.from_linear(_linear(seed=2), weight="int8")
    assert q.quantized_weight() is q.quantized_weight()
    q.load_state_dict(other.state_dict())
    assert torch.equal(q.dequantize_weight(), other.dequantize_weight())
    twin = copy.deepcopy(q)
    q.scales.copy_((q.scales_fp16 * 2).view(torch.int16))
    assert torch.equal(q.dequantize_weight(), 2 * other.dequantize_weight())
    assert torch.equal(twin.dequantize_weight(), other.dequantize_weight())
    twin.scales_fp16.mul_(4)
    assert torch.equal(twin.dequantize_weight(), 4 * other.dequantize_weight())
    q.qweight = other.qweight.clone()
    q.scales = other.scales.clone()
    assert torch.equal(q.dequantize_weight(), other.dequantize_weight())
    x = torch.randn(3, 64)
    torch.testing.assert_close(q(x), other(x))
    del q.__dict__["_packed_view"]  # as a module pickled before the view was kept
    torch.testing.assert_close(q(x), other(x))


def test_conv1d_weight_is_transposed():
    transformers = pytest.importorskip("transformers")
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(1)
    conv = Conv1D(24, 64)  # nf=24 outputs, nx=64 inputs, weight [64, 24]
    nn.init.normal_(conv.weight, std=0.05)
    nn.init.normal_(conv.bias, std=0.05)
    q = QuantizedLinear.from_linear(conv, weight="int8")
    assert (q.in_features, q.out_features) == (64, 24)
    x = torch.randn(4, 64)
    torch.testing.assert_close(q(x), x @ q.dequantize_weight().T + conv.bias)
    assert ((q(x) - conv(x)).norm() / conv(x).norm()).item() < 0.02
    assert transformers is not None


def test_bad_input():
    with pytest.raises(ValueError, match="nn.Linear or transformers Conv1D"):
        QuantizedLinear.from_linear(nn.Conv2d(3, 3, 1))
    with pytest.raises(ValueError, match="multiple of 16"):
        QuantizedLinear.from_linear(nn.Linear(40, 8), weight="fp6", group_size=20)
    with pytest.raises(ValueError, match="does not divide"):
        QuantizedLinear.from_linear(nn.Linear(64, 8), weight="int4", group_size=48)
    q = QuantizedLinear.from_linear(nn.Linear(64, 8), weight="int4")
    with pytest.raises(ValueError, match="K=64"):
        q(torch.randn(2, 32))


def test_state_dict_of_another_layout_is_refused():
    q = QuantizedLinear.from_linear(torch.nn.Linear(64, 8), weight="fp6")
    state = q.state_dict()
    state["layout_version"] = torch.tensor(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="layout version 2"):
        QuantizedLinear(64, 8, weight="fp6").load_state_dict(state)
    del state["layout_version"]
    with pytest.raises(ValueError, match="layout version none"):
        QuantizedLinear(64, 8, weight="fp6").load_state_dict(state)
