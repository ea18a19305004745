"""`deepspeed.utils.zero_to_fp32`: lightspeed's streaming consolidation (`lightspeed.checkpoint.zero_to_fp32`),
which reads DeepSpeed's checkpoints and lightspeed's alike, under DeepSpeed's names."""

from lightspeed.checkpoint.zero_to_fp32 import (  # noqa: F401
    convert_zero_checkpoint_to_fp32_state_dict,
    convert_zero_checkpoint_to_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
    main,
)

__all__ = ["convert_zero_checkpoint_to_fp32_state_dict", "convert_zero_checkpoint_to_state_dict",
           "get_fp32_state_dict_from_zero_checkpoint", "load_state_dict_from_zero_checkpoint", "main"]
