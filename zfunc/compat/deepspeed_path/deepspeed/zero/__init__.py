"""``deepspeed.zero``: zfunc's `GatheredParameters`; ``Init`` builds the model whole in host
memory (`zfunc.compat.zero.WholeInit`), so weights written or loaded inside it land."""

from zfunc.compat.zero import GatheredParameters, register_external_parameter
from zfunc.compat.zero import WholeInit as Init

__all__ = ["GatheredParameters", "Init", "register_external_parameter"]
