"""``deepspeed.zero``: zfunc's `Init` and `GatheredParameters`."""

from zfunc.zero import GatheredParameters, Init, register_external_parameter

__all__ = ["GatheredParameters", "Init", "register_external_parameter"]
