"""`deepspeed.pipe`: DeepSpeed's pipeline-parallel model API (lightspeed/parallel/pipeline)."""

from lightspeed.parallel.pipeline import (
    LayerSpec, PipeDataParallelTopology, PipelineModule, PipeModelDataParallelTopology, ProcessTopology, TiedLayerSpec,
)  # fmt: skip

__all__ = ["LayerSpec", "PipeDataParallelTopology", "PipeModelDataParallelTopology", "PipelineModule",
           "ProcessTopology", "TiedLayerSpec"]
