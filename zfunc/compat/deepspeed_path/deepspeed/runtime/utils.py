"""``deepspeed.runtime.utils.move_to_device``."""

from zfunc.compat.accelerator import move_to_device

__all__ = ["move_to_device"]
