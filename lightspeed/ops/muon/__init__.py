"""Muon's Newton-Schulz orthogonalisation (DeepSpeed's runtime/zero/muon iterations): reference and fast path."""
from .newton_schulz import (NS_COEFFICIENTS, NS_METHODS, NS_STEPS, aspect_ratio_scale, muon_update, newton_schulz,
                            newton_schulz_reference, ns_compute_dtype, orthogonalize)

__all__ = ["NS_COEFFICIENTS", "NS_METHODS", "NS_STEPS", "aspect_ratio_scale", "muon_update", "newton_schulz",
           "newton_schulz_reference", "ns_compute_dtype", "orthogonalize"]
