"""Monitoring and profiling sections: ``tensorboard``, ``wandb``, ``csv_monitor``, ``comet``,
``trackio`` (DeepSpeed's ``monitor/config.py``), ``comms_logger`` (``comm/config.py``),
``flops_profiler`` (``profiling/constants.py``) and ``timers`` (``utils/config.py``).
Owns the section shapes only; no logging backends are imported here.
"""

from __future__ import annotations

from typing import Optional

from lightspeed.config.base import Bool, Float, Int, NonNegInt, Section, Str, StrList


class TensorBoardConfig(Section):
    """``tensorboard``."""

    enabled: Bool = False
    output_path: Str = ""
    """Directory for the event files; empty means under the launch directory."""
    job_name: Str = "DeepSpeedJobName"


class WandbConfig(Section):
    """``wandb``."""

    enabled: Bool = False
    group: Optional[Str] = None
    team: Optional[Str] = None
    project: Str = "deepspeed"


class CSVMonitorConfig(Section):
    """``csv_monitor``."""

    enabled: Bool = False
    output_path: Str = ""
    job_name: Str = "DeepSpeedJobName"


class CometConfig(Section):
    """``comet``."""

    enabled: Bool = False
    samples_log_interval: Int(ge=1) = 100
    project: Optional[Str] = None
    workspace: Optional[Str] = None
    api_key: Optional[Str] = None
    experiment_name: Optional[Str] = None
    experiment_key: Optional[Str] = None
    online: Optional[Bool] = None
    mode: Optional[Str] = None


class TrackioConfig(Section):
    """``trackio``."""

    enabled: Bool = False
    project: Str = "deepspeed"


class CommsLoggerConfig(Section):
    """``comms_logger``: record every collective (synchronizing, so slower)."""

    enabled: Bool = False
    verbose: Bool = False
    prof_all: Bool = True
    debug: Bool = False
    prof_ops: StrList = []


class FlopsProfilerConfig(Section):
    """``flops_profiler``. DeepSpeed also turns on wall_clock_breakdown when this is enabled."""

    enabled: Bool = False
    recompute_fwd_factor: Float(ge=0.0) = 0.0
    profile_step: NonNegInt = 1
    module_depth: Int() = -1
    top_modules: Int() = 1
    detailed: Bool = True
    output_file: Optional[Str] = None


class ThroughputTimerConfig(Section):
    """``timers.throughput``."""

    enabled: Bool = True
    synchronized: Bool = True


class TimersConfig(Section):
    """``timers``."""

    throughput: ThroughputTimerConfig = ThroughputTimerConfig()


MONITOR_SECTIONS = ("tensorboard", "wandb", "csv_monitor", "comet", "trackio")
