"""The autotuner's memory model: a candidate's peak memory per rank, predicted from one measured run.

Owns `Calibration` (what a profiled run measured) and `MemoryModel.predict`. Must not run anything.

Note: [the model]
    A calibration run (one profiled step, smallest micro batch) reports the engine's
    `memory_breakdown()` (bytes of lp_params, master_params, grads and optimizer_state per device
    type) and the bytes autograd saved for backward in one forward. The breakdown is turned back into
    whole-model sizes by undoing the sharding of the stage it ran at (ZeRO-1 shards master weights and
    optimizer state over the dp ranks, ZeRO-2 also gradients, ZeRO-3 also the lp parameters), so a
    candidate at any stage and offload gets its device bytes by sharding them again, minus what
    offload keeps on the host. Activations scale with the micro batch: saved bytes / calibrated micro
    x micro, measured per activation-checkpointing setting. On an accelerator with its own memory the
    rest of the measured peak (workspace, allocator rounding) is added as a constant. A candidate
    whose prediction exceeds the budget is pruned without being run.
"""

from __future__ import annotations

from dataclasses import dataclass

STATE_CATEGORIES = ("lp_params", "master_params", "grads", "optimizer_state")


def sharded(stage: int) -> set[str]:
    """The categories ZeRO `stage` partitions over the data-parallel ranks."""
    return {"master_params", "optimizer_state"} | ({"grads"} if stage >= 2 else set()) | \
        ({"lp_params"} if stage >= 3 else set()) if stage >= 1 else set()


@dataclass
class Calibration:
    stage: int
    micro: int
    dp: int
    breakdown: dict[str, dict[str, int]]
    activation_bytes: int
    peak_bytes: int


class MemoryModel:
    """Predicts a candidate's peak bytes on `device_type` (the accelerator's, e.g. "cuda" or "cpu")."""

    def __init__(self, device_type: str):
        self.device_type = device_type
        self.totals: dict[str, int] | None = None
        self.act_per_sample: dict[bool, float] = {}  # by activation checkpointing
        self.overhead = 0

    def fit(self, cal: Calibration, ckpt: bool) -> None:
        totals = {c: 0 for c in STATE_CATEGORIES}
        shard = sharded(cal.stage)
        for cats in cal.breakdown.values():
            for cat, n in cats.items():
                if cat in totals:
                    totals[cat] += n * (cal.dp if cat in shard else 1)
        if self.totals is None:
            self.totals = totals
        self.act_per_sample[ckpt] = cal.activation_bytes / cal.micro
        if self.device_type != "cpu":  # host RSS holds the whole runtime: only a device's peak is all tensors
            on_device = sum(cal.breakdown.get(self.device_type, {}).values())
            self.overhead = max(self.overhead, cal.peak_bytes - on_device - cal.activation_bytes)

    def ready(self, ckpt: bool) -> bool:
        return self.totals is not None and ckpt in self.act_per_sample

    def states_on_device(self, stage: int, offload: bool, dp: int) -> int:
        assert self.totals is not None
        shard = sharded(stage)
        out = 0
        for cat, n in self.totals.items():
            if offload and cat in ("master_params", "optimizer_state") and self.device_type != "cpu":
                continue
            out += n // dp if cat in shard else n
        return out

    def predict(self, stage: int, offload: bool, ckpt: bool, micro: int, dp: int) -> int:
        return int(self.states_on_device(stage, offload, dp) + self.act_per_sample[ckpt] * micro + self.overhead)
