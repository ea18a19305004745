"""What a saved training state looks like to the code that reads it, whoever wrote it.

Owns the `TrainingStateSource` protocol: a checkpoint seen parameter by parameter (by the name the module
gives it), each read whole and in fp32, one at a time, whatever world size, ZeRO stage or program (lightspeed
or DeepSpeed) wrote it. Loading into another layout, consolidation into one fp32 state dict, and conversion
to safetensors are written once against this protocol. Must not: know how a particular format is laid out
on disk (its reader does) or touch an engine.

Note (the neutral form):
    - `param_names()`: the parameters that have fp32 master values and optimizer state (the trainable ones
      the optimizer stepped), in the module's order; tied parameters appear once, under their first name.
    - `read(name, key)`: a full tensor of `param_shape(name)`, fp32, on the CPU. `key` is "fp32" for the
      master value, or an elementwise optimizer-state key of `state_keys()` ("exp_avg", "exp_avg_sq",
      "sum", ...). Readers may map files lazily (torch.load(mmap=True)); a read never needs the whole model.
    - `module_state()`: the module's own state_dict as saved (low-precision parameters, frozen parameters,
      buffers), tensors on the CPU, possibly empty for parameters a stage-3 writer kept partitioned.
    - `optimizer_groups()`: one dict per optimizer param group: its hyperparameters (lr, betas, eps,
      weight_decay, ...), "names" (the parameter names in it, in order), and "scalars" (per-group scalar
      state such as "step", as Python numbers).
    - `extra()`: everything else a resume needs, as plain data: "lr_scheduler", "loss_scaler", "counters"
      (global_steps, global_samples, micro_steps, skipped_steps), "client_state", "zero_stage",
      "dp_world_size", "source" ("lightspeed" or "deepspeed"). Missing entries are None.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

MASTER_KEY = "fp32"


@runtime_checkable
class TrainingStateSource(Protocol):
    def param_names(self) -> list[str]: ...

    def param_shape(self, name: str) -> torch.Size: ...

    def state_keys(self) -> list[str]: ...

    def read(self, name: str, key: str = MASTER_KEY) -> torch.Tensor: ...

    def module_state(self) -> dict[str, torch.Tensor]: ...

    def optimizer_groups(self) -> list[dict[str, Any]]: ...

    def extra(self) -> dict[str, Any]: ...
