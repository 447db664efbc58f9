"""``deepspeed.runtime.lr_schedules``: the names of the config ``scheduler`` types zfunc reads."""

from zfunc.core.deepspeed_config import SCHEDULER_TYPES as VALID_LR_SCHEDULES

__all__ = ["VALID_LR_SCHEDULES"]
