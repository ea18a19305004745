"""engine.compile() on a PipelineModule at ZeRO 0-2: the schedule calls the layers, never the module, so
the layers are what is compiled (the module alone would compile code that never runs)."""

import pytest
import torch
import torch.distributed as dist

import lightspeed
from lightspeed.parallel.pipeline import LayerSpec, PipelineModule


@pytest.fixture(autouse=True)
def no_process_group_left():
    """A PipelineModule's engine initializes a world of one; later tests in this process expect none."""
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _engine(stage: int, compiled: bool):
    torch.manual_seed(0)
    pipe = PipelineModule(layers=[LayerSpec(torch.nn.Linear, 6, 6), torch.nn.Tanh(), LayerSpec(torch.nn.Linear, 6, 3)],
                          num_stages=1, loss_fn=torch.nn.MSELoss())
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": stage}}
    engine, *_ = lightspeed.initialize(model=pipe, config=cfg, model_parameters=pipe.parameters())
    if compiled:
        engine.compile(backend="eager")
    return engine, pipe


@pytest.mark.parametrize("stage", [0, 2])
def test_pipeline_layers_compiled_and_train_the_same(stage):
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(2, 6, generator=g), torch.randn(2, 3, generator=g)) for _ in range(6)]
    losses = {}
    for compiled in (False, True):
        engine, pipe = _engine(stage, compiled)
        layers = [m for m in pipe.children() if isinstance(m, torch.nn.Linear)]
        assert len(layers) == 2
        assert all((m._compiled_call_impl is not None) is compiled for m in layers)
        it = iter(data)
        losses[compiled] = [float(engine.train_batch(data_iter=it)) for _ in range(3)]
    assert losses[True] == pytest.approx(losses[False], abs=1e-6)
