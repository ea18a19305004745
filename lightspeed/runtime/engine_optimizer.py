"""`EngineOptimizer`: the optimizer `deepspeed.initialize` returns, a thin view of the engine's optimizer
that also says whether the engine's last step was skipped (`overflow`), as DeepSpeed's wrapped
optimizers do (accelerate reads `optimizer.overflow` for `step_was_skipped`).

Owns: only that view. Must not: step anything itself (the engine steps the optimizer at the
accumulation boundary) or hold state (param_groups, state and state_dict are the wrapped optimizer's).
"""

from __future__ import annotations

import torch

from lightspeed.precision.loss_scaler import DynamicLossScaler


_VIEW_CLASSES: dict[type, type] = {}


class EngineOptimizer(torch.optim.Optimizer):
    """A view of `engine.optimizer`; `optimizer` is the wrapped torch optimizer. It subclasses
    torch.optim.Optimizer so torch's LR schedulers accept it; Optimizer.__init__ is not run (the
    wrapped optimizer holds the parameters and state)."""

    def __init__(self, engine):
        # No Optimizer.__init__: its state would be a second, unused copy of the wrapped optimizer's.
        self._engine = engine
        self.optimizer = engine.optimizer

    @classmethod
    def of(cls, engine) -> "EngineOptimizer":
        """The view of `engine.optimizer`, also an instance of that optimizer's class and equal to it
        (DeepSpeed returns the optimizer itself where it does not wrap it: `isinstance(opt, AdamW)` and
        `opt == client_optimizer` hold for its users)."""
        wrapped = type(engine.optimizer)
        view_class = _VIEW_CLASSES.get(wrapped)
        if view_class is None:
            view_class = _VIEW_CLASSES[wrapped] = type(f"EngineOptimizer[{wrapped.__name__}]", (cls, wrapped), {})
        view = object.__new__(view_class)
        cls.__init__(view, engine)
        return view

    def __eq__(self, other) -> bool:
        return other is self or other is self.optimizer

    def __hash__(self) -> int:
        return id(self)

    @property
    def overflow(self) -> bool:
        """True when the engine's last optimizer step was skipped (fp16 overflow, or a bf16 inf/nan
        with bf16.check_grad_overflow); False before the first step."""
        return self._engine.global_steps > 0 and not self._engine.was_step_applied()

    # DeepSpeed's fp16 optimizers' loss-scale attributes, read from the engine's loss scaler (fp16 only:
    # without one they do not exist, as on DeepSpeed's unwrapped optimizer)
    @property
    def loss_scaler(self):
        scaler = self._engine.loss_scaler
        if scaler is None:
            raise AttributeError("loss_scaler: the engine scales no loss (fp16 is not enabled)")
        return scaler

    @property
    def dynamic_loss_scale(self) -> bool:
        return isinstance(self.loss_scaler, DynamicLossScaler)

    @property
    def cur_scale(self) -> float:
        return self.loss_scaler.cur_scale

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.cur_scale

    @property
    def cur_iter(self) -> int:
        return self.loss_scaler.cur_iter

    @property
    def scale_window(self) -> int:
        scaler = self.loss_scaler
        if not isinstance(scaler, DynamicLossScaler):
            raise AttributeError("scale_window: the loss scale is static")
        return scaler.scale_window

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self.optimizer.param_groups = value

    @property
    def state(self):
        return self.optimizer.state

    @property
    def defaults(self):
        return self.optimizer.defaults

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.optimizer.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._engine.zero_grad()

    def step(self, closure=None):
        raise RuntimeError("the optimizer is stepped by engine.step() at the accumulation boundary; call that")

    def add_param_group(self, param_group) -> None:
        raise RuntimeError("add_param_group: the engine's sharded buffers are built at initialize(); add the "
                           "parameters before it")

    def __getstate__(self):
        return self.__dict__

    def __setstate__(self, state) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"EngineOptimizer({self.optimizer!r})"
