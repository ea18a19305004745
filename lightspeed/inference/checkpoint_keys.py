"""Matching a checkpoint's keys to a model's (checkpoint.py's loader): the base-model prefix on or off, and
what transformers itself does to a checkpoint's keys at load (renamings, and the per-expert matrices it
merges into a MoE block's 3-D parameters), found with transformers' own conversion mapping."""

from __future__ import annotations

import re
from collections.abc import Iterable

from torch import nn

from lightspeed._utils.logging import get_logger

logger = get_logger(__name__)


def key_mapping(expected: Iterable[str], found: Iterable[str], prefix: str):
    """The map model key -> checkpoint key with the most hits among: as is, the base-model prefix
    (Hugging Face's `base_model_prefix`) taken off, or put on (a base model from a model-with-head
    checkpoint, or the other way)."""
    found = set(found)
    expected = list(expected)
    candidates = [lambda k: k]
    if prefix:
        head = prefix + "."
        candidates += [lambda k: k[len(head):] if k.startswith(head) else k, lambda k: head + k]
    return max(candidates, key=lambda f: sum(f(k) in found for k in expected))


def transformers_conversions(model: nn.Module, keys: Iterable[str]) -> tuple[dict[str, str], dict[str, list]]:
    """What transformers does to a checkpoint's keys when it loads one into `model` (its
    `conversion_mapping`: renamings such as Mixtral's `block_sparse_moe.` -> `mlp.`, and converters
    that merge per-expert matrices into a MoE block's 3-D parameters), found for `keys` with transformers'
    own `rename_source_key`: (renamed: model key -> checkpoint key, per_expert: model key of a 3-D
    experts parameter -> per source pattern (gate, up, ...) {expert: checkpoint key}). Converters other
    than "stack the experts, then join the sources along the rows" are left out (the key stays missing,
    a clear error at load). Empty for a model transformers has no mapping for, or a transformers
    without this API."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

        transforms = get_model_conversion_mapping(model)
    except (ImportError, AttributeError, TypeError):  # not a transformers model, or another transformers
        return {}, {}
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter) and stacks_experts(t)]
    renamed, per_expert = {}, {}
    for key in keys:
        try:
            target, pattern = rename_source_key(key, renamings, converters)
        except (TypeError, ValueError) as err:  # its internal API changed: keys are matched as they are
            logger.warning("init_inference: transformers' checkpoint key conversion is not usable here (%s); "
                           "checkpoint keys are matched as they are", err)
            return {}, {}
        if pattern is None:
            if target != key:
                renamed[target] = key
            continue
        converter = next(c for c in converters if pattern in c.source_patterns)
        found = re.search(re.escape(pattern).replace(r"\*", r"(\d+)"), key)
        if found is None:
            continue
        sources = per_expert.setdefault(target, [{} for _ in converter.source_patterns])
        sources[converter.source_patterns.index(pattern)][int(found.group(1))] = key
    return renamed, per_expert


def stacks_experts(converter) -> bool:
    """A converter whose operations are MergeModulelist(dim=0), then (several sources) Concatenate(dim=1):
    expert e's matrix is its sources' matrices of expert e joined along the rows."""
    ops = [(type(op).__name__, getattr(op, "dim", None)) for op in converter.operations]
    return ops in ([("MergeModulelist", 0)], [("MergeModulelist", 0), ("Concatenate", 1)])
