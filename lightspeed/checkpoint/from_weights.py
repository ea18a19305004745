"""A model's weights (a Hugging Face model directory of safetensors, or any state dict) as a lightspeed
training checkpoint, so `engine.load_checkpoint` starts a run from them at any world size and ZeRO stage.

Owns the conversion only: the module state as saved, every floating tensor's fp32 value as one whole-tensor
fragment (the saved layout of `zero/fragments.py`, as a one-rank stage-0 run would write it), no optimizer
state (the optimizer starts fresh) and counters at zero; written through `CheckpointWriter`, so the files
carry checksums and the tag appears atomically. Must not: know a model class (names are the weights' own).

Peak host memory is the weights in their saved dtype plus an fp32 copy of the floating ones (bf16 or fp16
weights: 3x their size): a training checkpoint holds both.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Mapping

import torch

from lightspeed.checkpoint.engine_checkpoint import MODEL_FILE, optim_file
from lightspeed.checkpoint.errors import CheckpointError
from lightspeed.checkpoint.writer import CheckpointWriter
from lightspeed.comm.collectives import Communicator

INDEX_FILE = "model.safetensors.index.json"


def read_safetensors_dir(model_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face model directory's safetensors (one file, or shards with an index)."""
    from safetensors import safe_open
    from safetensors import SafetensorError

    model_dir = Path(model_dir)
    if (model_dir / INDEX_FILE).is_file():
        try:
            weight_map = json.loads((model_dir / INDEX_FILE).read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as err:
            raise CheckpointError(f"{model_dir / INDEX_FILE}: not a safetensors index ({err})") from None
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir}: no safetensors weights (model.safetensors or an index)")
    out: dict[str, torch.Tensor] = {}
    for name in files:
        try:
            with safe_open(str(model_dir / name), framework="pt") as f:
                for key in f.keys():
                    out[key] = f.get_tensor(key)
        except (OSError, SafetensorError) as err:
            raise CheckpointError(f"{model_dir / name}: cannot be read ({err})") from None
    return out


def write_checkpoint_from_weights(weights: Mapping[str, torch.Tensor], save_dir: str | os.PathLike,
                                  tag: str = "global_step0") -> Path:
    """Write `weights` as `save_dir/<tag>/` (and `latest`); returns the tag directory."""
    module = {k: v.detach().cpu() for k, v in weights.items()}
    names = [k for k, v in module.items() if v.is_floating_point() and v.numel()]
    owners = [module[k].float().reshape(-1) for k in names]
    strategy_state = {"format": "fragments", "version": 1, "stage": 0, "dp_world_size": 1, "dp_rank": 0,
                      "fragments": [[k, list(module[k].shape), 0, module[k].numel(), i, 0] for i, k in enumerate(names)],
                      "owners": owners, "owner_groups": [-1] * len(owners), "state": [{} for _ in owners],
                      "param_groups": []}
    shared = {"module": module, "lr_scheduler": None, "loss_scaler": None, "client_state": {},
              "counters": {"global_steps": 0, "global_samples": 0, "micro_steps": 0, "skipped_steps": 0},
              "zero_stage": 0, "dp_world_size": 1, "excluded_frozen_parameters": []}
    files = {MODEL_FILE: shared, optim_file(None): strategy_state}
    return CheckpointWriter().save(save_dir, tag, files, comm=Communicator(None, 1), dp_rank=0, num_ranks=1)
