"""Training monitors (DeepSpeed's `deepspeed.monitor`): TensorBoard, CSV, Weights & Biases and Comet
backends behind `MonitorMaster`, and the events the engine writes after each optimizer step.

Layer: above config, below runtime; imports only `_utils` (and the optional backend libraries,
lazily, when a backend is built).
"""

from lightspeed.monitor.base import Monitor
from lightspeed.monitor.comet import CometMonitor
from lightspeed.monitor.csv_monitor import CSVMonitor, csvMonitor
from lightspeed.monitor.monitor import LOSS_SCALE, LR, TIMER_EVENTS, TRAIN_LOSS, MonitorMaster
from lightspeed.monitor.tensorboard import TensorBoardMonitor
from lightspeed.monitor.wandb import WandbMonitor

__all__ = [
    "Monitor", "MonitorMaster", "TensorBoardMonitor", "CSVMonitor", "csvMonitor", "WandbMonitor", "CometMonitor",
    "TRAIN_LOSS", "LR", "LOSS_SCALE", "TIMER_EVENTS",
]
