"""``deepspeed.utils``: zfunc's parameter accessors (``safe_get_full_grad`` and the rest) and a
``logger``."""

from zfunc.utils import *  # noqa: F401,F403
from zfunc.utils import __all__ as _accessors

from deepspeed.utils import logging
from deepspeed.utils.logging import logger

__all__ = [*_accessors, "logger", "logging"]
