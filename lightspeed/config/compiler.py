"""Compiler sections: ``compile`` (DeepSpeed's, keys as in its ``CompileConfig``) and ``float8``
(lightspeed's own: DeepSpeed has no float8 training).

``compile``: `enabled`, `backend` and `kwargs` are the keys of DeepSpeed's first compile section
(compile the module at `initialize()`); `deepcompile` and the keys after it belong to DeepCompile,
DeepSpeed's compiler passes that insert ZeRO's collectives into the graph. lightspeed builds
`engine.compile()` (regional torch.compile with the ZeRO hooks outside the compiled regions), not
DeepCompile: `deepcompile: true` or any DeepCompile knob changed from its default is refused by
`config/support.py`, naming the key.

``float8``: converts the model's `nn.Linear` layers to torchao's float8 training linears before the
strategy shards anything; masters and optimizer are unchanged (see `lightspeed.precision.float8`).
Owns the shape of the sections only.
"""

from __future__ import annotations

from typing import Optional

from lightspeed.config.base import Bool, Choice, FreeDict, Int, Section, Str, StrList

DEEPCOMPILE_PASSES = ("z1", "z3", "autosp", "autotp")
FLOAT8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


class CompileConfig(Section):
    """``compile``."""

    enabled: Bool = False
    """Compile the module at `initialize()`, as `engine.compile(backend, kwargs)` would."""
    backend: Optional[Str] = None
    """torch.compile backend for `enabled` (None: the accelerator's, "inductor" on CUDA and CPU)."""
    kwargs: FreeDict = {}
    """Keyword arguments of torch.compile for `enabled` (mode, fullgraph, dynamic, options)."""

    # DeepCompile (refused when set: config/support.py)
    deepcompile: Bool = False
    autoep_non_moe: Bool = False
    free_activation: Bool = False
    free_activation_threshold: Int(ge=0) = 10 * 1024 * 1024
    offload_activation: Bool = False
    offload_activation_pin_memory: Bool = True
    offload_opt_states: Bool = False
    double_buffer: Bool = True
    symmetric_memory: Bool = False
    debug_log: Bool = False
    dump_graphs: Bool = False
    offload_parameters: Bool = False
    sync_before_reduce: Bool = False
    sync_after_reduce: Bool = False
    sync_before_allgather: Bool = False
    sync_after_allgather: Bool = False
    keep_int_input_tensors: Bool = True
    keep_all_input_tensors: Bool = False
    passes: Optional[list[Choice(*DEEPCOMPILE_PASSES)]] = None

    def deepcompile_settings(self) -> dict:
        """The DeepCompile keys that differ from their defaults (deepcompile itself included)."""
        plain = {"enabled", "backend", "kwargs"}
        return {k: v for k, v in self.non_default().items() if k not in plain}


class Float8Config(Section):
    """``float8``: float8 training of the linear layers through torchao (`pip install lightspeed[float8]`)."""

    enabled: Bool = False
    recipe: Choice(*FLOAT8_RECIPES) = "tensorwise"
    """torchao's recipe: "tensorwise" (one scale per tensor, fastest), "rowwise" (one scale per row,
    more accurate), "rowwise_with_gw_hp" (rowwise, the weight gradient in high precision)."""
    filter_fqns: StrList = []
    """Linear layers whose fully-qualified name contains any of these strings stay in high precision
    (e.g. ["lm_head"]: the output projection is often sensitive)."""
    emulate: Bool = False
    """Run the float8 matmul in emulation (any device; for tests: no speed-up)."""
