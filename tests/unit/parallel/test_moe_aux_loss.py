"""The MoE aux loss carried along the activations (parallel/experts/aux_loss.py): inside
`aux_loss_scale(s)`, a layer with `aux_loss_coeff` c gives every parameter the gradient of
s x (task loss + c x l_aux) from a backward of s x task loss alone, at a loss-scale-like s and with
residual MoE; the output and l_aux are unchanged; outside the context training raises, evaluation and
no-grad forwards do not; bad coefficients are refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightspeed.parallel.experts import MoE, MoEArgumentError
from lightspeed.parallel.experts.aux_loss import active_aux_loss_scale, aux_loss_scale

D = 6


def _moe(coeff, **kwargs) -> MoE:
    torch.manual_seed(0)
    expert = nn.Sequential(nn.Linear(D, 8), nn.GELU(), nn.Linear(8, D))
    return MoE(D, expert, num_experts=4, k=1, min_capacity=0, use_rts=False, aux_loss_coeff=coeff, **kwargs)


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("residual", [False, True])
def test_attached_aux_loss_gradient_is_coeff_times_the_micro_batch_scale(residual):
    coeff, scale = 0.3, 1024.0 / 4  # a loss scale over four accumulated micro-batches
    x = torch.randn(3, 5, D, generator=torch.Generator().manual_seed(1))
    target = torch.randn(3, 5, D, generator=torch.Generator().manual_seed(2))

    reference = _moe(None, use_residual=residual)
    out, l_aux, _ = reference(x)
    ((torch.nn.functional.mse_loss(out, target) + coeff * l_aux) * scale).backward()
    want = _grads(reference)

    attached = _moe(coeff, use_residual=residual)
    xin = x.clone().requires_grad_()
    with aux_loss_scale(scale):
        out2, l_aux2, _ = attached(xin)
        (torch.nn.functional.mse_loss(out2, target) * scale).backward()
    assert active_aux_loss_scale() is None
    torch.testing.assert_close(out2, out, rtol=0, atol=0)
    torch.testing.assert_close(l_aux2, l_aux, rtol=0, atol=0)
    got = _grads(attached)
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)
    gate = "deepspeed_moe.gate.wg.weight"
    without = _moe(0.0, use_residual=residual)
    with aux_loss_scale(scale):
        (torch.nn.functional.mse_loss(without(x)[0], target) * scale).backward()
    assert not torch.allclose(without.get_parameter(gate).grad, got[gate])  # the aux term is really there


def test_outside_the_pipeline_context():
    layer = _moe(0.1)
    x = torch.randn(4, D)
    with pytest.raises(RuntimeError, match=r"aux_loss_coeff=0.1 adds the aux loss only inside a PipelineEngine"):
        layer(x)
    with torch.no_grad():
        layer(x)  # no gradient: nothing to attach
    layer.eval()
    layer(x)
    _moe(None)(x)  # DeepSpeed's way: the caller adds l_aux


@pytest.mark.parametrize("bad", [-0.1, True, "0.1", float("nan")])
def test_bad_coefficient_refused(bad):
    with pytest.raises(MoEArgumentError, match="aux_loss_coeff must be None or a number >= 0"):
        _moe(bad)
