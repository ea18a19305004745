"""`deepspeed.runtime.pipe.topology`: DeepSpeed's process topologies. `PipelineParallelGrid` (the groups
DeepSpeed builds from a topology) is lightspeed's mesh instead (comm/topology.py): constructing it
raises NotImplementedError naming it."""

from lightspeed.compat.deepspeed._missing import missing_class
from lightspeed.parallel.pipeline import PipeDataParallelTopology, PipeModelDataParallelTopology, ProcessTopology

PipelineParallelGrid = missing_class("deepspeed.runtime.pipe.topology.PipelineParallelGrid",
                                     "a pipeline grid of its own (the engine's mesh holds the groups: "
                                     "engine.mpu, deepspeed.utils.groups)")

__all__ = ["PipeDataParallelTopology", "PipeModelDataParallelTopology", "PipelineParallelGrid", "ProcessTopology"]
