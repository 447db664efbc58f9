"""``deepspeed.moe.utils``: zfunc's (`zfunc.moe.utils`)."""

from zfunc.moe.utils import *  # noqa: F401,F403
from zfunc.moe.utils import __all__  # noqa: F401
