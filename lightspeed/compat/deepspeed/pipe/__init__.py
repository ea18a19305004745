"""`deepspeed.pipe`: pipeline parallelism is not built in lightspeed yet; constructing any of these raises
NotImplementedError naming it."""

from lightspeed.compat.deepspeed._missing import missing_class

_PIPELINE = "pipeline parallelism"
PipelineModule = missing_class("deepspeed.pipe.PipelineModule", _PIPELINE)
LayerSpec = missing_class("deepspeed.pipe.LayerSpec", _PIPELINE)
TiedLayerSpec = missing_class("deepspeed.pipe.TiedLayerSpec", _PIPELINE)

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec"]
