"""``deepspeed.runtime.zero``: zfunc's `Init` and `GatheredParameters`."""

from zfunc.zero import GatheredParameters, Init

__all__ = ["GatheredParameters", "Init"]
