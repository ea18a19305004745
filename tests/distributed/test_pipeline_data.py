"""The training data `initialize(training_data=...)` hands a pipeline engine is read in order, as
DeepSpeed's PipelineEngine reads it (its `_build_data_iter`: a DistributedSampler with shuffle=False;
the plain engine's loader shuffles, as DeepSpeed's)."""

from __future__ import annotations

import pytest
import torch

from lightspeed.testing.run_world import run_world

pytestmark = [pytest.mark.dist, pytest.mark.timeout(120)]


def _first_batches():
    import lightspeed
    from lightspeed.parallel.pipeline import LayerSpec, PipelineModule

    data = torch.utils.data.TensorDataset(torch.arange(64).float().unsqueeze(1), torch.arange(64))
    net = PipelineModule([LayerSpec(torch.nn.Linear, 1, 4), LayerSpec(torch.nn.Linear, 4, 64)], num_stages=2,
                         loss_fn=torch.nn.CrossEntropyLoss())
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, _, loader, _ = lightspeed.initialize(model=net, config=config, training_data=data,
                                                 model_parameters=list(net.parameters()))
    pipe = [b[1].tolist() for b, _ in zip(loader, range(3))]
    loss = float(engine.train_batch())  # pulls its micro-batches from the same data
    return pipe, loss


def test_pipeline_training_data_is_read_in_order():
    pipe, loss = run_world(_first_batches, 2)[0]
    assert pipe == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert loss == loss and loss > 0
