"""`deepspeed.utils.zero_to_fp32`: converting a sharded ZeRO checkpoint into one fp32 state dict offline
is not built in lightspeed yet (lightspeed's own checkpoints reload at any world size through the
engine); each function raises NotImplementedError naming the feature."""

from lightspeed.compat.deepspeed._missing import missing_function

_FEATURE = "converting a ZeRO checkpoint to an fp32 state dict (zero_to_fp32)"
get_fp32_state_dict_from_zero_checkpoint = missing_function(
    "deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint", _FEATURE)
convert_zero_checkpoint_to_fp32_state_dict = missing_function(
    "deepspeed.utils.zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict", _FEATURE)
load_state_dict_from_zero_checkpoint = missing_function(
    "deepspeed.utils.zero_to_fp32.load_state_dict_from_zero_checkpoint", _FEATURE)

__all__ = ["convert_zero_checkpoint_to_fp32_state_dict", "get_fp32_state_dict_from_zero_checkpoint",
           "load_state_dict_from_zero_checkpoint"]
