"""`lightspeed config check FILE` and `lightspeed config show FILE`: the ds_config tools.

`check` runs `initialize`'s own validation (`lightspeed.optim.validation.validate_training_config`:
the schema, the batch triad, the optimizer and scheduler params) and prints every problem with its
JSON path, then, as a separate list (also when there are problems), the settings the config turns on
that lightspeed does not implement yet (`config.support`), which `lightspeed.initialize` would
refuse. Exit status 1 when either list is non-empty, so the check can gate a job script; 0 otherwise.

A Hugging Face template (any "auto" in the file, or `--hf`) is checked with each "auto" read as the
placeholder the HF Trainer or Accelerate fills in (listed), so every other problem shows; `--no-hf`
checks it as `initialize` takes it, which refuses the "auto"s DeepSpeed itself does not accept
(config/loader.py, Note: "auto").

`show` prints the resolved config as JSON (`LightspeedConfig.to_dict()`): every default filled in and
the batch triad resolved for the world size.

Config warnings (an unknown top-level key, a legacy name) are logged by config/ on stderr as usual.
"""

from __future__ import annotations

import json
import sys
from typing import Optional


def _load(path: str, world_size: Optional[int], hf: bool = False):
    """(config or None, problems, unimplemented settings, "auto" placeholders), as `initialize` finds
    them (with `hf`: reading each "auto" as a placeholder)."""
    from lightspeed.optim.validation import validate_training_config

    found = validate_training_config(path, world_size, hf_placeholders=hf)
    return found.config, found.problems, found.unimplemented, found.placeholders


def _has_auto(path: str) -> bool:
    """Whether the config at `path` holds an "auto" anywhere (a Hugging Face template); False when
    it cannot be read (the check reports why)."""
    from lightspeed.config.errors import ConfigError
    from lightspeed.config.parse import read_source

    def walk(value) -> bool:
        if isinstance(value, dict):
            return any(walk(v) for v in value.values())
        if isinstance(value, list):
            return any(walk(v) for v in value)
        return value == "auto"

    try:
        return walk(read_source(path)[0])
    except ConfigError:
        return False


def _bad_world_size(world_size: Optional[int]) -> bool:
    if world_size is not None and world_size < 1:
        print(f"lightspeed: error: --world-size must be at least 1 (got {world_size})", file=sys.stderr)
        return True
    return False


def config_check(path: str, world_size: Optional[int] = None, hf: Optional[bool] = None) -> int:
    """Print the problems and unimplemented settings of the config at `path`; 1 if any, else 0.
    `hf`: check it as a Hugging Face template (None: when it holds an "auto")."""
    if _bad_world_size(world_size):
        return 2
    if hf is None:
        hf = _has_auto(path)
    cfg, problems, unimplemented, placeholders = _load(path, world_size, hf)
    if hf:
        print(f'{path}: Hugging Face template: "auto" read as a placeholder the HF Trainer or Accelerate fills in '
              f"({len(placeholders)}{': ' + ', '.join(placeholders) if placeholders else ''}); "
              "lightspeed.initialize needs them resolved (check with --no-hf)")
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
    if hf and not problems:
        print(f"{path}: no other problems")
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
    cfg, problems, _, _ = _load(path, world_size)
    if cfg is None:
        print(f"{path}: invalid config:", file=sys.stderr)
        print("\n".join(f"  {p}" for p in problems), file=sys.stderr)
        return 1
    print(json.dumps(cfg.to_dict(), indent=2))
    return 0
