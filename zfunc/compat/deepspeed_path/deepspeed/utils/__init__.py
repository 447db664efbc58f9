"""``deepspeed.utils``: zfunc's parameter accessors (``safe_get_full_grad`` and the rest) and a
``logger``."""

import logging

from zfunc.utils import *  # noqa: F401,F403
from zfunc.utils import __all__ as _accessors

logger = logging.getLogger("DeepSpeed")
__all__ = [*_accessors, "logger"]
