"""`comet`: a Comet experiment (needs `comet_ml`), started by `comet_ml.start` with the section's
api_key, project, workspace, experiment_key, mode and online (offline experiments are archived under
comet's offline directory, `COMET_OFFLINE_DIRECTORY`), named `experiment_name` when given.

An event name is logged when first seen and then whenever at least `samples_log_interval` samples
(the event's step) have passed since it was last logged, as DeepSpeed's comet monitor does.
"""

from __future__ import annotations

from typing import Iterable

from lightspeed.monitor.base import Event, Monitor, require_package


class EventsLogScheduler:
    """Which events to log: the first of each name, then one per `samples_log_interval` samples."""

    def __init__(self, samples_log_interval: int):
        self.samples_log_interval = samples_log_interval
        self._last_logged: dict[str, int] = {}

    def needs_logging(self, name: str, current_sample: int) -> bool:
        last = self._last_logged.get(name)
        if last is None or current_sample - last >= self.samples_log_interval:
            self._last_logged[name] = current_sample
            return True
        return False


class CometMonitor(Monitor):
    def __init__(self, comet_config):
        super().__init__(comet_config)
        require_package("comet_ml", "comet")
        import comet_ml

        self.samples_log_interval = comet_config.samples_log_interval
        self.experiment = comet_ml.start(api_key=comet_config.api_key, project=comet_config.project,
                                         workspace=comet_config.workspace,
                                         experiment_key=comet_config.experiment_key, mode=comet_config.mode,
                                         online=comet_config.online)
        if comet_config.experiment_name is not None:
            self.experiment.set_name(comet_config.experiment_name)
        self._scheduler = EventsLogScheduler(comet_config.samples_log_interval)

    def write_events(self, event_list: Iterable[Event]) -> None:
        for name, value, step in event_list:
            if self._scheduler.needs_logging(name, step):
                self.experiment.log_metric(name, value, step=step)

    def update_config(self, config_dict: dict) -> None:
        self.experiment.log_parameters(config_dict)

    def close(self) -> None:
        self.experiment.end()
