"""The monitor backends on their own: each one's files read back with its library's reader, rank-0-only
writing, and the one-line error naming the package when a backend's library is missing."""

from __future__ import annotations

import importlib.util
import os
from types import SimpleNamespace

import pytest

from lightspeed.config.monitoring import CometConfig, CSVMonitorConfig, TensorBoardConfig, WandbConfig
from lightspeed.monitor import CometMonitor, CSVMonitor, MonitorMaster, TensorBoardMonitor, WandbMonitor
from lightspeed.monitor.comet import EventsLogScheduler
from lightspeed.testing.monitor_files import read_comet_archive, read_csvs, read_tensorboard, read_wandb

pytestmark = pytest.mark.timeout(120)

EVENTS = [("Train/Samples/train_loss", 2.5, 0), ("Train/Samples/lr", 0.1, 8)]
MORE = [("Train/Samples/train_loss", 1.5, 8), ("Train/Samples/lr", 0.05, 16)]


def _sections(**enabled):
    """A monitor config with the named sections (others disabled)."""
    sections = {"tensorboard": TensorBoardConfig(), "wandb": WandbConfig(), "csv_monitor": CSVMonitorConfig(),
                "comet": CometConfig()}
    sections.update(enabled)
    return SimpleNamespace(**sections)


def test_csv_monitor_one_file_per_event_header_once(tmp_path):
    cfg = CSVMonitorConfig(enabled=True, output_path=str(tmp_path), job_name="job")
    CSVMonitor(cfg).write_events(EVENTS)
    CSVMonitor(cfg).write_events(MORE)  # a resumed run appends below the same header
    files = read_csvs(str(tmp_path / "job"))
    assert files == {"Train_Samples_train_loss": ("train_loss", [(0, 2.5), (8, 1.5)]),
                     "Train_Samples_lr": ("lr", [(8, 0.1), (16, 0.05)])}


def test_csv_monitor_update_config(tmp_path):
    monitor = CSVMonitor(CSVMonitorConfig(enabled=True, output_path=str(tmp_path), job_name="job"))
    monitor.update_config({"train_batch_size": 8, "optimizer": {"type": "AdamW"}})
    text = (tmp_path / "job" / "deepspeed_config.csv").read_text().splitlines()
    assert text == ["key,value", "train_batch_size,8", 'optimizer,"{""type"": ""AdamW""}"']


def test_tensorboard_monitor_event_file(tmp_path):
    monitor = TensorBoardMonitor(TensorBoardConfig(enabled=True, output_path=str(tmp_path), job_name="tb"))
    monitor.write_events(EVENTS)
    # flushed after each write: readable before close
    assert read_tensorboard(str(tmp_path / "tb"))["Train/Samples/lr"] == [(8, pytest.approx(0.1))]
    monitor.write_events(MORE)
    monitor.close()
    scalars = read_tensorboard(str(tmp_path / "tb"))
    assert scalars == {"Train/Samples/train_loss": [(0, 2.5), (8, 1.5)],
                       "Train/Samples/lr": [(8, pytest.approx(0.1)), (16, pytest.approx(0.05))]}


def wandb_teardown():
    """Stop wandb's service process: it writes the offline run file out only then."""
    import wandb

    wandb.teardown()


def test_wandb_monitor_offline_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")
    monitor = WandbMonitor(WandbConfig(enabled=True, project="proj", group="grp", team="team"))
    monitor.write_events(EVENTS)
    monitor.write_events(MORE)
    monitor.close()
    wandb_teardown()
    info, history = read_wandb(str(tmp_path))
    assert info == {"project": "proj", "group": "grp", "entity": "team"}
    assert history == {"Train/Samples/train_loss": [(0, 2.5), (8, 1.5)], "Train/Samples/lr": [(8, 0.1), (16, 0.05)]}


def test_comet_schedule_logs_first_then_every_interval():
    scheduler = EventsLogScheduler(samples_log_interval=10)
    logged = [s for s in (0, 4, 9, 10, 15, 19, 20, 31) if scheduler.needs_logging("a", s)]
    assert logged == [0, 10, 20, 31]
    assert scheduler.needs_logging("b", 31)  # per name


def test_comet_monitor_offline_archive(tmp_path, monkeypatch):
    pytest.importorskip("comet_ml")
    monkeypatch.setenv("COMET_OFFLINE_DIRECTORY", str(tmp_path))
    monkeypatch.setenv("COMET_ERROR_TRACKING_ENABLE", "false")
    monkeypatch.chdir(tmp_path)
    cfg = CometConfig(enabled=True, online=False, project="proj", experiment_name="run-1", samples_log_interval=8)
    monitor = CometMonitor(cfg)
    monitor.write_events(EVENTS + MORE + [("Train/Samples/lr", 0.01, 20)])  # 20 - 16 < 8: skipped
    monitor.close()
    experiment, metrics = read_comet_archive(str(tmp_path))
    assert experiment["project_name"] == "proj"
    metrics = {k: v for k, v in metrics.items() if k.startswith("Train/")}  # comet adds system metrics
    assert metrics == {"Train/Samples/train_loss": [(0, 2.5), (8, 1.5)], "Train/Samples/lr": [(8, 0.1), (16, 0.05)]}


def test_master_writes_every_backend_on_rank_0_only(tmp_path):
    csv_cfg = CSVMonitorConfig(enabled=True, output_path=str(tmp_path / "r1"), job_name="job")
    other = MonitorMaster(_sections(csv_monitor=csv_cfg), rank=1)
    assert other.enabled and not other.active and other.csv_monitor is None
    other.write_events(EVENTS)
    assert not os.path.exists(tmp_path / "r1")

    csv_cfg = CSVMonitorConfig(enabled=True, output_path=str(tmp_path), job_name="job")
    tb_cfg = TensorBoardConfig(enabled=True, output_path=str(tmp_path), job_name="tb")
    master = MonitorMaster(_sections(csv_monitor=csv_cfg, tensorboard=tb_cfg), rank=0)
    assert master.enabled and master.active and master.wandb_monitor is None and master.comet_monitor is None
    assert isinstance(master.tb_monitor, TensorBoardMonitor) and isinstance(master.csv_monitor, CSVMonitor)
    master.write_events(EVENTS)
    master.close()
    assert read_csvs(str(tmp_path / "job"))["Train_Samples_lr"] == ("lr", [(8, 0.1)])
    assert read_tensorboard(str(tmp_path / "tb"))["Train/Samples/train_loss"] == [(0, 2.5)]


def test_nothing_enabled_is_inert(tmp_path):
    master = MonitorMaster(_sections(), rank=0)
    assert not master.enabled and not master.active
    master.write_events(EVENTS)
    master.record_loss(1.0, 0)
    master.after_step(global_samples=8, lr=[0.1], loss_scale=None, step_ms={})


@pytest.mark.parametrize("section, module, package", [
    ("tensorboard", "tensorboard", "tensorboard"), ("wandb", "wandb", "wandb"), ("comet", "comet_ml", "comet_ml"),
])  # fmt: skip
@pytest.mark.parametrize("rank", [0, 1])
def test_missing_library_is_a_one_line_error_on_every_rank(monkeypatch, section, module, package, rank):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == module else real(name, *a))
    cfg = _sections(**{section: type(getattr(_sections(), section))(enabled=True)})
    with pytest.raises(ImportError) as info:
        MonitorMaster(cfg, rank=rank)
    assert str(info.value) == (f"{section}.enabled needs the `{package}` package, which is not installed "
                               f"(pip install {package})")
