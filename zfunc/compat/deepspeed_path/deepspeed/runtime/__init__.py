"""``deepspeed.runtime``: the engine class, the schedules' names, ``move_to_device``."""

from deepspeed.runtime import engine, lr_schedules, utils, zero

__all__ = ["engine", "lr_schedules", "utils", "zero"]
