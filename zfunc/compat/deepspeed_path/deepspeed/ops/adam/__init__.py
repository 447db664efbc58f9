"""``deepspeed.ops.adam``: zfunc's (`zfunc.compat.deepspeed_adam`)."""

from zfunc.compat.deepspeed_adam import DeepSpeedCPUAdam, FusedAdam  # noqa: F401

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]
