"""`deepspeed.runtime.hybrid_engine`: `DeepSpeedHybridEngine` is lightspeed's `HybridEngine` (what
`deepspeed.initialize` returns when `hybrid_engine.enabled` is true)."""

from lightspeed.hybrid.engine import HybridEngine as DeepSpeedHybridEngine

__all__ = ["DeepSpeedHybridEngine"]
