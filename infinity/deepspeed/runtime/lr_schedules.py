"""``deepspeed.runtime.lr_schedules``: the names of the schedulers a config's ``scheduler`` block may give, which
libraries read to tell a DeepSpeed scheduler from a script's own (accelerate's ``prepare``)."""

from infinity.config.lr_schedule import DEEPSPEED_SCHEDULERS

VALID_LR_SCHEDULES = list(DEEPSPEED_SCHEDULERS)

__all__ = ["VALID_LR_SCHEDULES"]
