"""`deepspeed.compression`: DeepSpeed's model compression (quantization-aware training, pruning, layer
reduction) is not built in lightspeed yet. The modules exist so scripts that import them at top
level run; the compression entry points (`init_compression`, `redundancy_clean`,
`compression_scheduler`) raise NotImplementedError when called. The module-surgery helpers DeepSpeed
keeps here (`helper.recursive_getattr`, `recursive_setattr`, `convert_conv1d_to_linear`), which
DeepSpeed-Chat's LoRA code uses without compressing anything, work."""

from lightspeed.compat.deepspeed.compression.compress import init_compression, redundancy_clean
from lightspeed.compat.deepspeed.compression.helper import convert_conv1d_to_linear
from lightspeed.compat.deepspeed.compression.scheduler import compression_scheduler

__all__ = ["compression_scheduler", "convert_conv1d_to_linear", "init_compression", "redundancy_clean"]
