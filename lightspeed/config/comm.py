"""The ``comm`` section: lightspeed's own communication settings (DeepSpeed has no such section; its
``comms_logger`` is config/monitoring.py's). Owns the shape of the section only.

``timeout_seconds`` bounds every collective (torch.distributed's timeout and the collective watchdog,
comm/watchdog.py) and a checkpoint save's commit (checkpoint/writer.py). Precedence, first wins:
`init_distributed(timeout=)`, then $LIGHTSPEED_COMM_TIMEOUT (the launcher's --comm_timeout sets it for
every rank), then this key, then 600 s. ``stall_seconds``: a rank that waits in a collective this long
names the peer keeping it waiting (stopped, gone, or making no progress outside collectives, checkpoint
I/O and compilation excepted) and the job ends (comm/heartbeat.py's Note).
"""

from __future__ import annotations

from lightspeed.config.base import Float, Section

DEFAULT_TIMEOUT_SECONDS = 600.0
DEFAULT_STALL_SECONDS = 60.0


class CommConfig(Section):
    """``comm``."""

    timeout_seconds: Float(gt=0) = DEFAULT_TIMEOUT_SECONDS
    """Seconds a collective may take before it fails (see the module docstring for precedence)."""
    stall_seconds: Float(gt=0) = DEFAULT_STALL_SECONDS
    """Seconds without progress after which a rank is reported as stalled."""
