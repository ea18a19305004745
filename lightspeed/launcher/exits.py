"""Which worker failed first, among the failures torch.distributed.elastic reports when a job fails.

Owns `first_failure` and `job_status`. Must not start, signal or reap workers (the elastic agent does), nor import torch.

Note: the first failure
    torch's own choice (`ChildFailedError.get_first_failure`) orders failures by a timestamp in whole
    seconds: the time in the worker's error file, else the moment the agent looked. When one rank
    fails, its peers fail within milliseconds (their collectives see "Connection closed by peer"), and
    the agent then stops the survivors with SIGTERM and lists them as failures too, so the whole
    second ties and torch names whichever rank comes first in its table, most often a healthy rank 0
    killed by SIGTERM (measured: a peer named in 10 of 11 runs where rank 1 raised). Exit times alone
    would not fix it: a peer's report follows the death within 3 ms (measured, 2 busy CPU cores), less
    than an observer in the agent may take to notice the exit. So failures are ordered by what they
    are first: a rank's own failure (an uncaught exception, which comm/watchdog.py records in the
    error file; a signal other than SIGTERM; an exit status), then a collective that failed or stalled
    (the watchdog marks its error file with `ERROR_COLLECTIVE_KEY`: what a peer's failure causes in
    the others), then SIGTERM without an error file (how the agent stops the survivors); within each,
    by time: the precise time in the error file (`ERROR_TIME_KEY`), else torch's whole-second one.
"""

from __future__ import annotations

import signal
from typing import Any

from lightspeed.comm.watchdog import ERROR_COLLECTIVE_KEY, ERROR_TIME_KEY, EXIT_COMM_TIMEOUT


def _error_data(failure: Any) -> dict:
    data = getattr(failure, "error_file_data", None)
    return data if isinstance(data, dict) else {}


def _kind(failure: Any) -> int:
    """0: the rank's own failure; 1: a collective failed or stalled; 2: stopped by SIGTERM. A rank the
    agent stopped after it wrote its error file failed before the agent stopped it: the file says how."""
    data = _error_data(failure)
    if ERROR_TIME_KEY in data:
        return 1 if data.get(ERROR_COLLECTIVE_KEY) is True else 0
    return 2 if failure.exitcode == -signal.SIGTERM else 0


def first_failure(failures: dict[int, Any]) -> tuple[int, Any]:
    """(rank, failure) of the failure that came first among `failures` ({global rank: torch's
    ProcessFailure}), by the rule in the module Note."""
    def when(failure: Any) -> float:
        precise = _error_data(failure).get(ERROR_TIME_KEY)
        return float(precise) if isinstance(precise, (int, float)) else float(failure.timestamp)

    rank = min(failures, key=lambda r: (_kind(failures[r]), when(failures[r]), r))
    return rank, failures[rank]


def job_status(failure: Any) -> int:
    """The job's exit status for its first failure: the worker's exit status (128+N when signal N ended
    it), except for a worker the agent stopped (SIGTERM) after it had reported its own failure: then
    the status that failure would have ended it with (1, or `EXIT_COMM_TIMEOUT` for a collective that
    failed or stalled), not the agent's SIGTERM."""
    code = failure.exitcode
    if code == -signal.SIGTERM and ERROR_TIME_KEY in _error_data(failure):
        return EXIT_COMM_TIMEOUT if _kind(failure) == 1 else 1
    if code > 0:
        return code
    return 128 - code if code < 0 else 1
