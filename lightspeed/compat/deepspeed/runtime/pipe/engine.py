"""`deepspeed.runtime.pipe.engine`: `PipelineEngine` and `PipelineError`."""

from lightspeed.runtime.pipe_engine import PipelineEngine, PipelineError

__all__ = ["PipelineEngine", "PipelineError"]
