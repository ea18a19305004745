"""`lightspeed config check FILE` and `lightspeed config show FILE`: the ds_config tools.

`check` runs `initialize`'s own validation (`lightspeed.optim.validation.validate_training_config`:
the schema, the batch triad, the optimizer and scheduler params) and prints every problem with its
JSON path, then, as a separate list (also when there are problems), the settings the config turns on
that lightspeed does not implement yet (`config.support`), which `lightspeed.initialize` would
refuse. Exit status 1 when either list is non-empty, so the check can gate a job script; 0 otherwise.

`show` prints the resolved config as JSON (`LightspeedConfig.to_dict()`): every default filled in and
the batch triad resolved for the world size.

Config warnings (an unknown top-level key, a legacy name) are logged by config/ on stderr as usual.
"""

from __future__ import annotations

import json
import sys
from typing import Optional


def _load(path: str, world_size: Optional[int]):
    """(config or None, problems, unimplemented settings), as `initialize` finds them."""
    from lightspeed.optim.validation import validate_training_config

    found = validate_training_config(path, world_size)
    return found.config, found.problems, found.unimplemented


def _bad_world_size(world_size: Optional[int]) -> bool:
    if world_size is not None and world_size < 1:
        print(f"lightspeed: error: --world-size must be at least 1 (got {world_size})", file=sys.stderr)
        return True
    return False


def config_check(path: str, world_size: Optional[int] = None) -> int:
    """Print the problems and unimplemented settings of the config at `path`; 1 if any, else 0."""
    if _bad_world_size(world_size):
        return 2
    cfg, problems, unimplemented = _load(path, world_size)
    if problems:
        print(f"{path}: problems:")
        print("\n".join(f"  {p}" for p in problems))
    if cfg is not None:
        print(f"{path}: valid for world size {cfg.world_size}: train_batch_size={cfg.train_batch_size}, "
              f"train_micro_batch_size_per_gpu={cfg.train_micro_batch_size_per_gpu}, "
              f"gradient_accumulation_steps={cfg.gradient_accumulation_steps}")
    if unimplemented:
        print(f"not implemented yet in lightspeed ({len(unimplemented)}; lightspeed.initialize refuses them):")
        print("\n".join(f"  {m}" for m in unimplemented))
    if problems:
        print("result: invalid")
    elif unimplemented:
        print("result: valid, but uses settings lightspeed does not implement yet")
    else:
        print("result: OK")
    return 1 if problems or unimplemented else 0


def config_show(path: str, world_size: Optional[int] = None) -> int:
    """Print the resolved config at `path` as JSON; on problems print them to stderr and return 1."""
    if _bad_world_size(world_size):
        return 2
    cfg, problems, _ = _load(path, world_size)
    if cfg is None:
        print(f"{path}: invalid config:", file=sys.stderr)
        print("\n".join(f"  {p}" for p in problems), file=sys.stderr)
        return 1
    print(json.dumps(cfg.to_dict(), indent=2))
    return 0
