"""``deepspeed.utils.logging.logger``: the ``DeepSpeed`` logger."""

import logging

logger = logging.getLogger("DeepSpeed")
__all__ = ["logger"]
