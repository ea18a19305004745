"""The comms logger (DeepSpeed's `comms_logger` config block and `deepspeed.comm.log_summary`).

Owns: the per-process record of profiled collectives (per operation and message size: count,
latencies, algorithm and bus bandwidth), its configuration, and the summary table. Must not: issue
the collectives it times (the `Communicator` does, and calls `record`), or print (it logs; rank 0
by default).

Note (semantics, after DeepSpeed's utils/comms_logging.py): an op is profiled when `enabled` and
either `prof_all` or its name is in `prof_ops`. Profiled ops run to completion and are timed with a
device synchronization on both sides, so they no longer overlap with compute (slower, as DeepSpeed
warns). The message size is what one rank contributes (for reduce-scatter, its part of the
result). Bandwidths use DeepSpeed's formulas with n the group's size, in Gbps: all_reduce algbw
2*size/t, busbw size/t*2(n-1)/n; all_gather and reduce_scatter size*n/t, busbw times (n-1)/n;
all_to_all size/t, busbw times (n-1)/n; broadcast and the rest size/t for both. Averages drop the
top and bottom 10% of the samples (DeepSpeed's trim_mean). `verbose` logs every op as it happens;
`debug` adds the calling function to the record name.

Note (one per process): like `deepspeed.comm`'s logger this is process-wide state, configured by
`initialize()` from the config and read by `log_summary()`.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from lightspeed._utils.logging import get_logger

logger = get_logger(__name__)

_BUS_FACTOR = {  # name -> (algorithm-bandwidth size multiplier as a function of n, bus factor)
    "all_reduce": (lambda n: 2.0, lambda n: (n - 1) / n),
    "all_gather": (lambda n: float(n), lambda n: (n - 1) / n),
    "reduce_scatter": (lambda n: float(n), lambda n: (n - 1) / n),
    "all_to_all_single": (lambda n: 1.0, lambda n: (n - 1) / n),
}


def bandwidths(op: str, nbytes: int, latency_ms: float, world_size: int) -> tuple[float, float]:
    """(algorithm bandwidth, bus bandwidth) in Gbps of one op (DeepSpeed's calc_bw_log)."""
    if latency_ms <= 0:
        return 0.0, 0.0
    size_mult, bus = _BUS_FACTOR.get(op, (lambda n: 1.0, lambda n: 1.0))
    n = max(world_size, 1)
    algbw = nbytes * size_mult(n) / latency_ms
    busbw = algbw * bus(n) if op != "all_reduce" else nbytes / latency_ms * 2 * (n - 1) / n
    return algbw * 8 / 1e6, busbw * 8 / 1e6


def trim_mean(values: list[float], fraction: float = 0.1) -> float:
    """Mean without the lowest and highest `fraction` of the values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    cut = int(len(ordered) * fraction)
    kept = ordered[cut:len(ordered) - cut] or ordered
    return sum(kept) / len(kept)


def human_size(nbytes: int) -> str:
    if nbytes <= 0:
        return "0B"
    units = ("B", "KB", "MB", "GB", "TB", "PB")
    i = min(int(math.floor(math.log(nbytes, 1024))), len(units) - 1)
    return f"{round(nbytes / 1024 ** i, 2)} {units[i]}"


def _caller() -> str:
    """The first function outside lightspeed/comm/ on the stack: the one that asked for the collective."""
    frame = sys._getframe(1)
    while frame is not None and _COMM_DIR in frame.f_code.co_filename:
        frame = frame.f_back
    return frame.f_code.co_name if frame is not None else "?"


_COMM_DIR = os.path.dirname(os.path.abspath(__file__))


@dataclass
class _Record:
    count: int = 0
    latencies: list[float] = field(default_factory=list)
    algbw: list[float] = field(default_factory=list)
    busbw: list[float] = field(default_factory=list)


class CommsLogger:
    """Records profiled collectives of this process; see the module docstring."""

    def __init__(self):
        self.enabled = False
        self.verbose = False
        self.prof_all = True
        self.debug = False
        self.prof_ops: list[str] = []
        self.records: dict[str, dict[int, _Record]] = {}

    def configure(self, cfg) -> None:
        """From the `comms_logger` config section (enabled, verbose, prof_all, debug, prof_ops)."""
        self.enabled = bool(cfg.enabled)
        self.verbose, self.prof_all, self.debug = bool(cfg.verbose), bool(cfg.prof_all), bool(cfg.debug)
        self.prof_ops = list(cfg.prof_ops)

    def profiles(self, op: str) -> bool:
        return self.enabled and (self.prof_all or op in self.prof_ops)

    def start_profiling_op(self, ops: list[str]) -> None:
        self.prof_ops = sorted(set(self.prof_ops) | set(ops))

    def stop_profiling_op(self, ops: list[str]) -> None:
        self.prof_ops = [op for op in self.prof_ops if op not in ops]

    def reset(self) -> None:
        self.records.clear()

    def record(self, op: str, latency_ms: float, nbytes: int, world_size: int) -> None:
        algbw, busbw = bandwidths(op, nbytes, latency_ms, world_size)
        name = op
        if self.debug:
            name = f"{op} | [Caller Func: {_caller()}]"
        rec = self.records.setdefault(name, {}).setdefault(nbytes, _Record())
        rec.count += 1
        rec.latencies.append(latency_ms)
        rec.algbw.append(algbw)
        rec.busbw.append(busbw)
        if self.verbose:
            logger.info("comm op: %s | time (ms): %.2f | msg size: %s | algbw (Gbps): %.2f | busbw (Gbps): %.2f",
                        name, latency_ms, human_size(nbytes), algbw, busbw)

    def summary(self, show_straggler: bool = False) -> str:
        """The table, one row per (op, message size). With `show_straggler`, every rank of the default
        group must call it with the same records: the straggler time is this rank's latency minus the
        smallest one across ranks (an all-reduce of the latencies)."""
        keys = [(name, size) for name in sorted(self.records) for size in sorted(self.records[name])]
        mins: dict[tuple[str, int], list[float]] = {}
        if show_straggler and dist.is_initialized() and dist.get_world_size() > 1:
            shapes = [None] * dist.get_world_size()
            dist.all_gather_object(shapes, [(k, self.records[k[0]][k[1]].count) for k in keys])
            if any(s != shapes[0] for s in shapes):
                raise RuntimeError("log_summary(show_straggler=True): the ranks recorded different collectives "
                                   "(op, message size or count), so their latencies cannot be compared")
            flat = [lat for k in keys for lat in self.records[k[0]][k[1]].latencies]
            if flat:
                t = torch.tensor(flat, dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MIN)
                pos = 0
                for k in keys:
                    n = self.records[k[0]][k[1]].count
                    mins[k] = t[pos:pos + n].tolist()
                    pos += n
        cols = ["Comm. Op", "Message Size", "Count", "Total Latency(ms)", "Avg Latency(ms)", "tput_avg (Gbps)",
                "busbw_avg (Gbps)"]
        if mins:
            cols += ["Total straggler(ms)", "Avg straggler(ms)"]
        lines = ["".join(f"{c:<20}" for c in cols)]
        last = None
        for name, size in keys:
            if name != last:
                lines.append(name)
                last = name
            rec = self.records[name][size]
            row = [" ", human_size(size), str(rec.count), f"{sum(rec.latencies):.2f}", f"{trim_mean(rec.latencies):.2f}",
                   f"{trim_mean(rec.algbw):.2f}", f"{trim_mean(rec.busbw):.2f}"]
            if mins:
                lag = [a - b for a, b in zip(rec.latencies, mins[(name, size)])]
                row += [f"{sum(lag):.2f}", f"{trim_mean(lag):.2f}"]
            lines.append("".join(f"{c:<20}" for c in row))
        return "\n".join(lines)


COMMS_LOGGER = CommsLogger()


def configure(cfg) -> None:
    """Apply the `comms_logger` config section to this process's logger."""
    COMMS_LOGGER.configure(cfg)


def log_summary(show_straggler: bool = False, return_dict: bool = False):
    """Log (rank 0) the summary of every profiled collective so far and return the table, or with
    `return_dict` DeepSpeed's record dict ({op: {message size: [count, latencies, algbw, busbw]}}).
    Every rank of the default group must call it when `show_straggler` is set."""
    table = COMMS_LOGGER.summary(show_straggler=show_straggler)
    logger.info("communication summary:\n%s", table)
    if return_dict:
        return {name: {size: [r.count, list(r.latencies), list(r.algbw), list(r.busbw)] for size, r in sizes.items()}
                for name, sizes in COMMS_LOGGER.records.items()}
    return table
