"""``deepspeed.utils`` under the engine: the full training state of a partitioned parameter, read and written
(:mod:`~infinity.deepspeed.utils.full_state`), and a checkpoint's fp32 state dict without an engine
(:mod:`~infinity.deepspeed.utils.zero_to_fp32`), and ``logger`` and ``log_dist``
(:mod:`~infinity.deepspeed.utils.logging`), under DeepSpeed's names and import paths."""

from infinity.deepspeed.utils import zero_to_fp32
from infinity.deepspeed.utils.logging import log_dist, logger
from infinity.deepspeed.utils.full_state import (safe_get_full_fp32_param, safe_get_full_grad,
                                                 safe_get_full_optimizer_state, safe_set_full_fp32_param,
                                                 safe_set_full_optimizer_state)
from infinity.deepspeed.utils.zero_to_fp32 import (convert_zero_checkpoint_to_fp32_state_dict,
                                                   get_fp32_state_dict_from_zero_checkpoint,
                                                   load_state_dict_from_zero_checkpoint)

__all__ = ["convert_zero_checkpoint_to_fp32_state_dict", "get_fp32_state_dict_from_zero_checkpoint",
           "load_state_dict_from_zero_checkpoint", "log_dist", "logger", "safe_get_full_fp32_param",
           "safe_get_full_grad", "safe_get_full_optimizer_state", "safe_set_full_fp32_param",
           "safe_set_full_optimizer_state", "zero_to_fp32"]
