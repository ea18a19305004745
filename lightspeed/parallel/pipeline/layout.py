"""What a checkpoint reader or writer of DeepSpeed's pipeline layout needs to know of a PipelineModule's
layers: which global layer indices are tied modules, which are modules, and where the stage bounds
fall at another number of stages.

Owns: `tied_layers`, `module_layers` and `parts_at`, read from the module's layer list and its
partition method. Must not: change the module, or the random generators (the "parameters" method builds each LayerSpec to
count its parameters, as the module did when it was built: that runs under a forked RNG).
"""

from __future__ import annotations

import torch

from lightspeed.parallel.pipeline.module import PipelineModule
from lightspeed.parallel.pipeline.spec import LayerSpec, TiedLayerSpec


def tied_layers(module: PipelineModule) -> dict[int, str]:
    """Global layer index -> tie key, for every TiedLayerSpec of the module."""
    return {i: spec.key for i, spec in enumerate(module._layer_specs) if isinstance(spec, TiedLayerSpec)}


def module_layers(module: PipelineModule) -> frozenset[int]:
    """The global indices of the layers that are modules (a LayerSpec, a module, or a TiedLayerSpec run
    without a forward_fn): those DeepSpeed's pipeline engine saves a layer file for."""
    return frozenset(i for i, spec in enumerate(module._layer_specs)
                     if isinstance(spec, torch.nn.Module) or (isinstance(spec, LayerSpec) and not (
                         isinstance(spec, TiedLayerSpec) and spec.forward_fn is not None)))


def parts_at(module: PipelineModule, num_stages: int) -> list[int]:
    """The stage bounds of the module's layers over `num_stages` stages (one stage per rank), by the
    module's partition method: DeepSpeed's `parts` of the same model at that pipeline size."""
    with torch.random.fork_rng(devices=[]):
        return [int(p) for p in module._partition(num_stages)]
