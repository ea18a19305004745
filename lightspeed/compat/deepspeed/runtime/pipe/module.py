"""`deepspeed.runtime.pipe.module`: `PipelineModule`, `LayerSpec`, `TiedLayerSpec`."""

from lightspeed.parallel.pipeline import LayerSpec, PipelineModule, TiedLayerSpec

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec"]
