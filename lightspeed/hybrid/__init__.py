"""DeepSpeed's RLHF hybrid engine: one ZeRO actor that trains and generates (`hybrid_engine.enabled`).

Owns `HybridEngine` (engine.py: `generate`, `eval()` / `train()`, the timing line), LoRA fused for
generation and restored exactly (lora.py), generation split over inference groups (tensor_parallel.py:
`inference_tp_size`), generate's decode steps replayed from CUDA graphs (graphs.py: `enable_cuda_graph`),
and `initialize`, which is `lightspeed.runtime`'s `initialize` building a `HybridEngine` when the config
enables the hybrid engine (`lightspeed.initialize` and `deepspeed.initialize` are this one).
Must not: be imported by the training packages (it sits above runtime/, and is the one training-side
package that may import `lightspeed.inference`), or gather parameters except through the stage-3 seam.
"""

from __future__ import annotations

from lightspeed.hybrid.engine import HybridEngine
from lightspeed.hybrid.lora import fused_lora, lora_modules, lora_parameters
from lightspeed.runtime.initialize import initialize as _runtime_initialize


def initialize(*args, **kwargs):
    """`lightspeed.runtime.initialize.initialize`, which returns a `HybridEngine` when
    `hybrid_engine.enabled` is true in the config (DeepSpeed's `deepspeed.initialize`)."""
    return _runtime_initialize(*args, hybrid_engine_class=HybridEngine, **kwargs)


__all__ = ["HybridEngine", "fused_lora", "initialize", "lora_modules", "lora_parameters"]
