"""`deepspeed.checkpoint.utils`: `clone_tensors_for_torch_save` (lightspeed/checkpoint/tensors.py) and
DeepSpeed's functions naming a checkpoint's per-rank files (the layout of lightspeed/checkpoint/deepspeed_format.py)."""

import os

from lightspeed.checkpoint.tensors import clone_tensors_for_torch_save

MODEL_FILE_PREFIX = "mp_rank_"
MODEL_FILE_SUFFIX = "_model_states.pt"
ZERO_FILE_PREFIX = "zero_pp_rank_"
OPTIM_FILE_SUFFIX = "_optim_states.pt"


def get_model_ckpt_name_for_rank(base_folder, mp_rank_str: str) -> str:
    """The model-states file of model-parallel rank `mp_rank_str` (written "00") in `base_folder`."""
    return os.path.join(base_folder, MODEL_FILE_PREFIX + mp_rank_str + MODEL_FILE_SUFFIX)


def get_zero_ckpt_name_for_rank(base_folder, dp_rank: int, mp_rank: int) -> str:
    """The ZeRO optimizer-states file of data-parallel rank `dp_rank`, model-parallel rank `mp_rank`."""
    return os.path.join(base_folder, f"{ZERO_FILE_PREFIX}{dp_rank}_{MODEL_FILE_PREFIX}{mp_rank:02d}{OPTIM_FILE_SUFFIX}")


def get_layer_ckpt_name_for_rank(base_folder, layer_id: str, tp_rank: int) -> str:
    """The file of pipeline layer `layer_id` (written "layer_01") at tensor-parallel rank `tp_rank`."""
    return os.path.join(base_folder, f"{layer_id}-model_{tp_rank:02d}{MODEL_FILE_SUFFIX}")


__all__ = ["clone_tensors_for_torch_save", "get_layer_ckpt_name_for_rank", "get_model_ckpt_name_for_rank",
           "get_zero_ckpt_name_for_rank"]
