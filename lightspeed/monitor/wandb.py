"""`wandb`: a Weights & Biases run (needs `wandb`), started with the section's project, group and
team (wandb's entity). Online or offline is wandb's own setting (`WANDB_MODE`, `wandb offline`).

Each event is one `wandb.log({name: value}, step=step)`. wandb drops a step lower than one already
logged, so the engine writes its events in non-decreasing sample order.
"""

from __future__ import annotations

from typing import Iterable

from lightspeed.monitor.base import Event, Monitor, require_package


class WandbMonitor(Monitor):
    def __init__(self, wandb_config):
        super().__init__(wandb_config)
        require_package("wandb", "wandb")
        import wandb

        self.group = wandb_config.group
        self.team = wandb_config.team
        self.project = wandb_config.project
        self.run = wandb.init(project=self.project, group=self.group, entity=self.team)

    def log(self, data: dict, step: int | None = None, commit: bool | None = None):
        return self.run.log(data, step=step, commit=commit)

    def write_events(self, event_list: Iterable[Event]) -> None:
        for name, value, step in event_list:
            self.run.log({name: value}, step=step)

    def update_config(self, config_dict: dict) -> None:
        self.run.config.update(config_dict, allow_val_change=True)

    def close(self) -> None:
        self.run.finish()
