"""The ``kernels`` section: lightspeed's own (DeepSpeed has none). Swaps fused training kernels into the
model at `initialize()`, before anything is placed or sharded (runtime/kernel_patch.py says which
modules of which models). Owns the shape of the section only.

``enabled`` is the master switch; each kernel has its own switch, on by default, so
``{"kernels": {"enabled": true}}`` turns on every kernel the model has a place for. ``backend`` forces
the kernels' path ("triton" or "reference"; "auto": Triton on CUDA tensors, the PyTorch reference on
CPU: ops/fused's Note: [backend rule]). ``chunk_size``: tokens per chunk of the fused linear
cross-entropy (None: ops/fused/linear_ce.py's rule, logits about the size of the hidden states).
"""

from __future__ import annotations

from typing import Optional

from lightspeed.config.base import Bool, Choice, PosInt, Section

KERNEL_BACKENDS = ("auto", "triton", "reference")


class KernelsConfig(Section):
    """``kernels``."""

    enabled: Bool = False
    rms_norm: Bool = True
    """HF Llama-family RMSNorm modules (LlamaRMSNorm, Qwen2RMSNorm, MistralRMSNorm, ...)."""
    rope: Bool = True
    """HF Llama-family attention's apply_rotary_pos_emb (rotate_half convention)."""
    swiglu: Bool = True
    """HF Llama-family MLPs with a silu activation: silu(gate_proj(x)) * up_proj(x) in one kernel."""
    fused_linear_cross_entropy: Bool = True
    """The causal-LM loss computed from the hidden states in chunks, the logits never whole (HF
    Llama-family and GPT-2 causal LMs; a model of one's own with `lightspeed_fused_lm_loss`)."""
    backend: Choice(*KERNEL_BACKENDS) = "auto"
    chunk_size: Optional[PosInt] = None
