"""The float8 section and the conversion of linear layers to torchao's float8 training linears."""

from __future__ import annotations

import sys

import pytest
import torch

from lightspeed.config import ConfigError, load
from lightspeed.precision.float8 import convert_to_float8

torchao = pytest.importorskip("torchao.float8", reason="the float8 extra (torchao) is not installed")
from torchao.float8.float8_linear import Float8Linear  # noqa: E402


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(32, 64)
        self.odd = torch.nn.Linear(64, 24)  # 24 is not a multiple of 16: stays high precision
        self.down = torch.nn.Linear(24, 32)
        self.lm_head = torch.nn.Linear(32, 48, bias=False)

    def forward(self, x):
        return self.lm_head(self.down(self.odd(self.up(x))))


def section(**kw):
    return load({"train_batch_size": 1, "float8": kw}, world_size=1).float8


def test_converts_qualifying_linears_and_keeps_their_parameters():
    net = Net()
    params = {name: p for name, p in net.named_parameters()}
    converted = convert_to_float8(net, section(enabled=True, filter_fqns=["lm_head"], emulate=True))
    assert converted == ["up"]
    assert isinstance(net.up, Float8Linear)
    assert type(net.odd) is torch.nn.Linear and type(net.down) is torch.nn.Linear  # 24: not a multiple of 16
    assert type(net.lm_head) is torch.nn.Linear  # filtered by name
    assert all(p is params[name] for name, p in net.named_parameters())  # the same Parameter objects


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_recipes_train_in_emulation(recipe):
    torch.manual_seed(0)
    net = Net().to(torch.bfloat16)
    ref = Net().to(torch.bfloat16)
    ref.load_state_dict(net.state_dict())
    convert_to_float8(net, section(enabled=True, recipe=recipe, emulate=True))
    x = torch.randn(8, 32, dtype=torch.bfloat16)
    out, want = net(x), ref(x)
    out.float().square().mean().backward()
    assert net.up.weight.grad is not None and torch.isfinite(net.up.weight.grad).all()
    assert (out.float() - want.float()).abs().max() < 0.1 * want.float().abs().max()  # float8 rounding only


def test_disabled_is_a_no_op():
    net = Net()
    assert convert_to_float8(net, section()) == []
    assert not any(isinstance(m, Float8Linear) for m in net.modules())


def test_missing_torchao_names_the_key(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # import fails as if not installed
    with pytest.raises(ImportError, match=r"float8\.enabled needs torchao.*lightspeed\[float8\].*torchao=="):
        convert_to_float8(Net(), section(enabled=True))


def test_bad_recipe_and_unknown_key_are_config_errors():
    with pytest.raises(ConfigError, match=r'float8\.recipe: must be "tensorwise", "rowwise" or "rowwise_with_gw_hp"'):
        section(enabled=True, recipe="delayed")
    with pytest.raises(ConfigError, match=r"float8\.filter_fqn: unknown key"):
        section(enabled=True, filter_fqn=["x"])


def _scaled_mm_device() -> str | None:
    """A device where torch._scaled_mm runs: CUDA of compute capability 8.9+, else the CPU when this
    torch build has the CPU kernel (2.13 has; older builds do not), else None."""
    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9):
        return "cuda"
    a = torch.ones(16, 16).to(torch.float8_e4m3fn)
    one = torch.ones((), dtype=torch.float32)
    try:
        torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError):
        return None
    return "cpu"


SCALED_MM_DEVICE = _scaled_mm_device()


@pytest.mark.skipif(SCALED_MM_DEVICE is None, reason="the float8 matmul (torch._scaled_mm) needs a CUDA GPU of "
                    "compute capability 8.9+, or a torch build with its CPU kernel (not this one)")
def test_float8_matmul():
    """The real float8 path (no emulation): torch._scaled_mm forward and backward."""
    torch.manual_seed(0)
    device = SCALED_MM_DEVICE
    net = Net().to(device, torch.bfloat16)
    ref = Net().to(device, torch.bfloat16)
    ref.load_state_dict(net.state_dict())
    convert_to_float8(net, section(enabled=True, filter_fqns=["lm_head"]))
    x = torch.randn(64, 32, device=device, dtype=torch.bfloat16)
    out, want = net(x), ref(x)
    out.float().sum().backward()
    assert torch.isfinite(net.up.weight.grad).all()
    assert (out.float() - want.float()).abs().max() < 0.1 * want.float().abs().max()
