"""Read back what the monitors wrote, for tests: TensorBoard event files, the CSVs, a wandb offline
run, a comet offline archive. Each returns {event name: [(step, value), ...]} in file order. The
libraries are imported inside the readers: they are test dependencies only."""

from __future__ import annotations

import csv
import glob
import json
import os
import struct
import zipfile
from collections import defaultdict


def read_tensorboard(log_dir: str) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(log_dir)
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def read_csvs(log_dir: str) -> dict[str, tuple[str, list[tuple[int, float]]]]:
    """{file stem: (the header's value column, rows)}; a header row repeated mid-file is an error."""
    out = {}
    for path in sorted(glob.glob(os.path.join(log_dir, "*.csv"))):
        with open(path, newline="") as f:
            rows = list(csv.reader(f))
        if rows[0] == ["key", "value"]:  # update_config's file
            continue
        if rows[0][0] != "step" or any(r[0] == "step" for r in rows[1:]):
            raise AssertionError(f"{path}: expected one header row `step,<name>` first")
        out[os.path.basename(path)[:-4]] = (rows[0][1], [(int(r[0]), float(r[1])) for r in rows[1:]])
    return out


def _wandb_records(path: str) -> list[bytes]:
    """The records of a .wandb file: a LevelDB-style log (7-byte file header `:W&B` + magic +
    version, then 32 KiB blocks of records with a 7-byte header: crc32, length, type)."""
    data = open(path, "rb").read()
    assert data[:4] == b":W&B", "not a wandb run file"
    block, pos, records, pending = 32768, 7, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:  # zero padding at the end of a block
            pos += left
            continue
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            records.append(chunk)
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            records.append(pending + chunk)
    return records


def read_wandb(wandb_dir: str) -> tuple[dict, dict[str, list[tuple[int, float]]]]:
    """(run info {project, group, entity}, history) of the one offline run under `wandb_dir`. wandb's
    service process writes the run file out when it stops: call `wandb.teardown()` first."""
    from wandb.proto import wandb_internal_pb2

    runs = glob.glob(os.path.join(wandb_dir, "wandb", "offline-run-*", "run-*.wandb"))
    assert len(runs) == 1, runs
    info, history = {}, defaultdict(list)
    for raw in _wandb_records(runs[0]):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            info = {"project": record.run.project, "group": record.run.run_group, "entity": record.run.entity}
        elif kind == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            step = int(items.pop("_step"))
            for key, value in items.items():
                if not key.startswith("_"):
                    history[key].append((step, float(value)))
    return info, dict(history)


def read_comet_archive(offline_dir: str) -> tuple[dict, dict[str, list[tuple[int, float]]]]:
    """(experiment.json, metrics) of the one offline experiment archived under `offline_dir`."""
    archives = glob.glob(os.path.join(offline_dir, "*.zip"))
    assert len(archives) == 1, archives
    metrics = defaultdict(list)
    with zipfile.ZipFile(archives[0]) as zf:
        experiment = json.loads(zf.read("experiment.json"))
        for line in zf.read("messages.json").decode().splitlines():
            message = json.loads(line)
            if message.get("type") == "metric_msg":
                metric = message["payload"]["metric"]
                metrics[metric["metricName"]].append((metric["step"], float(metric["metricValue"])))
    return experiment, dict(metrics)
