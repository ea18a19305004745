"""accelerate's DeepSpeed path on lightspeed registered as `deepspeed` (2 gloo processes, CPU):
`Accelerator(deepspeed_plugin=DeepSpeedPlugin(...))` training loops at ZeRO-2 and ZeRO-3 with
gradient accumulation against plain PyTorch on the same global batches, `save_state` / `load_state`,
and `get_state_dict`. Registration happens inside the spawned ranks only."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from lightspeed.testing.models import TinyMLP, regression_data
from lightspeed.testing.run_world import run_world

pytestmark = [pytest.mark.no_real_deepspeed, pytest.mark.dist, pytest.mark.slow, pytest.mark.timeout(400)]

GAS, MICRO, LR = 2, 2, 1e-2


def _gathered(t: torch.Tensor) -> torch.Tensor:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return torch.stack(out)


def _train(accelerator, model, optimizer, loader, reference, ref_opt, windows: int):
    """`windows` accumulation windows; each micro-step's global mean loss from the engine and from the
    plain-PyTorch reference stepping on the same global batch (every rank's micro-batch)."""
    got, ref = [], []
    it = iter(loader)
    for _ in range(windows * GAS):
        x, y = next(it)
        with accelerator.accumulate(model):
            loss = model(x, y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        got.append(float(_gathered(loss.detach()).mean()))
        xs, ys = _gathered(x), _gathered(y)
        ref_loss = torch.stack([reference(xr, yr) for xr, yr in zip(xs, ys)]).mean()
        (ref_loss / GAS).backward()
        ref.append(float(ref_loss))
        if accelerator.sync_gradients:
            torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
            ref_opt.step()
            ref_opt.zero_grad()
    return got, ref


def _worker(stage: int, save_dir: str):
    import lightspeed

    lightspeed.register_as_deepspeed()
    from accelerate import Accelerator, PartialState
    from accelerate.utils import DeepSpeedPlugin

    plugin = DeepSpeedPlugin(zero_stage=stage, gradient_accumulation_steps=GAS, gradient_clipping=1.0,
                             zero3_save_16bit_model=True)
    # On a machine without CUDA, accelerate counts processes only in its CPU mode, which it enters when
    # the process state is made with cpu=True first (what transformers' TrainingArguments(use_cpu=True)
    # does); `Accelerator(cpu=True)` itself would turn DeepSpeed off.
    PartialState(cpu=True)
    accelerator = Accelerator(deepspeed_plugin=plugin)
    assert accelerator.num_processes == dist.get_world_size()
    model, reference = TinyMLP(), TinyMLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    ref_opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=LR)
    x, y = regression_data(MICRO * GAS * 2 * 6)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=MICRO)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    got, ref = _train(accelerator, model, optimizer, loader, reference, ref_opt, windows=2)

    accelerator.save_state(save_dir)
    after_save, _ = _train(accelerator, model, optimizer, loader, reference, ref_opt, windows=1)
    accelerator.load_state(save_dir)  # back to the saved weights, optimizer state and step count
    replayed, _ = _train(accelerator, model, optimizer, loader, reference, ref_opt, windows=1)

    state = accelerator.get_state_dict(model)
    expected = {n: p.detach().clone() for n, p in model.module.named_parameters()}
    if stage == 3:
        from lightspeed.zero import GatheredParameters

        for n, p in model.module.named_parameters():
            with GatheredParameters(p):
                expected[n] = p.detach().clone()
    return {"got": got, "ref": ref, "after_save": after_save, "replayed": replayed,
            "state": {k: v.clone() for k, v in state.items()} if state is not None else None,
            "expected": expected, "engine": type(model).__name__, "files": sorted(os.listdir(save_dir))}


@pytest.mark.parametrize("stage", [2, 3])
def test_accelerate_deepspeed_plugin_loop(stage, tmp_path):
    results = run_world(_worker, 2, stage, str(tmp_path / "state"))
    for rank, r in enumerate(results):
        # fp32 everywhere: the sharded step equals plain PyTorch up to reduction order
        assert r["got"] == pytest.approx(r["ref"], rel=1e-5), rank
        assert r["replayed"] == r["after_save"], rank
        assert r["engine"] == "LightspeedEngine"
    state, expected = results[0]["state"], results[0]["expected"]
    assert set(expected) <= set(state)
    for name, value in expected.items():
        assert state[name].shape == value.shape and torch.equal(state[name], value), name
