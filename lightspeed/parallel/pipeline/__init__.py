"""Pipeline parallelism: DeepSpeed's `PipelineModule`, `LayerSpec`, `TiedLayerSpec` and process
topologies (module.py, spec.py, topology.py), DeepSpeed's partition methods (partition.py) and the
driver that runs a batch through torch.distributed.pipelining's schedules (schedule.py). The engine
that trains it is runtime/pipe_engine.py."""

from lightspeed.parallel.pipeline.grid import PipelineParallelGrid
from lightspeed.parallel.pipeline.module import PipelineModule, StageChunk
from lightspeed.parallel.pipeline.partition import partition_balanced, partition_uniform
from lightspeed.parallel.pipeline.schedule import SCHEDULES, PipelineDriver, schedule_kind
from lightspeed.parallel.pipeline.spec import LayerSpec, TiedLayerSpec
from lightspeed.parallel.pipeline.topology import (
    PipeDataParallelTopology, PipeModelDataParallelTopology, ProcessTopology,
)  # fmt: skip

__all__ = ["LayerSpec", "PipeDataParallelTopology", "PipeModelDataParallelTopology", "PipelineDriver",
           "PipelineModule", "PipelineParallelGrid", "ProcessTopology", "SCHEDULES", "StageChunk", "TiedLayerSpec", "partition_balanced",
           "partition_uniform", "schedule_kind"]
