"""Muon (optim/muon.py) through the engine on real gloo processes: at ZeRO stages 0-3 and worlds 1, 2 and 4
(one spawned world per size) a few clipped, accumulated fp32 steps equal a single-process reference
(DeepSpeed's MuonWithAuxAdam written out plainly over whole parameters) within 1e-5, with matrices whose
shards split across ranks; a checkpoint saved at world 2 / ZeRO 2 resumes at world 4 / ZeRO 3 and at
world 1 / ZeRO 0 with its momentum and Adam moments (a resume without them would differ)."""

from __future__ import annotations

import pytest
import torch

from lightspeed.testing.run_world import run_world

pytestmark = [pytest.mark.dist, pytest.mark.timeout(180)]

BATCH, GAS, STEPS, CLIP = 8, 2, 3, 0.5
OPT = {"type": "Muon", "params": {"lr": 0.02, "adam_lr": 0.01, "momentum": 0.9, "weight_decay": 0.1,
                                  "betas": [0.9, 0.99], "eps": 1e-8}}


class _Net(torch.nn.Module):
    """An embedding and a head (Adam), hidden matrices of awkward shapes (Muon), biases and a norm (Adam)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Linear(5, 9, bias=False)  # "embed" in the name: Adam, as DeepSpeed decides
        self.fc1 = torch.nn.Linear(9, 13)
        self.norm = torch.nn.LayerNorm(13)
        self.fc2 = torch.nn.Linear(13, 7)
        self.fc3 = torch.nn.Linear(7, 7, bias=False)
        self.lm_head = torch.nn.Linear(7, 3)

    def forward(self, x, y):
        h = torch.tanh(self.fc1(self.embed(x)))
        h = torch.tanh(self.fc3(torch.tanh(self.fc2(self.norm(h)))))
        return ((self.lm_head(h) - y) ** 2).mean()


def _data():
    g = torch.Generator().manual_seed(5)
    return torch.randn(BATCH * 10, 5, generator=g), torch.randn(BATCH * 10, 3, generator=g)


def _config(stage: int) -> dict:
    return {"train_batch_size": BATCH, "gradient_accumulation_steps": GAS, "gradient_clipping": CLIP,
            "steps_per_print": 1000, "optimizer": OPT,
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 40, "allgather_bucket_size": 40,
                                  "stage3_param_persistence_threshold": 0, "sub_group_size": 60}}


def _train(engine, start: int, steps: int) -> None:
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    micro = BATCH // GAS // world
    x, y = _data()
    for s in range(start, start + steps):
        for a in range(GAS):
            base = s * BATCH + a * (BATCH // GAS) + rank * micro
            loss = engine(x[base:base + micro], y[base:base + micro])
            engine.backward(loss)
            engine.step()


def _params(engine) -> dict:
    return {k: v.detach().clone() for k, v in engine.strategy.module_state_dict().items()}


def _worker(save_dir: str):
    import torch.distributed as dist

    import lightspeed

    world, out = dist.get_world_size(), {}
    for stage in (0, 1, 2, 3):
        engine, *_ = lightspeed.initialize(model=_Net(), config=_config(stage))
        _train(engine, 0, STEPS)
        out[f"z{stage}"] = _params(engine)
        plan = engine.optimizer._plan  # which matrices this rank orthogonalises
        out[f"ns{stage}"] = sorted(m.name for m in plan.matrices if m.ns_rank == dist.get_rank())
        if world == 2 and stage == 2:
            engine.save_checkpoint(save_dir, tag="mid")
    if world > 2 or world == 1:
        for stage in ((3,) if world > 2 else (0,)):
            engine, *_ = lightspeed.initialize(model=_Net(), config=_config(stage))
            engine.load_checkpoint(save_dir, tag="mid")
            opt = engine.optimizer
            moments = [opt.state[p]["momentum_buffer" if g["use_muon"] else "exp_avg"]
                       for g in opt.param_groups for p in g["params"]]
            out[f"loaded{stage}"] = [bool(m.abs().sum() > 0) for m in moments]
            # and nothing else: no momentum on Adam's tensors, no moments on Muon's
            out[f"loaded{stage}"].append(all(("momentum_buffer" in opt.state[p]) != ("exp_avg" in opt.state[p])
                                              for g in opt.param_groups for p in g["params"]))
            _train(engine, STEPS, 1)
            out[f"resumed{stage}"] = _params(engine)
    return out


def _reference(zero_steps: list[bool]) -> dict:
    """DeepSpeed's MuonWithAuxAdam step over whole parameters, written out with the reference iteration:
    at ZeRO 0 the gradients are clipped, then Muon runs; at ZeRO 1-3 (`zero`) Muon runs first and the
    norm and clip take its updates in place of the Muon matrices' gradients. One flag per step."""
    from lightspeed.ops.muon import muon_update

    model = _Net()
    muon = {n for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n and "lm_head" not in n}
    p_ = OPT["params"]
    state: dict = {}
    x, y = _data()
    for s, zero in enumerate(zero_steps):
        model.zero_grad()
        for a in range(GAS):
            base = s * BATCH + a * (BATCH // GAS)
            (model(x[base:base + BATCH // GAS], y[base:base + BATCH // GAS]) / GAS).backward()
        with torch.no_grad():
            if not zero:
                torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            for n, p in model.named_parameters():
                if n in muon:
                    buf = state.setdefault(n, {}).setdefault("m", torch.zeros_like(p))
                    p.grad = muon_update(p.grad.clone(), buf, beta=p_["momentum"], reference=True).reshape(p.shape)
            if zero:
                torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            for n, p in model.named_parameters():
                st = state.setdefault(n, {})
                if n in muon:
                    p.mul_(1 - p_["lr"] * p_["weight_decay"])
                    p.add_(p.grad, alpha=-p_["lr"])
                else:
                    (b1, b2), lr = p_["betas"], p_["adam_lr"]
                    m1, m2 = st.setdefault("m1", torch.zeros_like(p)), st.setdefault("m2", torch.zeros_like(p))
                    st["t"] = st.get("t", 0) + 1
                    m1.lerp_(p.grad, 1 - b1)
                    m2.lerp_(p.grad.square(), 1 - b2)
                    upd = (m1 / (1 - b1 ** st["t"])) / ((m2 / (1 - b2 ** st["t"])).sqrt() + p_["eps"])
                    p.mul_(1 - lr * p_["weight_decay"])
                    p.add_(upd, alpha=-lr)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _close(got: dict, want: dict, what: str):
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, atol=1e-5, rtol=0, msg=lambda m: f"{what} {k}: {m}")


def test_muon_zero_stages_worlds_and_resume(tmp_path):
    want = {zero: _reference([zero] * STEPS) for zero in (False, True)}
    start = _Net().state_dict()
    assert all(not torch.allclose(want[True][k], start[k], atol=1e-4) for k in start)  # every parameter moved
    assert not torch.allclose(want[True]["fc1.weight"], want[False]["fc1.weight"], atol=1e-4)  # the clip matters
    # the checkpoint is saved at ZeRO 2 after STEPS steps; the step after it runs at the resuming stage
    more = {stage: _reference([True] * STEPS + [stage > 0]) for stage in (0, 3)}
    save_dir = str(tmp_path)
    for world in (2, 1, 4):  # world 2 saves the checkpoint the others resume
        results = run_world(_worker, world, save_dir)
        for stage in (0, 1, 2, 3):  # each matrix orthogonalised on exactly one rank
            owned = [name for out in results for name in out[f"ns{stage}"]]
            assert sorted(owned) == ["fc1.weight", "fc2.weight", "fc3.weight"], (world, stage, owned)
        for rank, out in enumerate(results):
            loaded = [v for k, v in out.items() if k.startswith("loaded")]
            assert all(flags and all(flags) for flags in loaded), loaded  # the momentum and moments came back
            for stage in (0, 1, 2, 3):
                _close(out[f"z{stage}"], want[stage > 0], f"world {world} rank {rank} stage {stage}")
            for key in [k for k in out if k.startswith("resumed")]:
                _close(out[key], more[int(key[-1])], f"world {world} rank {rank} {key}")
