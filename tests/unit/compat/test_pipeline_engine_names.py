"""DeepSpeed's PipelineEngine methods Megatron-DeepSpeed calls, on a one-stage pipeline in one process:
`set_batch_fn` (each micro-batch post-processed as it is read), `set_has_attention_mask` (a checked
flag: bool activations travel as bool), `reset_activation_shape` (the next batch is probed again), and
the refused `set_train_micro_batch_size`."""

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


def test_batch_fn_attention_mask_flag_and_shape_reset():
    torch.manual_seed(0)
    pipe = PipelineModule(layers=[LayerSpec(torch.nn.Linear, 6, 3)], num_stages=1, loss_fn=torch.nn.MSELoss())
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 10**9,
           "optimizer": {"type": "SGD", "params": {"lr": 0.0}}}
    engine, *_ = lightspeed.initialize(model=pipe, config=cfg, model_parameters=pipe.parameters())
    g = torch.Generator().manual_seed(1)
    raw = [(torch.randn(2, 6, generator=g), torch.randn(2, 3, generator=g)) for _ in range(2)]
    seen = []

    def negate_labels(batch):
        seen.append(batch)
        return batch[0], -batch[1]

    engine.set_batch_fn(negate_labels)
    loss = engine.train_batch(data_iter=iter(raw))
    with torch.no_grad():
        want = sum(torch.nn.functional.mse_loss(pipe(x), -y) for x, y in raw) / 2
    assert len(seen) == 2 and float(loss) == pytest.approx(float(want), rel=1e-6)

    assert engine.has_attention_mask is False
    engine.set_has_attention_mask(True)
    assert engine.has_attention_mask is True
    with pytest.raises(TypeError, match="must be a bool"):
        engine.set_has_attention_mask(1)

    engine.set_batch_fn(None)
    engine.reset_activation_shape()
    assert engine._driver._examples is None and not engine._driver._schedules
    longer = [(torch.randn(2, 4, 6, generator=g), torch.randn(2, 4, 3, generator=g)) for _ in range(2)]
    loss = engine.train_batch(data_iter=iter(longer))
    with torch.no_grad():
        want = sum(torch.nn.functional.mse_loss(pipe(x), y) for x, y in longer) / 2
    assert float(loss) == pytest.approx(float(want), rel=1e-6)
    assert engine.DTYPE_TO_ID[torch.bfloat16] == 5 and engine.ID_TO_DTYPE[11] == torch.bool
    with pytest.raises(NotImplementedError, match="changing the pipeline's micro batch"):
        engine.set_train_micro_batch_size(4)
