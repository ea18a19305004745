"""Stage 3's strategy methods that serve code outside the training step: unsharding the model
(FSDP2's `unshard()` / `reshard()`, gathered.py's Note: unshard), the partition cache, the recorded
module order (coordinator.py's Note: the trace), the external parameters of a module, other forward
methods of the model (coordinator.py's Note: other forward methods), and what `engine.compile()`
compiles (units.py's Note: compiled regions; opaque.py).

Owns: those methods, as a mixin of `Stage3Strategy` (strategy.py), which holds `module`, `coordinator`,
`units`, `_unsharding` and `_check_module`. Must not: hold state of its own.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch

from lightspeed.zero.stage3.opaque import join
from lightspeed.zero.stage3.units import compile_regions


class ModelSeam:
    """Mixin of `Stage3Strategy` (see the module docstring)."""

    # ---------------------------------------------------------------- unshard (gathered.py's Note: unshard)
    def unshard(self, module: torch.nn.Module | None = None) -> None:
        """Gather every group the units under `module` (None: the whole model) use and keep them
        gathered: forwards then run with no collective for them, until `reshard`. Unsharding what is
        already unsharded is a no-op. A collective: every rank calls it with the same module."""
        self._unsharding.unshard(module)

    def reshard(self, module: torch.nn.Module | None = None) -> None:
        """Release the unsharded groups under `module` (None: all) back to their shards; a no-op for
        groups not unsharded."""
        self._unsharding.reshard(module)

    def unsharded(self, module: torch.nn.Module | None = None) -> contextlib.AbstractContextManager:
        """`unshard(module)` for a `with` block yielding the module (None: the whole model); on exit,
        also by an exception, reshards what it unsharded."""
        return self._unsharding.unsharded(module, module if module is not None else self.module)

    def empty_partition_cache(self) -> None:
        """Release every gathered group nothing holds, persistent ones included (DeepSpeed's
        `empty_partition_cache`); they are gathered again when next used."""
        self.coordinator.release_unheld()

    def trace_complete(self) -> bool:
        """True while forwards follow the recorded module order (coordinator.py's Note: the trace)."""
        return self.coordinator.trace_complete

    def restart_trace(self) -> None:
        """Record the module order again from the next forward (refused during a forward or backward)."""
        self.coordinator.restart_trace()

    def external_parameters(self, module: torch.nn.Module) -> list[torch.nn.Parameter]:
        """The parameters gathered around `module`'s forward and backward from outside the subtree of the
        unit that gathers for it (units.py; a module inside a unit reports its unit's): tied, registered
        or detected external parameters, each once."""
        self._check_module(module)
        unit, groups = self.coordinator.gathered_for(module)
        own = {id(p) for p in unit.parameters()}
        out: list[torch.nn.Parameter] = []
        for g in groups:
            for p in g.params:
                if id(p) not in own and all(p is not q for q in out):
                    out.append(p)
        return out

    def forward_method(self, method: Callable[..., Any]) -> Callable[..., Any]:
        """`method` run as a forward of the whole model: the root unit's groups gathered around it and
        released after it, the units inside it hooked as in any forward (coordinator.py's Note: other
        forward methods)."""
        coordinator = self.coordinator

        @functools.wraps(method)
        def as_forward(*args, **kwargs):
            return coordinator.call_as_forward(method, args, kwargs)

        return as_forward

    def gradients_unreduced(self) -> bool:
        """False: stage 3 reduce-scatters every micro-step's gradients."""
        return False

    def needs_eager_forward(self) -> bool:
        """True while forwards run under the coordinator's external-use mode (the first forward and
        backward, with the default `external_detection`): compiled regions then run eagerly."""
        return self.coordinator.detects_external()

    # ---------------------------------------------------------------- engine.compile()
    def compile_regions(self) -> list[torch.nn.Module]:
        """The modules `engine.compile()` compiles in place: no unit's hooks inside any (see units.py);
        the whole module when no unit has hooks (one rank: the parameters never leave their shards)."""
        if not self.coordinator.hooks_forward:
            return [self.module]
        return compile_regions(self.module, [u.module for u in self.units])

    def after_compile(self, regions: list[torch.nn.Module]) -> None:
        """With the root compiled around its units (units.py's Note: compiled regions), each unit a
        traced root calls becomes one opaque op of the root's graph (opaque.py)."""
        if len(regions) > 1 and regions[0] is self.module:
            join(self.module, regions[1:])
