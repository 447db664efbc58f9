"""``deepspeed.checkpoint``: ``utils.clone_tensors_for_torch_save``."""

from deepspeed.checkpoint import utils

__all__ = ["utils"]
