"""``deepspeed.moe`` names for dense models (`zfunc.compat.moe.utils`); zfunc has no expert parallelism."""

from zfunc.compat.moe import utils as utils

__all__ = ["utils"]
