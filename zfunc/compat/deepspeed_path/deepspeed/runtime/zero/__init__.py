"""``deepspeed.runtime.zero``: as ``deepspeed.zero``."""

from deepspeed.zero import GatheredParameters, Init
from deepspeed.runtime.zero import partition_parameters

__all__ = ["GatheredParameters", "Init", "partition_parameters"]
