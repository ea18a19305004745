"""The exception type for bad configuration (and its variant for the problems DeepSpeed asserts on). Lives
at the bottom of config/ so every layer can raise it."""

from __future__ import annotations


class ConfigError(ValueError):
    """A ds_config problem. The message names the JSON path, what was expected and what was given,
    e.g. ``zero_optimization.stage: must be 0, 1, 2 or 3 (got 4)``. Several problems are reported
    together, one per line; `problems` holds them as a list."""

    def __init__(self, problems: str | list[str]):
        if isinstance(problems, str):
            problems = [problems]
        self.problems = list(problems)
        if len(self.problems) == 1:
            message = self.problems[0]
        else:
            message = f"{len(self.problems)} problems in the config:\n" + "\n".join(f"  {p}" for p in self.problems)
        super().__init__(message)


class ConfigAssertionError(ConfigError, AssertionError):
    """A `ConfigError` for a problem DeepSpeed reports with a failed `assert` (e.g. an untested optimizer
    under ZeRO without `zero_allow_untested_optimizer`): code written against DeepSpeed that catches
    AssertionError catches it too, and the message stays lightspeed's."""


class ConfigNotImplementedError(ConfigError, NotImplementedError):
    """A `ConfigError` for a combination DeepSpeed refuses with NotImplementedError (e.g. a gradient
    accumulation dtype other than the model's without ZeRO: its "unsupported mix"): code written against
    DeepSpeed that catches NotImplementedError catches it too."""
