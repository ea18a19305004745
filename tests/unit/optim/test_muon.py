"""Muon's pieces without the engine: the Newton-Schulz fast path against the reference (awkward shapes,
both methods, tolerances by dtype), the Gram iteration equal to the standard one in fp64, DeepSpeed's
numbers (compute dtypes, aspect-ratio scale, the inf/nan rule of muon_update), the optimizer's groups,
defaults and config errors, and its step equal to DeepSpeed's formulas written out."""

from __future__ import annotations

import math

import pytest
import torch

from lightspeed.config.errors import ConfigError
from lightspeed.ops.muon import (aspect_ratio_scale, muon_update, newton_schulz, newton_schulz_reference,
                                 ns_compute_dtype)
from lightspeed.optim.factory import build_optimizer
from lightspeed.optim.muon import Muon, tag_muon_params

SHAPES = [(7, 13), (13, 7), (16, 16), (1, 31), (40, 3), (3, 5, 9), (2, 9, 4)]
TOL = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 0.1, torch.float16: 0.02}


@pytest.mark.parametrize("method", ["gram", "standard"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fast_path_matches_reference(method, dtype):
    gen = torch.Generator().manual_seed(0)
    for shape in SHAPES:
        g = torch.randn(shape, generator=gen) * 3
        want = newton_schulz_reference(g, method=method, dtype=dtype)
        got = newton_schulz(g, method=method, dtype=dtype, compile=False)
        assert got.dtype == want.dtype == dtype and got.shape == g.shape
        torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=0, msg=f"{shape} {method}")


def test_gram_is_the_standard_iteration_and_orthogonalises():
    gen = torch.Generator().manual_seed(1)
    for shape in [(6, 20), (20, 6), (5, 5), (3, 4, 11)]:
        g = torch.randn(shape, generator=gen, dtype=torch.float64)
        gram = newton_schulz_reference(g, method="gram", dtype=torch.float64)
        standard = newton_schulz_reference(g, method="standard", dtype=torch.float64)
        torch.testing.assert_close(gram, standard, atol=1e-10, rtol=0)
        # singular values pushed into DeepSpeed's band around 1 (the quintic does not converge to exactly 1)
        s = torch.linalg.svdvals(gram)
        assert s.min() > 0.5 and s.max() < 1.3, s


def test_deepspeeds_numbers():
    assert ns_compute_dtype("gram", "cuda") == torch.float16 and ns_compute_dtype("standard", "cuda") == torch.bfloat16
    assert ns_compute_dtype("standard", "cpu") == torch.bfloat16
    assert aspect_ratio_scale(12, 3) == 2.0 and aspect_ratio_scale(3, 12) == 1.0
    # one step by hand: momentum, Nesterov blend, NS (the reference) and the scale of a tall matrix
    gen = torch.Generator().manual_seed(2)
    grad, buf = torch.randn(12, 3, generator=gen), torch.randn(12, 3, generator=gen)
    m = buf.lerp(grad, 0.05)
    want = newton_schulz_reference(grad.lerp(m, 0.95), method="gram") * 2.0
    got = muon_update(grad.clone(), buf, beta=0.95, reference=True)
    torch.testing.assert_close(buf, m)
    # in the gradient's dtype; the iteration's own is fp16 on a CPU whose oneDNN has fp16, else fp32
    torch.testing.assert_close(got, want.to(got.dtype))
    # a non-finite gradient leaves the momentum and comes back as the update (the step is then skipped)
    bad = grad.clone()
    bad[0, 0] = float("inf")
    kept = buf.clone()
    assert not torch.isfinite(muon_update(bad, buf, reference=True)).all()
    assert torch.equal(buf, kept)


def _model():
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"embed_tokens": torch.nn.Embedding(10, 6), "fc": torch.nn.Linear(6, 8),
                                 "conv": torch.nn.Conv2d(2, 3, 2), "lm_head": torch.nn.Linear(8, 10)})
    tag_muon_params(model)
    return model


def test_groups_defaults_and_tags():
    model = _model()
    assert {n for n, p in model.named_parameters() if p.use_muon} == {"fc.weight", "conv.weight"}
    opt = build_optimizer({"type": "muon", "params": {"lr": 0.1, "muon_lr": 0.05, "weight_decay": 0.01}},
                          [{"params": list(model.parameters()), "weight_decay": 0.0}])
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    assert groups == [
        {"use_muon": True, "name": "muon-params", "lr": 0.05, "momentum": 0.95, "weight_decay": 0.0,
         "ns_method": "gram"},
        {"use_muon": False, "name": "adam-params", "lr": 0.1, "betas": (0.9, 0.95), "eps": 1e-10,
         "weight_decay": 0.0}]


@pytest.mark.parametrize("params, match", [
    ({"ns_method": "svd"}, "optimizer.params.ns_method"),
    ({"per_head_muon": True}, "optimizer.params.per_head_muon"),
    ({"momentum": 1.5}, "optimizer.params.momentum"),
    ({"nesterov": False}, "optimizer.params.nesterov"),
])
def test_config_errors(params, match):
    with pytest.raises(ConfigError, match=match):
        build_optimizer({"type": "Muon", "params": params}, list(_model().parameters()))


def test_untagged_parameters_and_offload_are_refused():
    with pytest.raises(ConfigError, match="use_muon"):
        build_optimizer({"type": "Muon"}, [torch.nn.Parameter(torch.zeros(3, 3))])
    with pytest.raises(ConfigError, match="offload_optimizer"):
        build_optimizer({"type": "Muon"}, list(_model().parameters()), cpu_offload=True)


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_step_is_deepspeeds(adam_w_mode):
    """Two steps of Muon over whole parameters against DeepSpeed's formulas written out."""
    model = _model()
    ref = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = build_optimizer({"type": "Muon", "params": {"lr": 0.05, "adam_lr": 0.01, "weight_decay": 0.1,
                                                      "adam_w_mode": adam_w_mode}}, list(model.parameters()))
    state: dict = {}
    for step in range(1, 3):
        gen = torch.Generator().manual_seed(step)
        grads = {n: torch.randn(p.shape, generator=gen) for n, p in model.named_parameters()}
        for n, p in model.named_parameters():
            p.grad = grads[n].clone()
        opt.step()
        for n, p in model.named_parameters():
            g, st = grads[n], state.setdefault(n, {})
            if p.use_muon:
                buf = st.setdefault("m", torch.zeros_like(g))
                buf.lerp_(g, 0.05)
                u = g.lerp(buf, 0.95)
                shape = u.shape
                o = newton_schulz_reference(u.reshape(len(u), -1), method="gram")
                o = o * aspect_ratio_scale(shape[-2], shape[-1])
                ref[n] = ref[n] * (1 - 0.05 * 0.1) - 0.05 * o.reshape(shape)
            else:
                g = g if adam_w_mode else g + 0.1 * ref[n]
                m1, m2 = st.setdefault("m1", torch.zeros_like(g)), st.setdefault("m2", torch.zeros_like(g))
                m1.lerp_(g, 0.1)
                m2.lerp_(g * g, 0.05)
                upd = (m1 / (1 - 0.9 ** step)) / ((m2 / (1 - 0.95 ** step)).sqrt() + 1e-10)
                decay = 1 - 0.01 * 0.1 if adam_w_mode else 1.0
                ref[n] = ref[n] * decay - 0.01 * upd
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), ref[n], atol=1e-5, rtol=0, msg=n)
    assert math.isclose(opt.state[model["fc"].weight]["momentum_buffer"].norm().item(),
                        state["fc.weight"]["m"].norm().item(), rel_tol=1e-6)


def test_direct_use_needs_use_muon_groups():
    with pytest.raises(ValueError, match="use_muon"):
        Muon([{"params": [torch.nn.Parameter(torch.zeros(2, 2))]}])


def test_fast_path_traces_whole_for_torch_compile():
    """The CUDA path compiles `_ns_fast`; it must trace without graph breaks (checked here without a
    compiler backend's code generation)."""
    from lightspeed.ops.muon.newton_schulz import _ns_fast

    torch._dynamo.reset()
    traced = torch.compile(_ns_fast, dynamic=False, backend="aot_eager", fullgraph=True)
    g = torch.randn(6, 15, generator=torch.Generator().manual_seed(3))
    for method in ("gram", "standard"):
        torch.testing.assert_close(traced(g, 5, method, torch.float32),
                                   newton_schulz_reference(g, method=method, dtype=torch.float32), atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["MuAdam", "MuAdamW", "musgd"])
def test_mup_optimizers(name, monkeypatch):
    """mup's optimizers are mup's functions over the groups and params; without mup, an error naming it."""
    import sys
    import types

    monkeypatch.setitem(sys.modules, "mup", None)  # not importable
    with pytest.raises(ConfigError, match=r"optimizer.type: Mu.* needs the `mup` package"):
        build_optimizer({"type": name, "params": {"lr": 0.1}}, list(_model().parameters()))
    calls = []
    fake = types.ModuleType("mup")
    for cls_name, base in (("MuAdam", torch.optim.Adam), ("MuAdamW", torch.optim.AdamW), ("MuSGD", torch.optim.SGD)):
        setattr(fake, cls_name, lambda groups, _b=base, _n=cls_name, **kw: calls.append(_n) or _b(groups, **kw))
    monkeypatch.setitem(sys.modules, "mup", fake)
    opt = build_optimizer({"type": name, "params": {"lr": 0.1, "weight_decay": 0.01}}, list(_model().parameters()))
    assert calls == [{"muadam": "MuAdam", "muadamw": "MuAdamW", "musgd": "MuSGD"}[name.lower()]]
    assert opt.param_groups[0]["lr"] == 0.1 and opt.param_groups[0]["weight_decay"] == 0.01
    with pytest.raises(ConfigError, match="optimizer.params.lr"):
        build_optimizer({"type": name, "params": {"lr": -1}}, list(_model().parameters()))


def test_deepspeed_names():
    """DeepSpeed's Muon modules (lightspeed.compat's `deepspeed.runtime.zero.muon`) step as lightspeed's Muon."""
    from lightspeed.compat.deepspeed.runtime.zero.muon import muon_optimizer, original_muon

    gen = torch.Generator().manual_seed(4)
    g = torch.randn(9, 4, generator=gen)
    torch.testing.assert_close(original_muon.zeropower_via_gram_newtonschulz(g, 5),
                               newton_schulz_reference(g, method="gram"), atol=1e-5, rtol=0)
    with pytest.raises(NotImplementedError, match="per_head_muon"):
        original_muon.muon_update(g, torch.zeros_like(g), num_heads=3)
    a, b = _model(), _model()
    ours = build_optimizer({"type": "Muon", "params": {"lr": 0.02}}, list(a.parameters()))
    groups = [{"params": [p for p in b.parameters() if p.use_muon], "use_muon": True, "lr": 0.02},
              {"params": [p for p in b.parameters() if not p.use_muon], "use_muon": False, "lr": 0.02}]
    theirs = muon_optimizer.MuonWithAuxAdam(groups, adam_optimizer=None)
    for pa, pb in zip(a.parameters(), b.parameters()):
        pa.grad = pb.grad = torch.randn(pa.shape, generator=gen)
    ours.step()
    theirs.step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb)
    plain = original_muon.Muon([torch.nn.Parameter(torch.ones(3, 5))], lr=0.1)
    assert plain.param_groups[0]["use_muon"] and plain.param_groups[0]["lr"] == 0.1


def test_before_norm_under_a_loss_scale():
    """ZeRO 1-3's order: the update takes the gradient's place, carrying the loss scale the norm and the
    unscale expect; the momentum takes the unscaled gradient."""
    from lightspeed.comm.collectives import Communicator
    from lightspeed.zero.fragments import Fragment

    def attached():
        model = _model()
        opt = build_optimizer({"type": "Muon"}, list(model.parameters()))
        frags = [Fragment(n, tuple(p.shape), 0, p.numel(), p, 0) for n, p in model.named_parameters()]
        opt.attach(frags, Communicator(None, 1), update_before_clip=True)
        return model, opt

    gen = torch.Generator().manual_seed(6)
    (a, opt_a), (b, opt_b) = attached(), attached()
    grads = {n: torch.randn(p.shape, generator=gen) for n, p in a.named_parameters()}
    scaled = {p: grads[n] * 128 for n, p in a.named_parameters()}
    plain = {p: grads[n].clone() for n, p in b.named_parameters()}
    opt_a.before_norm(scaled, 128.0)
    opt_b.before_norm(plain, None)
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(scaled[pa] / 128, plain[pb], msg=n)
        if pa.use_muon:
            torch.testing.assert_close(opt_a.state[pa]["momentum_buffer"], opt_b.state[pb]["momentum_buffer"])
            assert not torch.allclose(plain[pb], grads[n])  # the update, not the gradient
        else:
            torch.testing.assert_close(plain[pb], grads[n])  # Adam's gradients untouched
