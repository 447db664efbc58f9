"""``deepspeed.accelerator.get_accelerator``: the device this process computes on."""

from zfunc.compat.accelerator import get_accelerator

__all__ = ["get_accelerator"]
