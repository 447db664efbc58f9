"""``deepspeed.checkpoint.utils.clone_tensors_for_torch_save``."""

from zfunc.compat.accelerator import clone_tensors_for_torch_save

__all__ = ["clone_tensors_for_torch_save"]
