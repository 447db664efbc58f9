"""``deepspeed.runtime.engine.DeepSpeedEngine``: zfunc's `Engine`."""

from zfunc.compat.engine import Engine as DeepSpeedEngine

__all__ = ["DeepSpeedEngine"]
