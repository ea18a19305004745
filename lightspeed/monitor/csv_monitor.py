"""`csv_monitor`: one CSV file per event name under `<output_path>/<job_name>/`.

The file of `Train/Samples/lr` is `Train_Samples_lr.csv` with the header `step,lr` (the name's last
path component), then one `step,value` row per event, as DeepSpeed writes them. *Changed*: the
header is written when the file is new or empty, not once per process, so a resumed run appending to
the same directory does not repeat it mid-file.
"""

from __future__ import annotations

import csv
import json
import os
from typing import Iterable

from lightspeed.monitor.base import Event, Monitor


def log_dir_of(output_path: str, job_name: str) -> str:
    """`output_path/job_name`; an empty output path means the current directory (DeepSpeed's rule)."""
    return os.path.join(output_path or "", job_name)


class CSVMonitor(Monitor):
    def __init__(self, csv_config):
        super().__init__(csv_config)
        self.output_path = csv_config.output_path
        self.job_name = csv_config.job_name
        self.log_dir = log_dir_of(self.output_path, self.job_name)
        os.makedirs(self.log_dir, exist_ok=True)

    @staticmethod
    def file_stem(name: str) -> str:
        return name.replace("/", "_").replace(" ", "_")

    def write_events(self, event_list: Iterable[Event]) -> None:
        for name, value, step in event_list:
            path = os.path.join(self.log_dir, self.file_stem(name) + ".csv")
            new = not os.path.exists(path) or os.path.getsize(path) == 0
            with open(path, "a", newline="") as f:
                writer = csv.writer(f)
                if new:
                    writer.writerow(["step", name.rsplit("/", 1)[-1]])
                writer.writerow([step, value])

    def update_config(self, config_dict: dict) -> None:
        with open(os.path.join(self.log_dir, "deepspeed_config.csv"), "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["key", "value"])
            for key, value in config_dict.items():
                writer.writerow([key, json.dumps(value) if isinstance(value, (dict, list)) else value])


csvMonitor = CSVMonitor  # DeepSpeed's class name
