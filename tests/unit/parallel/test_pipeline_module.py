"""The pipeline module without processes: DeepSpeed's partition boundaries (against a table computed by
real DeepSpeed 0.19.8), the process topologies' arithmetic, building only a stage's layers, virtual
stages in loop and V order, the placements the split writes, a one-stage PipelineModule's forward,
the `pipeline` config keys and DeepSpeed's module paths."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from lightspeed.parallel.pipeline import (
    LayerSpec, PipeDataParallelTopology, PipelineModule, PipeModelDataParallelTopology, ProcessTopology,
    TiedLayerSpec, partition_balanced, partition_uniform,
)  # fmt: skip
from lightspeed.parallel.pipeline.module import stage_indices
from lightspeed.parallel.pipeline.partition import layer_weights
from lightspeed.parallel.placement import PlacementTable

FIXTURES = Path(__file__).parents[2] / "fixtures" / "deepspeed_pipeline"
sys.path.insert(0, str(FIXTURES))
import model as M  # noqa: E402  (the fixtures' plain-torch models)

TABLE = json.loads((FIXTURES / "partitions.json").read_text())


@pytest.mark.parametrize("case", TABLE["partition_uniform"], ids=lambda c: f"{c['num_items']}/{c['num_parts']}")
def test_partition_uniform_is_deepspeeds(case):
    assert partition_uniform(case["num_items"], case["num_parts"]) == case["result"]


@pytest.mark.parametrize("case", TABLE["partition_balanced"], ids=lambda c: f"{c['weights']}/{c['num_parts']}")
def test_partition_balanced_is_deepspeeds(case):
    assert partition_balanced(case["weights"], case["num_parts"]) == case["result"]


def test_partition_methods():
    assert layer_weights("uniform", [1, 2], ["A", "B"]) is None
    assert layer_weights("type:lin", [0, 0, 0], ["Linear", "ReLU", "MyLINEAR"]) == [1.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="no layer's type matches"):
        layer_weights("type:Conv", [0], ["Linear"])
    with pytest.raises(ValueError, match="'profile' is not implemented"):
        layer_weights("profile", [0], ["Linear"])


def test_process_topology_arithmetic():
    topo = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=3)
    assert topo.get_axis_names() == ["pipe", "data", "model"] and topo.world_size() == 12
    # pipe outermost, model innermost: lightspeed's mesh order (pp, dp, tp)
    assert topo.get_rank(pipe=1, data=2, model=1) == 11 and topo.get_coord(7) == topo.ProcessCoord(1, 0, 1)
    assert topo.get_axis_comm_lists("pipe")[0] == [0, 6]
    assert topo.filter_match(pipe=0, model=1) == [1, 3, 5]
    assert topo.get_axis_list("data", 0) == [0, 1, 6, 7]
    assert topo.get_dim("pipe") == 2 and topo.get_dim("absent") == 0
    assert topo.get_rank_repr(3) == "model_01"
    assert PipeDataParallelTopology(num_pp=4, num_dp=1).get_axis_comm_lists("pipe") == [[0, 1, 2, 3]]
    with pytest.raises(ValueError):
        ProcessTopology(["a"], [1, 2])


def test_stage_orders():
    assert stage_indices(0, 4, 2, "loop") == [0, 4] and stage_indices(3, 4, 3, "loop") == [3, 7, 11]
    assert stage_indices(0, 2, 2, "v") == [0, 3] and stage_indices(1, 2, 2, "v") == [1, 2]
    with pytest.raises(ValueError, match="two stages per rank"):
        stage_indices(0, 2, 3, "v")


def _model_a(**kwargs) -> PipelineModule:
    return PipelineModule(M.layer_specs(LayerSpec, TiedLayerSpec, tied=False), num_stages=1, loss_fn=M.loss_fn(False),
                          seed_layers=True, seed_fn=M.seed_layer, base_seed=M.BASE_SEED, **kwargs)


def test_one_stage_builds_every_layer_under_its_global_index():
    net = _model_a()
    names = [n for n, _ in net.named_parameters()]
    assert names[:2] == ["0.weight", "0.bias"] and "7.weight" in names
    assert net.local_layer_indices() == list(range(8)) and net.parts == [0, 8]
    assert [c.stage for c in net.chunks] == [0]
    # each layer built under seed base_seed + index, as DeepSpeed with seed_layers
    torch.manual_seed(M.BASE_SEED + 2)
    assert torch.equal(net.get_submodule("2").weight, torch.nn.Linear(24, 24).weight)
    x, y = M.batches(0, 0, 3, 7, 0)
    reference = x
    for i in range(8):
        reference = torch.tanh(reference) if i == 3 else net.get_submodule(str(i))(reference)
    assert torch.equal(net(x), reference)
    assert net.chunks[0](x).shape == (3, 10)


def test_virtual_stages_repartition_and_keep_built_layers():
    net = _model_a(partition_method="uniform")
    first = net.get_submodule("0")
    assert net.set_virtual_stages(0, 1, 2, "loop") is False  # one rank holds both stages: the same layers
    assert [(c.stage, c.start, c.stop) for c in net.chunks] == [(0, 0, 4), (1, 4, 8)]
    assert net.get_submodule("0") is first
    assert net.parts == [0, 4, 8]
    x, _ = M.batches(0, 0, 2, 7, 0)
    assert torch.equal(net.chunks[1](net.chunks[0](x)), net(x))


def test_tied_modules_and_their_placements():
    net = PipelineModule(M.layer_specs(LayerSpec, TiedLayerSpec, tied=True), num_stages=1, loss_fn=M.loss_fn(True))
    assert net.tied_parameter_names() == {"tied_modules.embed.weight"}
    tokens, labels = M.batches(0, 0, 2, 7, 0, tied=True)
    logits = net(tokens)
    assert logits.shape == (2, M.SEQ, M.VOCAB)
    assert torch.equal(logits, net.chunks[0](tokens))
    table = PlacementTable.for_module(net)
    assert net.placements(table, 1) is table
    placed = net.placements(table, 2)
    assert placed["tied_modules.embed.weight"].reduced_over[-1] == "pp"
    assert placed["tied_modules.embed.weight"].sharded_over == ()
    assert placed["1.fc1.weight"].sharded_over == ("pp",)
    assert placed.split_over == ("pp",) and "pp" in placed.sharded_dims()


def test_module_arguments_refused_with_their_names():
    with pytest.raises(RuntimeError, match="num_stages or topology"):
        PipelineModule([torch.nn.Linear(2, 2)])
    with pytest.raises(RuntimeError, match="must divide the world size"):
        PipelineModule([torch.nn.Linear(2, 2)], num_stages=2)
    with pytest.raises(NotImplementedError, match="dynamic_shape"):
        PipelineModule([torch.nn.Linear(2, 2)], num_stages=1, dynamic_shape=True)
    with pytest.raises(NotImplementedError, match="partition_method 'profile'"):
        PipelineModule([torch.nn.Linear(2, 2)], num_stages=1, partition_method="profile")
    with pytest.raises(RuntimeError, match="torch.nn.Module types"):
        LayerSpec(torch.tanh)
    with pytest.raises(TypeError, match="not a module, LayerSpec or callable"):
        PipelineModule([torch.nn.Linear(2, 2), 3], num_stages=1)


def test_pipeline_config_keys():
    from lightspeed.config import load
    from lightspeed.config.errors import ConfigError

    base = {"train_micro_batch_size_per_gpu": 1}
    assert load(base).pipeline.stages_per_rank() == 1
    assert load({**base, "pipeline": {"schedule": "ZBV_zero_bubble"}}).pipeline.stages_per_rank() == 2
    assert load({**base, "pipeline": {"schedule": "interleaved_1f1b", "virtual_stages": 3}}).pipeline.stages_per_rank() == 3
    with pytest.raises(ValueError, match="runs one stage per rank"):
        load({**base, "pipeline": {"schedule": "gpipe", "virtual_stages": 2}}).pipeline.stages_per_rank()
    with pytest.raises(ValueError, match="two stages per rank"):
        load({**base, "pipeline": {"schedule": "zbv_zero_bubble", "virtual_stages": 3}}).pipeline.stages_per_rank()
    with pytest.raises(ConfigError, match="pipeline.schedule"):
        load({**base, "pipeline": {"schedule": "dualpipe"}})


def test_deepspeed_paths():
    from lightspeed.compat.deepspeed import pipe, runtime
    from lightspeed.compat.deepspeed.runtime import utils
    from lightspeed.runtime.pipe_engine import PipelineEngine, PipelineError

    assert pipe.PipelineModule is PipelineModule and pipe.LayerSpec is LayerSpec and pipe.TiedLayerSpec is TiedLayerSpec
    assert runtime.pipe.module.PipelineModule is PipelineModule
    assert runtime.pipe.topology.PipeModelDataParallelTopology is PipeModelDataParallelTopology
    assert runtime.pipe.engine.PipelineEngine is PipelineEngine and runtime.pipe.engine.PipelineError is PipelineError
    assert utils.partition_uniform is partition_uniform and utils.partition_balanced is partition_balanced


def test_grid_of_one_process():
    from lightspeed.compat.deepspeed.runtime.pipe.topology import PipelineParallelGrid as DSGrid, _prime_factors
    from lightspeed.parallel.pipeline import PipelineParallelGrid

    assert DSGrid is PipelineParallelGrid and _prime_factors(12) == [2, 2, 3]
    grid = _model_a().mpu()
    assert isinstance(grid, PipelineParallelGrid)
    assert grid.get_stage_id() == 0 and grid.get_pipe_parallel_world_size() == 1 and grid.is_last_stage
    assert grid.get_data_parallel_world_size() == 1 and grid.get_model_parallel_rank() == 0
    assert grid.stage_to_global(0) == 0 and grid.p2p_groups == [[0, 0]]
    with pytest.raises(NotImplementedError, match="only pipe, data and model"):
        PipelineParallelGrid(ProcessTopology(["row", "col"], [1, 1]))
