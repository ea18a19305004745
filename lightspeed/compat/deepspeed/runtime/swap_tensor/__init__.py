"""`deepspeed.runtime.swap_tensor`: `MIN_SWAPPABLE_BYTES`, the smallest tensor DeepSpeed swaps to NVMe
(its aio block size, 1 MiB); a size code written for DeepSpeed reads to make tensors worth swapping."""

MIN_SWAPPABLE_BYTES = 1024**2

__all__ = ["MIN_SWAPPABLE_BYTES"]
