"""What every DeepSpeed worker of the tests shares (they run as scripts in DeepSpeed's own environment, so
they import this from their own directory, not lightspeed's test helpers): a free port for the gloo
rendezvous, and the way out once the results are on disk."""

from __future__ import annotations

import os
import socket
import sys

import torch.distributed


def free_port() -> int:
    """A TCP port on 127.0.0.1 nothing listens on now (the rendezvous of the next world)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def leave() -> None:
    """Wait until every rank is done, then leave without gloo's (or DeepSpeed's) teardown, which now and
    then aborts the process ("terminate called without an active exception") on a loaded two-core machine.
    Call it only after the results are written."""
    torch.distributed.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
