"""Which layers each pipeline stage holds: DeepSpeed's partition methods with its exact boundaries.

Owns: `partition_uniform` and `partition_balanced` (the boundaries DeepSpeed's
`deepspeed.runtime.utils` computes, so a layer lands on the same stage as under DeepSpeed and a
checkpoint's layer files line up), the weights of each method ("parameters", "uniform",
"type:REGEX") and the stage -> layer-range table. Must not: build a layer or communicate.

Note: [boundaries] A partition is a list `parts` of `num_parts + 1` indices: part i holds items
`parts[i]:parts[i+1]`. Uniform: every part gets `num_items // num_parts` items and the first
`num_items % num_parts` parts one more; with no more items than parts, the first `num_items` parts
get one each. Balanced (the linear partition problem): over every split into `num_parts`
contiguous parts, the one whose largest and smallest part weights differ least; ties go to the
latest split point found, as DeepSpeed's dynamic programme does (`>=` when it compares costs).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """`num_parts + 1` boundaries splitting `num_items` items evenly (see the Note)."""
    if num_parts < 1:
        raise ValueError(f"partition: num_parts must be positive (got {num_parts})")
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    chunk, residual = divmod(num_items, num_parts)
    return [p * chunk + min(p, residual) for p in range(num_parts + 1)]


def partition_balanced(weights: Sequence[float], num_parts: int) -> list[int]:
    """`num_parts + 1` boundaries splitting `weights` into contiguous parts of the least spread
    between the heaviest and the lightest part (see the Note)."""
    n, m = len(weights), num_parts
    if n <= m:
        return partition_uniform(n, m)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))
    inf = math.inf
    best_max = [[inf] * (m + 1) for _ in range(n + 1)]
    best_min = [[inf] * (m + 1) for _ in range(n + 1)]
    cost = [[inf] * (m + 1) for _ in range(n + 1)]
    position = [[0] * (m + 1) for _ in range(n + 1)]
    best_max[0][0] = cost[0][0] = 0.0
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            for k in range(i):
                part = prefix[i] - prefix[k]
                hi, lo = max(best_max[k][j - 1], part), min(best_min[k][j - 1], part)
                if cost[i][j] >= hi - lo:
                    cost[i][j], best_max[i][j], best_min[i][j], position[i][j] = hi - lo, hi, lo, k
    parts = [n]
    for j in range(m, 0, -1):
        parts.append(position[parts[-1]][j])
    return parts[::-1]


def layer_weights(method: str, param_counts: Sequence[int], type_names: Sequence[str | None]) -> list[float] | None:
    """The weights `method` balances (None for "uniform"): trainable parameter counts for
    "parameters", 1 for each layer whose type name matches REGEX (case-insensitive search) for
    "type:REGEX". ValueError for another method or a regex that matches no layer."""
    method = method.lower()
    if method == "uniform":
        return None
    if method == "parameters":
        return [float(c) for c in param_counts]
    if method.startswith("type:"):
        pattern = re.compile(method.split(":", 1)[1], re.IGNORECASE)
        weights = [1.0 if name is not None and pattern.search(name) else 0.0 for name in type_names]
        if not any(weights):
            raise ValueError(f"partition_method {method!r}: no layer's type matches")
        return weights
    raise ValueError(f"partition_method {method!r}: expected 'parameters', 'uniform' or 'type:REGEX' "
                     "('profile' is not implemented)")


def partition_layers(method: str, param_counts: Sequence[int], type_names: Sequence[str | None],
                     num_parts: int) -> list[int]:
    """The stage boundaries of `method` over the layers (see `layer_weights`)."""
    weights = layer_weights(method, param_counts, type_names)
    if weights is None:
        return partition_uniform(len(param_counts), num_parts)
    return partition_balanced(weights, num_parts)
