"""`deepspeed.runtime.lr_schedules`: DeepSpeed's five LR schedules (lightspeed/optim/schedules.py) and
the names accelerate checks a config's scheduler against."""

from lightspeed.optim.schedules import LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR

LR_RANGE_TEST = "LRRangeTest"
ONE_CYCLE = "OneCycle"
WARMUP_LR = "WarmupLR"
WARMUP_DECAY_LR = "WarmupDecayLR"
WARMUP_COSINE_LR = "WarmupCosineLR"
VALID_LR_SCHEDULES = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]

WARMUP_LOG_RATE = "log"
WARMUP_LINEAR_RATE = "linear"

__all__ = ["LRRangeTest", "OneCycle", "VALID_LR_SCHEDULES", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR",
           "LR_RANGE_TEST", "ONE_CYCLE", "WARMUP_COSINE_LR", "WARMUP_DECAY_LR", "WARMUP_LR"]
