"""`deepspeed.runtime.pipe.topology`: DeepSpeed's process topologies and `PipelineParallelGrid`."""

from lightspeed.parallel.pipeline.grid import PipelineParallelGrid, _prime_factors
from lightspeed.parallel.pipeline.topology import PipeDataParallelTopology, PipeModelDataParallelTopology, ProcessTopology

__all__ = ["PipeDataParallelTopology", "PipeModelDataParallelTopology", "PipelineParallelGrid", "ProcessTopology",
           "_prime_factors"]
