"""A DeepSpeed checkpoint, read by DeepSpeedCheckpointSource into plain PyTorch (the model, AdamW with the
read moments and step), continues with the losses DeepSpeed itself had after the save, on the same data.
The first loss checks the masters, the later ones the optimizer state, groups, hyperparameters and (with
WarmupLR) the scheduler's state."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from lightspeed.checkpoint.deepspeed_format import DeepSpeedCheckpointSource

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "deepspeed"


def _fixture_module():
    spec = importlib.util.spec_from_file_location("ds_make_fixtures", FIXTURES / "make_fixtures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _fp32_cases():
    out = []
    for path in sorted(FIXTURES.iterdir()):
        if (path / "expected.json").is_file():
            exp = json.loads((path / "expected.json").read_text())
            if exp["dtype"] == "fp32":
                out.append(path.name)
    return out


def _warmup_lr(params: dict, last_batch_iteration: int) -> float:
    """DeepSpeed's WarmupLR (linear) at an iteration."""
    gamma = min(1.0, last_batch_iteration / params["warmup_num_steps"])
    return params["warmup_min_lr"] + (params["warmup_max_lr"] - params["warmup_min_lr"]) * gamma


@pytest.mark.parametrize("case", _fp32_cases())
def test_plain_pytorch_continues_with_deepspeeds_losses(case):
    exp = json.loads((FIXTURES / case / "expected.json").read_text())
    src = DeepSpeedCheckpointSource(FIXTURES / case / "ckpt")
    fixtures = _fixture_module()
    torch.manual_seed(0)
    model = fixtures.build_model()
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, tensor in src.module_state().items():
            if name in model.state_dict() and name not in src.param_names() and tensor.numel():
                model.state_dict()[name].copy_(tensor)
        for name in src.param_names():
            params[name].copy_(src.read(name))
    groups = []
    for g in src.optimizer_groups():
        hyper = {k: g[k] for k in ("lr", "betas", "eps", "weight_decay")}
        groups.append({"params": [params[n] for n in g["names"]], **hyper})
    opt = torch.optim.AdamW(groups)
    for g in src.optimizer_groups():
        for n in g["names"]:
            opt.state[params[n]] = {"step": torch.tensor(float(g["scalars"]["step"])),
                                    "exp_avg": src.read(n, "exp_avg"), "exp_avg_sq": src.read(n, "exp_avg_sq")}
    world = exp["world_size"]
    for step, (batches, want) in enumerate(zip(exp["next_batches"], exp["next_losses"])):
        got = []
        for rank in range(world):
            loss = model(torch.tensor(batches[rank]))
            (loss / world).backward()  # DeepSpeed averages gradients over the data-parallel ranks
            got.append(loss.item())
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6), (case, step)
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
        if exp["scheduler"] == "WarmupLR":  # DeepSpeed steps the optimizer, then the scheduler
            lr = _warmup_lr(exp["config"]["scheduler"]["params"],
                            src.extra()["lr_scheduler"]["last_batch_iteration"] + step)
            assert step > 0 or lr == pytest.approx(src.optimizer_groups()[0]["lr"])
            for group in opt.param_groups:
                group["lr"] = lr
        opt.step()
        opt.zero_grad()
