"""`tensorboard`: scalar events through torch.utils.tensorboard's SummaryWriter (needs `tensorboard`).

Events go to `<output_path>/<job_name>/` and the writer is flushed after each batch of events, so a
reader sees a step as soon as it is logged.
"""

from __future__ import annotations

import json
import os
from typing import Iterable

from lightspeed.monitor.base import Event, Monitor, require_package
from lightspeed.monitor.csv_monitor import log_dir_of


class TensorBoardMonitor(Monitor):
    def __init__(self, tensorboard_config):
        super().__init__(tensorboard_config)
        require_package("tensorboard", "tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.output_path = tensorboard_config.output_path
        self.job_name = tensorboard_config.job_name
        self.log_dir = log_dir_of(self.output_path, self.job_name)
        os.makedirs(self.log_dir, exist_ok=True)
        self.summary_writer = SummaryWriter(log_dir=self.log_dir)

    def write_events(self, event_list: Iterable[Event], flush: bool = True) -> None:
        for name, value, step in event_list:
            self.summary_writer.add_scalar(name, value, step)
        if flush:
            self.summary_writer.flush()

    def flush(self) -> None:
        self.summary_writer.flush()

    def update_config(self, config_dict: dict) -> None:
        self.summary_writer.add_text("DeepSpeed/config", json.dumps(config_dict, indent=2, default=str), global_step=0)
        self.summary_writer.flush()

    def close(self) -> None:
        self.summary_writer.close()
