"""``deepspeed.moe``: ``utils`` (the MoE parameter-group helper)."""

from deepspeed.moe import utils

__all__ = ["utils"]
