"""`deepspeed.compression.compress`: DeepSpeed's compression entry points, each raising
NotImplementedError when called (model compression is not built)."""

from lightspeed.compat.deepspeed._missing import missing_function

COMPRESSION = "model compression (compression_training: quantization, pruning, layer reduction)"

init_compression = missing_function("deepspeed.compression.compress.init_compression", COMPRESSION)
redundancy_clean = missing_function("deepspeed.compression.compress.redundancy_clean", COMPRESSION)
student_initialization = missing_function("deepspeed.compression.compress.student_initialization", COMPRESSION)

__all__ = ["init_compression", "redundancy_clean", "student_initialization"]
