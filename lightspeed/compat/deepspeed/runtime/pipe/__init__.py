"""`deepspeed.runtime.pipe`: the pipeline module, topologies and engine under DeepSpeed's paths."""

from lightspeed.compat.deepspeed.runtime.pipe import engine, module, topology
from lightspeed.parallel.pipeline import LayerSpec, PipelineModule, ProcessTopology, TiedLayerSpec

__all__ = ["LayerSpec", "PipelineModule", "ProcessTopology", "TiedLayerSpec", "engine", "module", "topology"]
